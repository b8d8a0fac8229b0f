"""Input at scale (issue 19): start-up time and decode throughput.

    python -m benchmarks.input_scale --startup --images=100000 \
        [--old_root=/path/to/old/checkout]
    python -m benchmarks.input_scale --pipeline [--images=512 --rounds=3]
    python -m benchmarks.input_scale --counters

`--startup` writes a folder of `--images` small JPEGs (one 8x8 JPEG copied:
only the listing matters) and times `python -m engine.main` with
`--train_steps=1` to its exit (TensorFlow's import, the listing, the model,
one step, the checkpoint): the first run, then a restart that resumes from
the listing cached in model_dir. `--old_root` times another checkout (the
code before issue 19, which decodes every image at start-up) on the same
folder.

`--pipeline` writes `--images` 224x224 JPEGs and times, side by side in one
process and alternating rounds, decoding and resizing them to
`--image_size` with no model: the plain tf.data pipeline a user would write
(`list_files`, `map(decode)` AUTOTUNE, `batch`, `prefetch`) and the engine's
(the image task's examples through engine/core/inputs.py, one worker).
`--counters` prints the images each worker decodes per step with 1, 2 and
4 workers for each source (synthetic, folder, tfds), counted by
data/decode.py's counter in each worker's own pipeline function.

`--pipeline` prints images/s of each, in wall time and per CPU-second of the process
(threads summed: the rate per core, which other jobs on a shared machine
disturb far less than the wall-clock rate), and engine/plain per core
(target >= 0.9).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

flags.DEFINE_bool("startup", False, "Time start-up on a big folder.")
flags.DEFINE_bool("pipeline", False, "Time decoding: engine vs plain tf.data.")
flags.DEFINE_bool("counters", False, "Images decoded per worker per step.")
flags.DEFINE_integer("images", 512, "Images to generate.")
flags.DEFINE_string("old_root", None, "Another checkout to time (--startup).")
flags.DEFINE_integer("rounds", 3, "Rounds of each pipeline (best kept).")
flags.DEFINE_integer("epochs", 2, "Epochs per pipeline round.")
flags.DEFINE_integer("image_size", 224, "Side images are resized to.")
flags.DEFINE_integer("batch", 64, "Batch size.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_folder(root: str, images: int) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  payload = tf.io.encode_jpeg(np.full((8, 8, 3), 128, np.uint8)).numpy()
  for i in range(images):
    directory = os.path.join(root, f"class_{i % 10}")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{i:07d}.jpg"), "wb") as f:
      f.write(payload)


def _engine_seconds(code_root: str, folder: str, model_dir: str,
                    steps: int) -> float:
  start = time.perf_counter()
  out = subprocess.run(
      [sys.executable, "-m", "engine.main", f"--dataset=folder:{folder}",
       "--model=small_cnn", "--image_size=32", "--batch_size_per_replica=64",
       f"--train_steps={steps}", "--noexport", "--noprogress",
       f"--model_dir={model_dir}"], cwd=code_root, capture_output=True,
      text=True, check=False,
      env=dict(os.environ, PYTHONPATH=code_root, TF_CPP_MIN_LOG_LEVEL="2"))
  seconds = time.perf_counter() - start
  if out.returncode:
    raise RuntimeError(out.stderr[-2000:])
  return seconds


def startup():
  work = tempfile.mkdtemp(prefix="tfengine_startup_")
  try:
    folder = os.path.join(work, "images")
    start = time.perf_counter()
    _tiny_folder(folder, FLAGS.images)
    print(f"wrote {FLAGS.images} JPEGs in {time.perf_counter() - start:.1f} s")
    rows = [("this checkout, first run", _engine_seconds(
        ROOT, folder, os.path.join(work, "m"), 1)),
            ("this checkout, restart (cached listing)", _engine_seconds(
                ROOT, folder, os.path.join(work, "m"), 2))]
    if FLAGS.old_root:
      rows.append((f"{FLAGS.old_root}, first run", _engine_seconds(
          FLAGS.old_root, folder, os.path.join(work, "old"), 1)))
  finally:
    shutil.rmtree(work, ignore_errors=True)
  print(f"\n{FLAGS.images} images: seconds from launch to exit after 1 step")
  print("| code | seconds |\n|---|---|")
  for name, seconds in rows:
    print(f"| {name} | {seconds:.1f} |")


def _rates(dataset, images: int):
  """(images per wall second, images per CPU second of this process)."""
  start, cpu = time.perf_counter(), time.process_time()
  seen = 0
  for _, labels in dataset:
    seen += int(labels.shape[0])
  assert seen == images * FLAGS.epochs, seen
  return (seen / (time.perf_counter() - start),
          seen / (time.process_time() - cpu))


def pipeline():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.data import to_tfds  # pylint: disable=g-import-not-at-top
  from engine.config import Config  # pylint: disable=g-import-not-at-top
  from engine.core import inputs  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  work = tempfile.mkdtemp(prefix="tfengine_decode_")
  try:
    folder = os.path.join(work, "images")
    to_tfds.write_sample_folder(folder, [f"c{k}" for k in range(4)],
                               FLAGS.images // 4, formats=("jpg",),
                               size=(224, 224))
    images = FLAGS.images // 4 * 4
    size, batch = FLAGS.image_size, FLAGS.batch
    classes = sorted(os.listdir(folder))

    def plain():
      def load(path):
        label = tf.argmax(tf.cast(tf.equal(
            tf.strings.split(path, os.sep)[-2], classes), tf.int32))
        image = tf.io.decode_image(tf.io.read_file(path), channels=3,
                                   expand_animations=False)
        return tf.image.resize(image, [size, size]) / 255.0, label
      ds = tf.data.Dataset.list_files(os.path.join(folder, "*", "*.jpg"),
                                      seed=1).repeat(FLAGS.epochs)
      return ds.map(load, num_parallel_calls=tf.data.AUTOTUNE).batch(
          batch).prefetch(tf.data.AUTOTUNE)

    def engine():
      config = Config.create(batch_size_per_replica=batch,
                             drop_remainder=False)
      task = ic.ImageClassification(ic.ImageClassificationConfig(
          model="small_cnn", dataset=f"folder:{folder}", image_size=size))
      data = inputs.TrainData(task, tf.distribute.InputContext(),
                              config.data, batch, 1)
      return data.batches().take(data.steps_per_epoch * FLAGS.epochs)

    best = {"plain": (0.0, 0.0), "engine": (0.0, 0.0)}
    for r in range(FLAGS.rounds):
      order = ("plain", "engine") if r % 2 == 0 else ("engine", "plain")
      for name in order:
        ds = plain() if name == "plain" else engine()
        got = _rates(ds, images)
        best[name] = tuple(max(a, b) for a, b in zip(best[name], got))
  finally:
    shutil.rmtree(work, ignore_errors=True)
  print(f"\n{images} 224x224 JPEGs -> {size}x{size}, batch {batch}, "
        f"{FLAGS.epochs} epochs, best of {FLAGS.rounds}, {os.cpu_count()} "
        "cores")
  print("| pipeline | images/s (wall) | images per CPU-second (per core) |")
  print("|---|---|---|")
  for name, (wall, per_core) in best.items():
    print(f"| {name} | {wall:.1f} | {per_core:.1f} |")
  print(f"engine/plain per core = {best['engine'][1] / best['plain'][1]:.3f} "
        f"(target >= 0.9); wall = {best['engine'][0] / best['plain'][0]:.3f}")


def _first_steps(steps: int):
  """A TrainData class whose global batches end after `steps`, so that a
  pipeline is read to its end and no read-ahead goes uncounted."""
  from engine.core import inputs  # pylint: disable=g-import-not-at-top

  class FirstSteps(inputs.TrainData):
    def global_items(self, start_step=0):
      return super().global_items(start_step).take(steps)
  return FirstSteps


def counters(steps: int = 4, global_batch: int = 64):
  """Images decoded per worker per step, each worker's own pipeline
  (TrainData.worker_batches with its InputContext) read alone."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.data import decode, to_tfds  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  from engine.config import Config  # pylint: disable=g-import-not-at-top
  work = tempfile.mkdtemp(prefix="tfengine_counters_")
  folder = to_tfds.write_sample_folder(os.path.join(work, "f"), ["a", "b"],
                                      160, formats=("jpg",), size=(16, 16))
  to_tfds.write(f"folder:{folder}", "counted", os.path.join(work, "tfds"),
               num_shards=4)
  sources = {"synthetic": {}, "folder": dict(dataset=f"folder:{folder}"),
             "tfds": dict(dataset="counted",
                          data_dir=os.path.join(work, "tfds"))}
  decode.counter.enabled = True
  print(f"\nimages decoded per worker per step (global batch {global_batch})")
  print("| source | 1 worker | 2 workers | 4 workers |\n|---|---|---|---|")
  try:
    for name, kw in sources.items():
      image = ic.ImageClassificationConfig(model="small_cnn", image_size=32,
                                           **kw)
      data_config = Config.create(batch_size_per_replica=global_batch).data
      cells = []
      for workers in (1, 2, 4):
        per_worker = []
        for w in range(workers):
          context = tf.distribute.InputContext(workers, w, workers)
          data = _first_steps(steps)(ic.ImageClassification(image), context,
                                    data_config, global_batch, 1)
          decode.counter.reset()
          try:
            for _ in data.worker_batches(context):
              pass
          except tf.errors.OpError:  # the end of a pipeline asserted endless
            pass
          per_worker.append(sum(decode.counter.counts.values()) / steps)
        cells.append(" / ".join(f"{c:g}" for c in per_worker))
      print(f"| {name} | " + " | ".join(cells) + " |")
  finally:
    decode.counter.enabled = False
    shutil.rmtree(work, ignore_errors=True)


def main(argv):
  del argv
  if FLAGS.counters:
    counters()
  if FLAGS.startup:
    startup()
  if FLAGS.pipeline:
    pipeline()


if __name__ == "__main__":
  app.run(main)
