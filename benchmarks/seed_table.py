"""The seed's timing tables, reproduced: seconds per epoch, engine and Keras `fit`.

    python -m benchmarks.seed_table --dataset=tf_flowers --devices=/gpu:0,/gpu:1
    python -m benchmarks.seed_table --dataset=cats_vs_dogs --cpu_devices=2 \\
        --model=small_cnn --image_size=32 --steps=20

The seed's grid (../shared/seed/distributed_training.md), for N devices:
one device with batch 64; N devices with global batch 64; N devices with
global batch 64 x N; then the same three for multi_worker through
`engine.launch` (1 worker; N workers with global batch 64; N workers with
64 each; one replica per worker). Every cell runs the engine and Keras `fit`
(benchmarks/in_process.py's runner, under the same strategy), each in
processes of its own, so that `fit` runs with its users' defaults and none
of the engine's process settings: the mirrored table's engine cells in one
child process and its `fit` cells in another, the multi_worker cells in
their own worker processes. Seconds per epoch = examples per epoch / the
steady-state rate (the first, tracing steps left out), measured over
`--epochs` epochs or `--warmup` + `--steps` steps.

When the named tfds data set cannot be loaded here (no network, not
prepared), the synthetic data set with its size and class count stands in
and the table title says so.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

from benchmarks import in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (examples in the train split, classes) of the seed's data sets, for the
# synthetic stand-in when the real one cannot be loaded.
KNOWN = {"tf_flowers": (3670, 5), "cats_vs_dogs": (23262, 2)}
SEED_BATCH = 64

flags.DEFINE_string("dataset", "tf_flowers", "tfds data set of the table.")
flags.DEFINE_string("data_dir", None, "TensorFlow Datasets directory.")
flags.DEFINE_boolean("download", True, "Let tfds download and prepare a "
                     "missing data set (--nodownload: the stand-in at once).")
flags.DEFINE_list("devices", [], "Devices of the N-device columns, e.g. "
                  "/gpu:0,/gpu:1 (or use --cpu_devices).")
flags.DEFINE_integer("epochs", 0, "Epochs per run; 0: --warmup + --steps.")
flags.DEFINE_boolean("multi_worker", True, "Also run the multi_worker table.")
flags.DEFINE_integer("timeout", 3600, "Seconds one run may take.")
# Internal: a Keras `fit` child (also under engine.launch, which sets the
# cluster flags).
flags.DEFINE_string("fit_result", None, "Internal: run fit, write JSON here.")
flags.DEFINE_string("cells", None, "Internal: run these mirrored cells.")
flags.DEFINE_enum("runner", "engine", ["engine", "fit"],
                  "Internal: what the --cells child runs.")
flags.DEFINE_string("strategy", "multi_worker",
                    "Internal: set by engine.launch.")
flags.DEFINE_integer("global_batch", SEED_BATCH, "Internal: the fit child's.")
flags.DEFINE_list("worker_hosts", [], "Internal: set by engine.launch.")
flags.DEFINE_integer("task_index", -1, "Internal: set by engine.launch.")
flags.DEFINE_integer("num_examples", 0, "Internal: synthetic stand-in size.")
flags.DEFINE_integer("num_classes", 10, "Internal: synthetic classes.")
FLAGS = flags.FLAGS
# The seed's job is MobileNetV2 at 224x224; in_process.py's flags default
# to a CPU-sized 64x64.
FLAGS.set_default("image_size", 224)


def data_source():
  """('tfds', name, n, classes) if loadable here, else the synthetic stand-in."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    builder = tfds.builder(FLAGS.dataset, data_dir=FLAGS.data_dir)
    if not builder.is_prepared():
      if not FLAGS.download:
        raise FileNotFoundError(
            f"not prepared in {builder.data_dir} and --nodownload was given")
      builder.download_and_prepare()
    info = builder.info
    return ("tfds", None, info.splits["train"].num_examples,
            info.features["label"].num_classes)
  except Exception as e:  # any failure to load means: use the stand-in
    if FLAGS.dataset not in KNOWN:
      sys.exit(f"error: --dataset={FLAGS.dataset}: cannot be loaded here "
               f"({type(e).__name__}) and has no synthetic stand-in; known: "
               f"{', '.join(KNOWN)}.")
    n, classes = KNOWN[FLAGS.dataset]
    return ("synthetic", f"{type(e).__name__}: {str(e).splitlines()[0][:80]}",
            n, classes)


def _data_fields(source, num_examples, num_classes):
  """Config fields that select the table's data."""
  if source == "synthetic":
    return dict(dataset="synthetic", synthetic_examples=num_examples,
                num_classes=num_classes)
  fields = dict(dataset=FLAGS.dataset)
  if FLAGS.data_dir:
    fields["data_dir"] = FLAGS.data_dir
  return fields


# Keras 3 `fit` under MultiWorkerMirroredStrategy with two or more workers
# fails on its first step (keras-team/keras#20585, open); the table says so.
KERAS_MWMS_BUG = "PerReplica'>) to a Tensor"
FIT_FAILS = "fails [1]"
FOOTNOTE = ("[1] Keras 3 `Model.fit` under MultiWorkerMirroredStrategy with 2+ "
            "workers fails on its first step: \"Attempt to convert a value "
            "(PerReplica...) with an unsupported type\" (keras-team/keras"
            "#20585).")


def _run(cmd, known_failure=None):
  """Runs one benchmark process; False if it hit `known_failure`."""
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        timeout=FLAGS.timeout, check=False)
  output = proc.stdout + proc.stderr
  if proc.returncode and known_failure and known_failure in output:
    return False
  if proc.returncode:
    sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{output[-3000:]}")
  return True


def _launcher(workers, module, flag_list):
  return [sys.executable, "-m", "engine.launch", f"--num_workers={workers}",
          f"--module={module}", "--", *flag_list]


def _engine_fields(strategy, n, global_batch, data_fields, fit_steps, tmp):
  """The engine's Config fields for one cell (also what fit reads from it)."""
  fields = dict(
      model=FLAGS.model, image_size=FLAGS.image_size, optimizer="adam",
      learning_rate=0.001, batch_size_per_replica=global_batch // n,
      steps_per_loop=FLAGS.steps_per_loop, export=False,
      log_every=FLAGS.warmup + fit_steps, model_dir=os.path.join(tmp, "m"),
      **data_fields)
  if FLAGS.epochs:
    fields["epochs"] = FLAGS.epochs
  else:
    fields["train_steps"] = FLAGS.warmup + FLAGS.steps
  if strategy != "multi_worker":  # multi_worker: one CPU or all GPUs each
    fields["strategy"] = strategy
    if FLAGS.devices:
      fields["devices"] = tuple(FLAGS.devices[:n])
    else:
      fields["cpu_devices"] = n
  return fields


def _as_flags(fields):
  out = []
  for k, v in fields.items():
    if isinstance(v, bool):
      out.append(f"--{k}" if v else f"--no{k}")
    elif isinstance(v, tuple):
      out.append(f"--{k}={','.join(v)}")
    else:
      out.append(f"--{k}={v}")
  return out


def run_mirrored(cells, tmp):
  """(engine, fit) examples/s per cell: two child processes.

  One process runs every cell's engine run (engine.run, the code
  engine.main runs), another every cell's `fit`: the logical devices are
  set up once per process, and `fit` never shares a process with the
  engine's settings (a process per run would spend more time starting than
  the reduced test spends training).
  """
  spec = os.path.join(tmp, "cells.json")
  with open(spec, "w") as f:
    json.dump(cells, f)
  cpus = max(c["fields"].get("cpu_devices", 0) for c in cells)
  rates = {}
  for runner in ("engine", "fit"):
    _run([sys.executable, "-m", "benchmarks.seed_table", f"--cells={spec}",
          f"--runner={runner}", f"--cpu_devices={cpus}",
          f"--warmup={FLAGS.warmup}"])
    with open(f"{spec}.{runner}") as f:
      rates[runner] = json.load(f)
  return list(zip(rates["engine"], rates["fit"]))


def cells_child():
  """Runs the --cells spec with --runner (engine or fit) in this process."""
  import engine  # pylint: disable=g-import-not-at-top
  from engine.host import cpus, memory  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  if FLAGS.runner != "fit":  # the engine's default; fit keeps TensorFlow's
    memory.use_cpu_allocator(engine.HostConfig().cpu_allocator)
  cpus.split_cpu(FLAGS.cpu_devices)
  with open(FLAGS.cells) as f:
    cells = json.load(f)
  results = []
  for cell in cells:
    fields = dict(cell["fields"])
    if "devices" in fields:
      fields["devices"] = tuple(fields["devices"])
    if FLAGS.runner == "fit":
      FLAGS.steps = cell["fit_steps"]  # run_fit times the steps after --warmup
      results.append(in_process.run_fit(fields))
    else:
      config, image = ic.configs(**fields)
      results.append(engine.run(
          ic.ImageClassification(image, seed=config.randomness.seed),
          config).summary["examples_per_sec"])
  with open(f"{FLAGS.cells}.{FLAGS.runner}", "w") as f:
    json.dump(results, f)


def run_multi_worker(n, fields, fit_steps, global_batch, tmp):
  """(engine, fit or None) examples/s for a cell run under engine.launch."""
  _run(_launcher(n, "engine.main", _as_flags(fields)))
  with open(os.path.join(fields["model_dir"], "summary.json")) as f:
    engine_rate = json.load(f)["examples_per_sec"]
  result = os.path.join(tmp, "fit.json")
  data = {k: fields[k] for k in ("model", "image_size")}
  data.update({"num_examples": fields.get("synthetic_examples", 0),
               "num_classes": fields.get("num_classes", 10)})
  if fields["dataset"] != "synthetic":
    data.update(dataset=fields["dataset"])
    if fields.get("data_dir"):
      data.update(data_dir=fields["data_dir"])
  fit_flags = [*_as_flags(data), f"--global_batch={global_batch}",
               f"--warmup={FLAGS.warmup}", f"--steps={fit_steps}",
               f"--fit_result={result}"]
  if not _run(_launcher(n, "benchmarks.seed_table", fit_flags),
              KERAS_MWMS_BUG if n > 1 else None):
    return engine_rate, None
  with open(result) as f:
    return engine_rate, json.load(f)["rate"]


def fit_child():
  """One worker of a Keras `fit` run under engine.launch (one replica each)."""
  from engine.distribute import cluster  # pylint: disable=g-import-not-at-top
  fields = dict(
      strategy="multi_worker", worker_hosts=tuple(FLAGS.worker_hosts),
      task_index=FLAGS.task_index, model=FLAGS.model,
      image_size=FLAGS.image_size,
      dataset=("synthetic" if FLAGS.num_examples else FLAGS.dataset),
      data_dir=FLAGS.data_dir, synthetic_examples=FLAGS.num_examples or 2048,
      num_classes=FLAGS.num_classes, optimizer="adam",
      batch_size_per_replica=FLAGS.global_batch // len(FLAGS.worker_hosts),
      train_steps=FLAGS.warmup + FLAGS.steps,
      # Beside the result, in the work folder the parent removes.
      model_dir=os.path.join(os.path.dirname(FLAGS.fit_result),
                             f"fit_{FLAGS.task_index}"))
  rate = in_process.run_fit(fields)  # times the steps after --warmup
  cluster.stop_watchdog()  # the last collective is done; peers may exit
  if FLAGS.task_index == 0:  # the chief reports
    with open(FLAGS.fit_result, "w") as f:
      json.dump({"rate": rate}, f)


def table():
  n = len(FLAGS.devices) or FLAGS.cpu_devices
  if n < 2:
    sys.exit("error: --devices or --cpu_devices: the table needs N >= 2 "
             "devices for its N-device columns.")
  if SEED_BATCH % n:
    sys.exit(f"error: N={n} devices: the global batch 64 must divide by N.")
  source, why, num_examples, num_classes = data_source()
  data_fields = _data_fields(source, num_examples, num_classes)
  cells = [(1, SEED_BATCH), (n, SEED_BATCH), (n, SEED_BATCH * n)]
  tables = [("mirrored", "one host")] + (
      [("multi_worker", "through engine.launch, one replica per worker")]
      if FLAGS.multi_worker else [])
  name = FLAGS.dataset if source == "tfds" else (
      f"{FLAGS.dataset} (synthetic stand-in)")
  length = (f"{FLAGS.epochs} epoch(s)" if FLAGS.epochs else
            f"{FLAGS.warmup} + {FLAGS.steps} timed steps")
  for strategy, where in tables:
    unit = "worker" if strategy == "multi_worker" else "device"
    tmp = tempfile.mkdtemp(prefix="tfengine_seed_table_")
    specs = []
    for k, (devices_used, global_batch) in enumerate(cells):
      cell_strategy = ("one_device" if strategy == "mirrored" and k == 0
                       else strategy)
      fit_steps = (FLAGS.epochs * -(-num_examples // global_batch) -
                   FLAGS.warmup if FLAGS.epochs else FLAGS.steps)
      specs.append(dict(fit_steps=fit_steps, fields=_engine_fields(
          cell_strategy, devices_used, global_batch, data_fields, fit_steps,
          os.path.join(tmp, str(k)))))
    if strategy == "multi_worker":
      results = [run_multi_worker(d, spec["fields"], spec["fit_steps"], b,
                                  os.path.join(tmp, str(k)))
                 for k, ((d, b), spec) in enumerate(zip(cells, specs))]
    else:
      results = run_mirrored(specs, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    for (devices_used, global_batch), rates in zip(cells, results):
      print(f"{strategy}: {devices_used} {unit}(s), global batch "
            f"{global_batch}: engine {rates[0]:.1f}, fit "
            f"{'fails' if rates[1] is None else f'{rates[1]:.1f}'} examples/s",
            file=sys.stderr, flush=True)
    title = (f"\n{strategy} ({where}): {name}, {num_examples} images, "
             f"{num_classes} classes, {FLAGS.model} at {FLAGS.image_size}x"
             f"{FLAGS.image_size}; seconds per epoch from {length}")
    if source == "synthetic":
      title += (f"; the synthetic data set of {FLAGS.dataset}'s size stands "
                f"in, since {FLAGS.dataset} cannot be loaded here ({why})")
    print(title)
    print(f"| data set | runner | 1 {unit} (batch {SEED_BATCH}) | {n} {unit}s "
          f"(global batch {SEED_BATCH}) | {n} {unit}s (global batch "
          f"{SEED_BATCH * n}) |")
    print("|---|---|---|---|---|")
    for r, runner in enumerate(("engine", "Keras fit")):
      cols = " | ".join(f"{num_examples / rates[r]:.1f} s" if rates[r]
                        else FIT_FAILS for rates in results)
      print(f"| {FLAGS.dataset} | {runner} | {cols} |")
    ratios = " | ".join(f"{rates[0] / rates[1]:.2f}x" if rates[1] else "-"
                        for rates in results)
    print(f"| {FLAGS.dataset} | engine speed / fit | {ratios} |")
    if any(rates[1] is None for rates in results):
      print(FOOTNOTE)
    sys.stdout.flush()


def main(argv):
  del argv
  if FLAGS.cells:
    cells_child()
  elif FLAGS.fit_result:
    fit_child()
  else:
    table()


if __name__ == "__main__":
  app.run(main)
