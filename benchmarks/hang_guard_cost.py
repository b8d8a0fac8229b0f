"""What hang detection costs: one guard thread vs TensorFlow's per-op timeout.

    python -m benchmarks.hang_guard_cost [--steps=3000 --rounds=2]

Two variants of the default job shape (small_cnn, 32x32 synthetic images,
MirroredStrategy on 2 logical CPUs, 32 per replica), each in its own process:

  hang_guard      the engine as it is: no collective has a timeout, one
                  thread bounds the host calls (engine/distribute/hang.py);
  per_op_timeout  the same run with `timeout_seconds=--collective_timeout`
                  put back on every collective, as the engine did before:
                  TensorFlow keeps one sleeping thread per op.

Prints each variant's steady examples/s and its thread count at the first and
the last host call, then the guard's own cost per host call (entering and
leaving a watch, timed in this process).
"""
import json
import sys
import time

from absl import app
from absl import flags

from benchmarks import engine_timer
from benchmarks.variants import best_results

flags.DEFINE_enum("variant", None, ["hang_guard", "per_op_timeout"],
                  "Internal: run one variant in this process.")
flags.DEFINE_integer("steps", 3000, "Training steps per variant.")
flags.DEFINE_integer("rounds", 2, "Rounds, alternating the order.")
FLAGS = flags.FLAGS


def child():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import engine  # pylint: disable=g-import-not-at-top
  from engine.core import step  # pylint: disable=g-import-not-at-top
  from engine.distribute import devices  # pylint: disable=g-import-not-at-top
  from engine.host import cpus  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  cpus.split_cpu(2)
  if FLAGS.variant == "per_op_timeout":
    plain = devices.communication_options

    def with_timeout(config):
      return plain(config).merge(tf.distribute.experimental
                                 .CommunicationOptions(
                                     timeout_seconds=config.collective_timeout))
    # The step and the stop exchange (engine.core.step) and the strategies
    # (engine.distribute.devices) read it at call time.
    devices.communication_options = with_timeout
    step.communication_options = with_timeout
  config, image = ic.configs(
      model="small_cnn", image_size=32, strategy="mirrored", cpu_devices=2,
      batch_size_per_replica=32, train_steps=FLAGS.steps, log_every=1000,
      export=False, model_dir=engine_timer.scratch_dir("tfengine_wdcost_"))
  summary = engine.run(ic.ImageClassification(image, seed=config.randomness.seed),
                       config).summary
  print("RESULT " + json.dumps({
      "variant": FLAGS.variant, "rate": summary["examples_per_sec"],
      "threads": summary["host_threads"]}))


def _watch_seconds(calls: int = 100_000) -> float:
  from engine.distribute import hang  # pylint: disable=g-import-not-at-top
  dog = hang.HangGuard(60.0, 180.0, abort=lambda reason: None)
  try:
    start = time.perf_counter()
    for _ in range(calls):
      with dog.watch("train", 10):
        pass
    return (time.perf_counter() - start) / calls
  finally:
    dog.close()


def parent():
  variants = ["hang_guard", "per_op_timeout"]
  passthrough = [a for a in sys.argv[1:] if not a.startswith("--rounds")]
  best = best_results("benchmarks.hang_guard_cost", variants, FLAGS.rounds,
                      passthrough)
  print(f"\nsmall_cnn 32x32, MirroredStrategy on 2 logical CPUs, 32 per "
        f"replica, {FLAGS.steps} steps, best of {FLAGS.rounds}")
  print("| variant | examples/s | threads at first / last host call |")
  print("|---|---|---|")
  for v in variants:
    t = best[v]["threads"]
    print(f"| {v} | {best[v]['rate']:.1f} | {t['first_call']} / "
          f"{t['last_call']} |")
  print(f"hang_guard / per_op_timeout = "
        f"{best['hang_guard']['rate'] / best['per_op_timeout']['rate']:.3f}")
  print(f"one watch (enter + leave, per host call): "
        f"{_watch_seconds() * 1e6:.1f} us")


def main(argv):
  del argv
  if FLAGS.variant:
    child()
  else:
    parent()


if __name__ == "__main__":
  app.run(main)
