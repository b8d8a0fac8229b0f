"""The baselines of benchmarks/throughput.py, as their users run them.

    python benchmarks/baselines.py --variant=fit|minimal [flags]
    benchmarks/.orbit_venv/bin/python benchmarks/baselines.py --variant=orbit

Plain TensorFlow and Keras only: run as a script (not `-m benchmarks...`),
so neither the engine nor its process settings (the malloc tuning) are
loaded; each baseline gets TensorFlow's own defaults.
Same model, batch, optimizer and strategy as the engine's variant:
MobileNetV2 (random init, logits), Adam 1e-3, synthetic images in memory.
Prints one line `RESULT {"variant": ..., "rate": examples/s}`.
"""
import json
import time

from absl import app
from absl import flags

flags.DEFINE_enum("variant", None, ["fit", "minimal", "orbit"], "Baseline.")
flags.DEFINE_enum("strategy", "mirrored", ["mirrored", "one_device"],
                  "tf.distribute strategy.")
flags.DEFINE_integer("cpu_devices", 2, "Logical CPU devices (mirrored).")
flags.DEFINE_integer("steps", 30, "Timed steps.")
flags.DEFINE_integer("warmup", 10, "Untimed steps first.")
flags.DEFINE_integer("image_size", 64, "Image side.")
flags.DEFINE_integer("batch_size_per_replica", 16, "Per-replica batch.")
flags.DEFINE_integer("steps_per_loop", 10, "Orbit steps per host call.")
flags.DEFINE_string("profile_dir", "",
                    "Trace steps_per_loop steps after the timed ones here.")
FLAGS = flags.FLAGS
NUM_CLASSES = 10


def _setup():
  """Strategy, global batch and an in-memory synthetic data set."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.strategy == "mirrored":
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.cpu_devices)
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(FLAGS.cpu_devices)])
  else:
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  global_batch = FLAGS.batch_size_per_replica * strategy.num_replicas_in_sync
  tf.random.set_seed(0)
  n = 16 * global_batch
  images = tf.random.uniform((n, FLAGS.image_size, FLAGS.image_size, 3))
  labels = tf.random.uniform((n,), 0, NUM_CLASSES, tf.int32)
  dataset = (tf.data.Dataset.from_tensor_slices((images, labels)).repeat()
             .batch(global_batch, drop_remainder=True)
             .prefetch(tf.data.AUTOTUNE))
  return strategy, global_batch, dataset


def _mobilenet(keras_module):
  return keras_module.applications.MobileNetV2(
      input_shape=(FLAGS.image_size, FLAGS.image_size, 3), weights=None,
      classes=NUM_CLASSES, classifier_activation=None)


def run_fit():
  """Keras 3 `compile` + `fit`, the way its guide distributes it."""
  import keras  # pylint: disable=g-import-not-at-top
  strategy, global_batch, dataset = _setup()
  with strategy.scope():
    model = _mobilenet(keras)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), metrics=["accuracy"])
  marks = {}

  class Timer(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if batch + 1 == FLAGS.warmup:
        marks["start"] = time.perf_counter()

  model.fit(dataset, epochs=1, steps_per_epoch=FLAGS.warmup + FLAGS.steps,
            callbacks=[Timer()], verbose=0)
  return FLAGS.steps * global_batch / (time.perf_counter() - marks["start"])


def run_minimal():
  """The textbook custom loop: one tf.function call per step."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  strategy, global_batch, dataset = _setup()
  with strategy.scope():
    model = _mobilenet(keras)
    optimizer = keras.optimizers.Adam(1e-3)
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
  rate = FLAGS.steps * global_batch / (time.perf_counter() - start)
  if FLAGS.profile_dir:
    tf.profiler.experimental.start(FLAGS.profile_dir)
    for _ in range(FLAGS.steps_per_loop):
      loss = train_step(iterator)
    loss.numpy()
    tf.profiler.experimental.stop()
  return rate


def run_orbit():
  """Model Garden's loop: Orbit's Controller + StandardTrainer on tf_keras."""
  import orbit  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_keras  # pylint: disable=g-import-not-at-top
  strategy, global_batch, dataset = _setup()

  class Trainer(orbit.StandardTrainer):
    """What official/core's trainer does for a classification task."""

    def __init__(self):
      self.model = _mobilenet(tf_keras)
      self.optimizer = tf_keras.optimizers.Adam(1e-3)
      self.train_loss = tf_keras.metrics.Mean("loss")
      super().__init__(
          strategy.experimental_distribute_dataset(dataset),
          options=orbit.StandardTrainerOptions(use_tf_while_loop=True))

    def train_loop_begin(self):
      self.train_loss.reset_states()

    def train_step(self, iterator):
      def step_fn(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
          logits = self.model(images, training=True)
          loss = tf.nn.compute_average_loss(
              tf_keras.losses.sparse_categorical_crossentropy(
                  labels, logits, from_logits=True),
              global_batch_size=global_batch)
        variables = self.model.trainable_variables
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        self.train_loss.update_state(loss)
      strategy.run(step_fn, args=(next(iterator),))

    def train_loop_end(self):
      return {"loss": self.train_loss.result()}

  with strategy.scope():
    trainer = Trainer()
    controller = orbit.Controller(
        strategy=strategy, trainer=trainer,
        global_step=trainer.optimizer.iterations,
        steps_per_loop=FLAGS.steps_per_loop)
  controller.train(steps=FLAGS.warmup)
  start = time.perf_counter()
  controller.train(steps=FLAGS.warmup + FLAGS.steps)  # ends on a host sync
  rate = FLAGS.steps * global_batch / (time.perf_counter() - start)
  if FLAGS.profile_dir:
    tf.profiler.experimental.start(FLAGS.profile_dir)
    controller.train(steps=FLAGS.warmup + FLAGS.steps + FLAGS.steps_per_loop)
    tf.profiler.experimental.stop()
  return rate


def main(argv):
  del argv
  run = {"fit": run_fit, "minimal": run_minimal, "orbit": run_orbit}
  rate = run[FLAGS.variant]()
  # Whether TF's oneDNN rewrites ran: TensorFlow's own default here.
  from tensorflow.python.util import _pywrap_util_port as port  # pylint: disable=g-import-not-at-top
  print("RESULT " + json.dumps({"variant": FLAGS.variant, "rate": rate,
                                "onednn": bool(port.IsMklEnabled())}))


if __name__ == "__main__":
  flags.mark_flag_as_required("variant")
  app.run(main)
