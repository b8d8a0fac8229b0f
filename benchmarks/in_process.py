"""The in-process runners that benchmarks.seed_table and benchmarks.tensorboard_cost
time: the engine (`engine.run` with a timing hook) and Keras `fit`, on the
image task's data, with the flags they share.

`run_fit` is a baseline: its callers run it in a process of its own that
never ran the engine, and it applies none of the engine's process settings
(the malloc tuning is process-wide and would stay once the engine set it),
so `fit` runs with TensorFlow's and Keras's defaults, as its users run it.
It reads the image task's batches (the same examples the engine trains on).
`python -m benchmarks.throughput` measures the engine against its baselines
(benchmarks/baselines.py) the same way, each in a fresh process.
"""
import time

from absl import flags

from benchmarks import engine_timer

flags.DEFINE_integer("steps", 30, "Timed steps per variant.")
flags.DEFINE_integer("warmup", 5, "Untimed steps first.")
flags.DEFINE_integer("image_size", 64, "Image side.")
flags.DEFINE_integer("batch_size_per_replica", 64, "Per-replica batch.")
flags.DEFINE_integer("cpu_devices", 2, "Logical CPU devices (replicas).")
flags.DEFINE_string("model", "mobilenet_v2", "Model.")
flags.DEFINE_integer("steps_per_loop", 10, "Engine steps per host call.")
FLAGS = flags.FLAGS


def fields(model_dir: str):
  """The built-in job's flag values for this benchmark; the run writes
  into `model_dir` (the caller's, to remove)."""
  return dict(
      model=FLAGS.model, image_size=FLAGS.image_size, strategy="mirrored",
      cpu_devices=FLAGS.cpu_devices, optimizer="adam",
      batch_size_per_replica=FLAGS.batch_size_per_replica,
      train_steps=FLAGS.warmup + FLAGS.steps,
      steps_per_loop=FLAGS.steps_per_loop, log_every=1000,
      synthetic_examples=4096,
      model_dir=model_dir)


def _common(fields):
  """Strategy, model, data for `fit`, built as the engine builds them."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.core import inputs  # pylint: disable=g-import-not-at-top
  from engine.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  config, image = ic.configs(**fields)
  strategy = strategy_lib.make_strategy(config.distribution)
  global_batch = (config.data.batch_size_per_replica *
                  strategy.num_replicas_in_sync)
  task = ic.ImageClassification(image, seed=config.randomness.seed)
  keras.utils.set_random_seed(config.randomness.seed)
  dataset = inputs.TrainData(task, tf.distribute.InputContext(), config.data,
                             global_batch, config.randomness.seed).batches()
  with strategy.scope():
    model = task.build_model()
    optimizer = keras.optimizers.Adam(config.optimization.learning_rate)
  return strategy, model, optimizer, dataset, global_batch


def run_engine(fields):
  """Timed like the baselines: all steps after the warm-up, end to end."""
  return engine_timer.engine_rate(fields, FLAGS.warmup, FLAGS.steps)


def run_fit(fields):
  """Keras `fit` under the same strategy and data; examples/s after the
  warm-up. Call it in a process that has not run the engine."""
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


