"""Engine throughput reading images from disk vs the same images in memory.

    python -m benchmarks.input_pipeline [--images=640 --steps=30 --rounds=2]

Writes `--images` generated JPEGs (`--source_size` pixels square, 5 classes)
to a temporary folder and exports them as a tfds data set (TFRecord files),
then trains the engine, each variant in its own process, on the same images:

  folder  `--dataset=folder:DIR`: read and decode every file every epoch
  tfds    `--dataset=NAME --data_dir=DIR`: TFRecords, decoded every epoch
  memory  `--dataset=folder:DIR --cache=memory`: decoded, resized images held
          in memory after the first epoch

Every variant warms up for one full epoch plus `--warmup` steps (so the
memory cache is complete) and then times the next `--steps` steps; rounds
alternate the order and the best rate of each variant is kept. Prints
folder/memory and tfds/memory (target >= 0.9 each). The files are read
through the OS page cache after the first epoch, as on any machine with
enough RAM for the data set.
"""
import json
import os
import shutil
import sys
import tempfile
import time

from absl import app
from absl import flags

from benchmarks import variants
from engine import hooks

flags.DEFINE_enum("variant", None, ["folder", "tfds", "memory"],
                  "Internal: run one variant in this process.")
flags.DEFINE_string("work_dir", None, "Internal: where the images are.")
flags.DEFINE_integer("images", 640, "Images to generate.")
flags.DEFINE_integer("source_size", 224, "Side of the generated JPEGs.")
flags.DEFINE_integer("steps", 30, "Timed steps per variant.")
flags.DEFINE_integer("warmup", 3, "Untimed steps after the first epoch.")
flags.DEFINE_integer("rounds", 2, "Rounds, alternating the order.")
flags.DEFINE_integer("image_size", 64, "Side the engine resizes to.")
flags.DEFINE_integer("batch_size_per_replica", 64, "Per-replica batch.")
flags.DEFINE_integer("cpu_devices", 2, "Logical CPU devices (replicas).")
flags.DEFINE_string("model", "mobilenet_v2", "Model.")
FLAGS = flags.FLAGS

VARIANTS = ("folder", "tfds", "memory")
_NAME = "bench_images"


class StepTimer(hooks.Hook):
  """Times the host calls after step `start`."""

  def __init__(self, start: int):
    self._start = start
    self.examples, self.seconds = 0.0, 0.0

  def next_stop(self, step):
    return self._start if step < self._start else float("inf")

  def after_loop(self, step, rows, seconds):
    if step - len(rows) >= self._start:
      self.examples += float(rows["examples"].sum())
      self.seconds += seconds


def child():
  from engine.host import cpus  # pylint: disable=g-import-not-at-top
  cpus.split_cpu(FLAGS.cpu_devices)
  import engine  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  images = os.path.join(FLAGS.work_dir, "images")
  source = {
      "folder": dict(dataset=f"folder:{images}"),
      "tfds": dict(dataset=_NAME, data_dir=os.path.join(FLAGS.work_dir,
                                                        "tfds")),
      "memory": dict(dataset=f"folder:{images}", cache="memory"),
  }[FLAGS.variant]
  global_batch = FLAGS.batch_size_per_replica * FLAGS.cpu_devices
  start = -(-FLAGS.images // global_batch) + FLAGS.warmup
  timer = StepTimer(start)
  config, image = ic.configs(
      model=FLAGS.model, image_size=FLAGS.image_size, strategy="mirrored",
      cpu_devices=FLAGS.cpu_devices,
      batch_size_per_replica=FLAGS.batch_size_per_replica,
      train_steps=start + FLAGS.steps, steps_per_loop=10, log_every=1000,
      model_dir=tempfile.mkdtemp(prefix="run_", dir=FLAGS.work_dir),
      **source)  # removed with the work folder by the parent
  engine.run(ic.ImageClassification(image, seed=config.randomness.seed), config,
             hooks=[timer])
  print("RESULT " + json.dumps({"variant": FLAGS.variant,
                                "rate": timer.examples / timer.seconds}))


def prepare(work_dir: str) -> None:
  from engine.data import to_tfds  # pylint: disable=g-import-not-at-top
  classes = [f"class_{k}" for k in range(5)]
  to_tfds.write_sample_folder(
      os.path.join(work_dir, "images"), classes, FLAGS.images // 5,
      formats=("jpg",), size=(FLAGS.source_size, FLAGS.source_size))
  to_tfds.write(f"folder:{os.path.join(work_dir, 'images')}", _NAME,
               os.path.join(work_dir, "tfds"), num_shards=4)


def parent():
  work_dir = tempfile.mkdtemp(prefix="tfengine_input_")
  try:
    start = time.perf_counter()
    prepare(work_dir)
    print(f"wrote {FLAGS.images} JPEGs of {FLAGS.source_size}px and their "
          f"tfds export in {time.perf_counter() - start:.1f} s", flush=True)
    child_flags = [a for a in sys.argv[1:] if not a.startswith("--rounds")]
    best = variants.best_rates("benchmarks.input_pipeline", VARIANTS,
                               FLAGS.rounds,
                               [f"--work_dir={work_dir}", *child_flags])
  finally:
    shutil.rmtree(work_dir, ignore_errors=True)
  print(f"\n{FLAGS.model} at {FLAGS.image_size}x{FLAGS.image_size} from "
        f"{FLAGS.source_size}px JPEGs, {FLAGS.cpu_devices} logical CPUs, "
        f"{FLAGS.batch_size_per_replica} per replica, {FLAGS.steps} timed "
        f"steps, best of {FLAGS.rounds}")
  print("| source | examples/s | source / memory |")
  print("|---|---|---|")
  for v in VARIANTS:
    print(f"| {v} | {best[v]:.1f} | {best[v] / best['memory']:.3f} |")
  print(f"folder/memory = {best['folder'] / best['memory']:.3f}, "
        f"tfds/memory = {best['tfds'] / best['memory']:.3f} (target >= 0.9)")


def main(argv):
  del argv
  if FLAGS.variant:
    child()
  else:
    parent()


if __name__ == "__main__":
  app.run(main)
