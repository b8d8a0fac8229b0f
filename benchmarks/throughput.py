"""The engine vs the loops TensorFlow users run, each as its users run it.

    bash benchmarks/setup_orbit.sh          # once: Orbit's own venv
    python -m benchmarks.throughput [--rounds=3 --steps=30]
    python -m benchmarks.throughput --strategy=one_device --cpus=0  # one core

Variants, each in its own fresh process, rounds alternating the order:
  engine   the engine's built-in job (`engine.run`), with its defaults;
  fit      Keras 3 `compile` + `fit` (benchmarks/baselines.py);
  minimal  a hand-written loop, one tf.function call per step (same file);
  orbit    TF Model Garden's Orbit Controller + StandardTrainer on tf_keras,
           started with benchmarks/.orbit_venv's python (skipped, and said
           so, when that venv is absent).
The baselines run as plain scripts with the environment this command was
started with (importing the engine sets no variable), and without the
engine's malloc tuning: TensorFlow's defaults, as their
users have them. Same model (MobileNetV2, random init), batch, Adam and
strategy for all; images in memory for the baselines, the engine's synthetic
data set for the engine. Prints every rate, the medians and the ratios
engine / baseline (targets: >= 1.10 Orbit, >= 1.30 fit), and each variant's
CPU seconds per run (its whole process, start-up included), which a loaded
machine moves much less than the rates. --profile_dir also
traces one host loop (--steps_per_loop steps) of the engine and of Orbit
after the timed steps and prints benchmarks.xplane_summary of each.
"""
import json
import os
import statistics
import sys

from absl import app
from absl import flags

from benchmarks import engine_timer
from benchmarks import variants as variants_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ORBIT_PYTHON = os.path.join(HERE, ".orbit_venv", "bin", "python")

flags.DEFINE_enum("variant", None, ["engine"],
                  "Internal: run the engine's variant in this process.")
flags.DEFINE_integer("steps", 30, "Timed steps per variant.")
flags.DEFINE_integer("warmup", 10, "Untimed steps first.")
flags.DEFINE_integer("rounds", 3, "Rounds, alternating the order.")
flags.DEFINE_integer("image_size", 64, "Image side.")
flags.DEFINE_integer("batch_size_per_replica", 16, "Per-replica batch.")
flags.DEFINE_enum("strategy", "mirrored", ["mirrored", "one_device"],
                  "tf.distribute strategy of every variant.")
flags.DEFINE_integer("cpu_devices", 2, "Logical CPU devices (mirrored).")
flags.DEFINE_string("model", "mobilenet_v2", "Model (the baselines: "
                    "mobilenet_v2 only).")
flags.DEFINE_integer("steps_per_loop", 10, "Engine and Orbit steps per host "
                     "call.")
flags.DEFINE_string("cpus", "", "Pin every variant to these cores "
                    "(taskset -c), e.g. 0 for one core.")
flags.DEFINE_list("baselines", ["fit", "minimal", "orbit"],
                  "Baselines to run next to the engine.")
flags.DEFINE_string("orbit_python", ORBIT_PYTHON,
                    "Python of the venv that benchmarks/setup_orbit.sh made.")
flags.DEFINE_string("profile_dir", "", "Trace one host loop of the engine "
                    "and of Orbit into DIR/<variant> and summarise them.")
flags.DEFINE_bool("fused_batchnorm", True, "The engine's --fused_batchnorm.")
flags.DEFINE_bool("with_keras_bn", False, "Also run the engine with "
                  "--nofused_batchnorm, as variant engine_keras_bn.")
flags.DEFINE_string("baseline_tree", "",
                    "Also run the engine from this checkout (e.g. a worktree "
                    "of the commit before a change) as variant engine_before, "
                    "side by side with this one (its benchmarks/throughput.py "
                    "must take this one's flags).")
FLAGS = flags.FLAGS
_SHARED = ("steps", "warmup", "image_size", "batch_size_per_replica",
           "strategy", "cpu_devices", "steps_per_loop")


def _fields():
  """The built-in job's flag values for this benchmark."""
  timed = FLAGS.warmup + FLAGS.steps
  profile = bool(FLAGS.profile_dir)
  mirrored = FLAGS.strategy == "mirrored"
  return dict(
      model=FLAGS.model, image_size=FLAGS.image_size,
      strategy=FLAGS.strategy, cpu_devices=FLAGS.cpu_devices if mirrored else 0,
      optimizer="adam", batch_size_per_replica=FLAGS.batch_size_per_replica,
      train_steps=timed + (FLAGS.steps_per_loop if profile else 0),
      steps_per_loop=FLAGS.steps_per_loop, log_every=1000,
      synthetic_examples=4096, export=False,
      fused_batchnorm=FLAGS.fused_batchnorm,
      profile_steps=(timed + 1, timed + FLAGS.steps_per_loop) if profile
      else (),
      model_dir=(os.path.join(FLAGS.profile_dir, "engine") if profile else
                 engine_timer.scratch_dir("tfengine_bench_")))


def run_engine(fields):
  """Timed like the baselines: all steps after the warm-up, end to end."""
  return engine_timer.engine_rate(fields, FLAGS.warmup, FLAGS.steps)


def _commands():
  """{variant: Command}: the engine here, the baselines as plain scripts."""
  shared = [f"--{n}={FLAGS[n].value}" for n in _SHARED]
  pin = ["taskset", "-c", FLAGS.cpus] if FLAGS.cpus else []
  # The environment the user started us with (importing the engine sets
  # none; its malloc tuning is made by the engine's run, not inherited).
  user_env = dict(os.environ)
  script = os.path.join(HERE, "baselines.py")
  profile = [f"--profile_dir={FLAGS.profile_dir}/orbit"] if (
      FLAGS.profile_dir) else []
  commands = {"engine": variants_lib.Command(
      pin + [sys.executable, "-m", "benchmarks.throughput", "--variant=engine",
             f"--model={FLAGS.model}", f"--profile_dir={FLAGS.profile_dir}",
             f"--fused_batchnorm={FLAGS.fused_batchnorm}", *shared],
      user_env, ROOT)}
  if FLAGS.with_keras_bn:
    commands["engine_keras_bn"] = commands["engine"]._replace(
        argv=commands["engine"].argv + ["--nofused_batchnorm"])
  if FLAGS.baseline_tree:
    # The other checkout's own throughput.py: only the flags it shares with
    # this one (it may predate --strategy, --profile_dir, --fused_batchnorm),
    # so compare on mirrored.
    tree = os.path.abspath(FLAGS.baseline_tree)
    old = [f"--{n}={FLAGS[n].value}" for n in _SHARED if n != "strategy"]
    commands["engine_before"] = variants_lib.Command(
        pin + [sys.executable, "-m", "benchmarks.throughput",
               "--variant=engine", f"--model={FLAGS.model}", *old],
        dict(user_env, PYTHONPATH=tree), tree)
  for name in FLAGS.baselines:
    python = sys.executable
    if name == "orbit":
      if not os.path.exists(FLAGS.orbit_python):
        print(f"orbit: skipped, {FLAGS.orbit_python} not found; run "
              "`bash benchmarks/setup_orbit.sh` first.")
        continue
      python = FLAGS.orbit_python
    commands[name] = variants_lib.Command(
        pin + [python, script, f"--variant={name}", *shared,
               *(profile if name == "orbit" else [])], user_env, ROOT)
  return commands


def parent():
  commands = _commands()
  results = variants_lib.run_rounds(commands, FLAGS.rounds)
  median = variants_lib.median_rates(results)
  where = (f"MirroredStrategy on {FLAGS.cpu_devices} logical CPUs"
           if FLAGS.strategy == "mirrored" else "OneDeviceStrategy")
  print(f"\n{FLAGS.model} {FLAGS.image_size}x{FLAGS.image_size}, {where}"
        f"{', cores ' + FLAGS.cpus if FLAGS.cpus else ''}, "
        f"{FLAGS.batch_size_per_replica} per replica, {FLAGS.steps} timed "
        f"steps, median of {FLAGS.rounds} rounds")
  print("| variant | oneDNN | examples/s (each round) | median | "
        "engine / variant | CPU s per run (median) | variant / engine |")
  print("|---|---|---|---|---|---|---|")
  cpu = {v: statistics.median(r["cpu_seconds"] for r in rs)
         for v, rs in results.items()}
  for v, rs in results.items():
    rates = ", ".join(f"{r['rate']:.1f}" for r in rs)
    onednn = "on" if rs[0].get("onednn") else "off"
    print(f"| {v} | {onednn} | {rates} | {median[v]:.1f} | "
          f"{median['engine'] / median[v]:.3f} | {cpu[v]:.1f} | "
          f"{cpu[v] / cpu['engine']:.3f} |")
  targets = {"orbit": 1.10, "fit": 1.30}
  print("; ".join(f"engine/{v} = {median['engine'] / median[v]:.3f} (target "
                  f">= {t:.2f})" for v, t in targets.items() if v in median))
  if FLAGS.profile_dir:
    from benchmarks import xplane_summary  # pylint: disable=g-import-not-at-top
    for v in ("engine", "orbit"):
      path = os.path.join(FLAGS.profile_dir, v)
      if os.path.isdir(path):
        print(f"\n== profile: {v}, {FLAGS.steps_per_loop} steps\n"
              + xplane_summary.summarise(path))


def main(argv):
  del argv
  if FLAGS.variant:
    # As the command line does, before TensorFlow is imported
    # (engine/onednn.py).
    from engine import onednn  # pylint: disable=g-import-not-at-top
    from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
    fields = _fields()
    config = ic.configs(**fields)[0]
    onednn.turn_off_for(config)
    from engine.host import cpus, memory  # pylint: disable=g-import-not-at-top
    memory.use_cpu_allocator(config.host.cpu_allocator)  # as configure_host
    cpus.split_cpu(FLAGS.cpu_devices if FLAGS.strategy == "mirrored" else 0)
    rate = run_engine(fields)
    from engine.core import summary  # pylint: disable=g-import-not-at-top
    onednn = summary.onednn_state()["onednn"]
    print("RESULT " + json.dumps({"variant": "engine", "rate": rate,
                                  "onednn": onednn}))
  else:
    parent()


if __name__ == "__main__":
  app.run(main)
