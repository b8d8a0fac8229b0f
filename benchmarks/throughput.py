"""Engine vs Keras `fit` vs a minimal hand-written loop, measured side by side.

    python -m benchmarks.throughput [--steps=30 --warmup=5 --rounds=2]

Each variant runs in its own process (logical devices are per process) on the
same machine, model, data and strategy: MirroredStrategy on 2 logical CPU
devices, MobileNetV2 at 64x64, 64 examples per replica, Adam. Rounds
alternate the order of the variants; the best steady-state rate of each is
kept. Prints a table and the two ratios the engine must reach (>= 1.10x fit,
>= 0.98x the minimal loop). All three run with the engine's glibc malloc
setting (engine/memory.py), so the ratios compare the loops alone.
"""
import json
import os
import sys
import tempfile
import time

from absl import app
from absl import flags

from benchmarks.variants import best_results

flags.DEFINE_enum("variant", None, ["engine", "fit", "minimal"],
                  "Internal: run one variant in this process.")
flags.DEFINE_integer("steps", 30, "Timed steps per variant.")
flags.DEFINE_integer("warmup", 5, "Untimed steps first.")
flags.DEFINE_integer("rounds", 2, "Rounds, alternating the order.")
flags.DEFINE_integer("image_size", 64, "Image side.")
flags.DEFINE_integer("batch_size_per_replica", 64, "Per-replica batch.")
flags.DEFINE_integer("cpu_devices", 2, "Logical CPU devices (replicas).")
flags.DEFINE_string("model", "mobilenet_v2", "Model.")
flags.DEFINE_integer("steps_per_loop", 10, "Engine steps per host call.")
flags.DEFINE_string("baseline_tree", "",
                    "Also run the engine from this checkout (e.g. a worktree "
                    "of the commit before a change) as variant engine_before, "
                    "side by side with this one.")
FLAGS = flags.FLAGS


def _fields():
  """The built-in job's flag values for this benchmark."""
  return dict(
      model=FLAGS.model, image_size=FLAGS.image_size, strategy="mirrored",
      cpu_devices=FLAGS.cpu_devices, optimizer="adam",
      batch_size_per_replica=FLAGS.batch_size_per_replica,
      train_steps=FLAGS.warmup + FLAGS.steps,
      steps_per_loop=FLAGS.steps_per_loop, log_every=1000,
      synthetic_examples=4096,
      model_dir=tempfile.mkdtemp(prefix="tfengine_bench_"))


def _common(fields):
  """Strategy, model, data: built the same way for the two baselines."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.core import inputs  # pylint: disable=g-import-not-at-top
  from engine.distribute import devices, memory  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  config, image = ic.configs(**fields)
  strategy = devices.make_strategy(config.distribution)
  # The engine's host-memory setting for the baselines too, so that the
  # ratios measure the loops and not the allocator (README, Host memory).
  memory.tune_malloc()
  global_batch = (config.data.batch_size_per_replica *
                  strategy.num_replicas_in_sync)
  task = ic.ImageClassification(image, seed=config.loop.seed)
  keras.utils.set_random_seed(config.loop.seed)
  dataset = inputs.TrainData(task, tf.distribute.InputContext(), config.data,
                             global_batch, config.loop.seed).batches()
  with strategy.scope():
    model = task.build_model()
    optimizer = keras.optimizers.Adam(config.optimization.learning_rate)
  return strategy, model, optimizer, dataset, global_batch


def run_engine(fields):
  """Timed like the baselines: all steps after the warm-up, end to end."""
  import engine  # pylint: disable=g-import-not-at-top
  from engine.core import hooks  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top

  class Timer(hooks.Hook):
    def __init__(self):
      self.start, self.stop, self.examples = None, None, 0.0

    def next_stop(self, step):
      return FLAGS.warmup if step < FLAGS.warmup else super().next_stop(step)

    def after_loop(self, step, rows, seconds):
      if self.start is not None:
        self.examples += float(rows["examples"].sum())
        self.stop = time.perf_counter()
      if step == FLAGS.warmup:
        self.start = time.perf_counter()

  timer = Timer()
  config, image = ic.configs(**fields)
  engine.run(ic.ImageClassification(image, seed=config.loop.seed), config,
             hooks=[timer])
  return timer.examples / (timer.stop - timer.start)


def run_fit(fields):
  import keras  # pylint: disable=g-import-not-at-top
  strategy, model, optimizer, dataset, global_batch = _common(fields)
  with strategy.scope():
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  marks = {}

  class Timer(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if batch + 1 == FLAGS.warmup:
        marks["start"] = time.perf_counter()

  model.fit(dataset, epochs=1, steps_per_epoch=FLAGS.warmup + FLAGS.steps,
            callbacks=[Timer()], verbose=0)
  return FLAGS.steps * global_batch / (time.perf_counter() - marks["start"])


def run_minimal(fields):
  """The textbook custom loop: one tf.function call per step, Keras reduces."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy, model, optimizer, dataset, global_batch = _common(fields)
  with strategy.scope():
    optimizer.build(model.trainable_variables)

  def replica_step(images, labels):
    with tf.GradientTape() as tape:
      logits = model(images, training=True)
      loss = tf.nn.compute_average_loss(
          tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits),
          global_batch_size=global_batch)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)  # sums across replicas
    return loss

  @tf.function
  def train_step(iterator):
    return strategy.reduce("SUM", strategy.run(replica_step,
                                               args=next(iterator)), axis=None)

  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  for _ in range(FLAGS.warmup):
    train_step(iterator).numpy()
  start = time.perf_counter()
  for _ in range(FLAGS.steps):
    loss = train_step(iterator)
  loss.numpy()
  return FLAGS.steps * global_batch / (time.perf_counter() - start)


def child():
  from engine.distribute import devices  # pylint: disable=g-import-not-at-top
  devices.configure_host(FLAGS.cpu_devices)
  run = {"engine": run_engine, "fit": run_fit, "minimal": run_minimal}
  rate = run[FLAGS.variant](_fields())
  print("RESULT " + json.dumps({"variant": FLAGS.variant, "rate": rate}))


def parent():
  variants = ["engine", "fit", "minimal"]
  trees = {}
  if FLAGS.baseline_tree:
    variants.append("engine_before")
    trees["engine_before"] = ("engine", os.path.abspath(FLAGS.baseline_tree))
  passthrough = [a for a in sys.argv[1:] if not a.startswith(
      ("--rounds", "--baseline_tree"))]
  best = {v: r["rate"] for v, r in best_results(
      "benchmarks.throughput", variants, FLAGS.rounds, passthrough,
      trees).items()}
  print(f"\n{FLAGS.model} {FLAGS.image_size}x{FLAGS.image_size}, "
        f"MirroredStrategy on {FLAGS.cpu_devices} logical CPUs, "
        f"{FLAGS.batch_size_per_replica} per replica, {FLAGS.steps} timed "
        f"steps, best of {FLAGS.rounds}")
  print("| variant | examples/s | engine / variant |")
  print("|---|---|---|")
  for v in variants:
    print(f"| {v} | {best[v]:.1f} | {best['engine'] / best[v]:.3f} |")
  print(f"engine/fit = {best['engine'] / best['fit']:.3f} (target >= 1.10); "
        f"engine/minimal = {best['engine'] / best['minimal']:.3f} "
        "(target >= 0.98)")
  if FLAGS.baseline_tree:
    print(f"engine/engine_before = "
          f"{best['engine'] / best['engine_before']:.3f} (target >= 0.98; "
          f"before: {FLAGS.baseline_tree})")


def main(argv):
  del argv
  if FLAGS.variant:
    child()
  else:
    parent()


if __name__ == "__main__":
  app.run(main)
