"""A user's task for the API tests, importable and runnable as a script.

A small dense model with a kernel and an activity regularizer, a custom
per-example loss (label-smoothed cross-entropy written by hand), dict
features, 37 examples (a partial last batch at global batch 16), and an
accuracy metric. `--mistake=...` turns it into one of the mistakes the engine
must catch before training.

    python tests/user_task.py --cpu_devices=2 --train_steps=6 --model_dir=...
"""
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import engine

EXAMPLES = 37
CLASSES = 3
FEATURES = 5


def examples(seed: int = 0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
  w = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32)
  y = np.argmax(x @ w, axis=1).astype(np.int32)
  return {"x": x[:, :3], "extra": x[:, 3:]}, y


def build_model():
  inputs = {"x": keras.Input((3,), name="x"),
            "extra": keras.Input((2,), name="extra")}
  h = keras.layers.Concatenate()([inputs["x"], inputs["extra"]])
  h = keras.layers.Dense(8, activation="tanh",
                         kernel_regularizer=keras.regularizers.L2(0.05),
                         activity_regularizer=keras.regularizers.L1(0.01))(h)
  return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def smoothed_cross_entropy(labels, logits, smoothing=0.1):
  target = tf.one_hot(labels, CLASSES) * (1 - smoothing) + smoothing / CLASSES
  return -tf.reduce_sum(target * tf.nn.log_softmax(logits), axis=-1)


def accuracy(labels, logits):
  return tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                          labels), tf.float32)


def make_task(mistake: str = "") -> engine.Task:
  features, labels = examples()
  loss = smoothed_cross_entropy
  metrics = [accuracy]

  def inputs(split, context):
    del context
    if split == "eval":
      return tf.data.Dataset.from_tensor_slices((features, labels)).take(20)
    ds = tf.data.Dataset.from_tensor_slices((features, labels))
    if mistake == "not_pairs":
      return ds.map(lambda f, l: f)
    return ds

  if mistake == "scalar_loss":
    loss = lambda l, o: tf.reduce_mean(smoothed_cross_entropy(l, o))
  if mistake == "shape":  # one-hot loss on integer labels of the wrong width
    loss = lambda l, o: keras.losses.categorical_crossentropy(
        tf.one_hot(l, CLASSES + 2), o, from_logits=True)
  if mistake == "duplicate_metric":
    metrics = [accuracy, ("accuracy", accuracy)]
  return engine.Task(model=build_model, inputs=inputs, loss=loss,
                     metrics=metrics, name="user_task")


if __name__ == "__main__":
  flags.DEFINE_string("mistake", "", "Test only: one of the mistakes.")
  engine.cli.run(lambda config: make_task(flags.FLAGS.mistake))
