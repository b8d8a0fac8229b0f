"""A task as Keras `compile` users write it (issue 28): two outputs with a
loss each and weights, Keras metric objects next to metric functions.

  click  a binary logit [batch]: BinaryCrossentropy(from_logits), AUC,
         Precision and Recall objects;
  value  a regression [batch]: Huber (weight 0.5), the MAE function and a
         MeanSquaredError object;
  every output also counts its examples with `ExampleCount`, a user's own
  metric object (given once: it applies to each output).

35 training examples (global batches of 8 end with 3: on 4 replicas two
get none), 21 for evaluation. tests/test_metric_objects.py runs it in
process and on 2 workers through the launcher:

    python -m engine.launch --num_workers=2 --module=outputs_job -- \\
        --train_steps=10 --model_dir=/tmp/outputs
"""
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import engine

TRAIN, EVAL = 35, 21


class ExampleCount(keras.metrics.Metric):
  """How many examples were seen: a state that is a sum, read as it is."""

  def __init__(self, name="count", dtype=None):
    super().__init__(name=name, dtype=dtype)
    self.total = self.add_variable((), "zeros", name="total")

  def update_state(self, y_true, y_pred, sample_weight=None):
    del y_pred, sample_weight
    self.total.assign_add(tf.cast(tf.shape(y_true)[0], self.total.dtype))

  def result(self):
    return self.total


class Largest(keras.metrics.Metric):
  """The largest output: a state that is not a sum across replicas."""

  def __init__(self, name="largest", dtype=None):
    super().__init__(name=name, dtype=dtype)
    self.top = self.add_variable((), "zeros", aggregation="none", name="top")

  def update_state(self, y_true, y_pred, sample_weight=None):
    del y_true, sample_weight
    self.top.assign(tf.maximum(self.top, tf.reduce_max(y_pred)))

  def result(self):
    return self.top


def examples(split: str):
  """({"x": [n, 6]}, {"click": [n], "value": [n]}) as numpy arrays."""
  rng = np.random.default_rng(0 if split == "train" else 1)
  n = TRAIN if split == "train" else EVAL
  x = rng.normal(size=(n, 6)).astype(np.float32)
  score = x[:, 0] - 0.5 * x[:, 1] + 0.3 * rng.normal(size=n)
  labels = {"click": (score > 0).astype(np.float32),
            "value": (x[:, 2] + 0.5 * x[:, 3] ** 2).astype(np.float32)}
  return {"x": x}, labels


def build_model() -> keras.Model:
  inputs = {"x": keras.Input((6,), name="x")}
  h = keras.layers.Dense(16, activation="relu")(inputs["x"])
  click = keras.layers.Reshape((), name="click")(keras.layers.Dense(1)(h))
  value = keras.layers.Reshape((), name="value")(keras.layers.Dense(1)(h))
  return keras.Model(inputs, {"click": click, "value": value})


def make_task(mistake: str = "") -> engine.Task:
  """The task; `mistake` makes one of the errors the engine refuses."""
  def inputs(split, context):
    del context
    return tf.data.Dataset.from_tensor_slices(examples(split))

  loss = {"click": keras.losses.BinaryCrossentropy(from_logits=True,
                                                   reduction=None),
          "value": keras.losses.Huber(reduction=None)}
  metrics = {
      "click": [keras.metrics.AUC(from_logits=True),
                keras.metrics.Precision(thresholds=0.0),
                keras.metrics.Recall(thresholds=0.0)],
      "value": {"mae": keras.metrics.mean_absolute_error,
                "mse": keras.metrics.MeanSquaredError()},
      "count": ExampleCount(),
  }
  if mistake == "unknown_output":
    loss["price"] = keras.losses.Huber(reduction=None)
  elif mistake in ("missing_label", "extra_label"):
    def inputs(split, context):  # pylint: disable=function-redefined
      del context
      features, labels = examples(split)
      if mistake == "missing_label":
        del labels["value"]
      else:
        labels["price"] = labels["value"]
      return tf.data.Dataset.from_tensor_slices((features, labels))
  elif mistake == "string_metric":
    metrics["click"].append("accuracy")
  elif mistake == "not_summable":
    metrics["value"]["top"] = Largest()
  return engine.Task(model=build_model, inputs=inputs, loss=loss,
                     loss_weights={"value": 0.5}, metrics=metrics,
                     name="outputs")


if __name__ == "__main__":
  flags.DEFINE_string("mistake", "", "Make one of the refused mistakes.")
  engine.cli.run(lambda config: make_task(flags.FLAGS.mistake))
