"""Losses and metrics for classification over logits, per example.

The built-in image task uses them, and so can any task whose model returns
logits [batch, classes] and whose labels are class indices [batch]:

    engine.Task(model=..., inputs=...,
                loss=engine.classification.cross_entropy(label_smoothing=0.1),
                metrics=engine.classification.metrics(num_classes=10))
"""
from typing import Dict

import tensorflow as tf

from engine.task import MetricFn

TOP_K = 5


def cross_entropy(label_smoothing: float = 0.0) -> MetricFn:
  """Softmax cross-entropy of integer labels against logits, per example.

  With `label_smoothing` = e the target puts 1 - e on the label and spreads
  e evenly over all classes (Szegedy et al.; Keras's meaning of the word).
  """
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1).")

  def loss(labels, logits):
    labels = tf.cast(labels, tf.int32)
    if label_smoothing == 0.0:
      return tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits)
    classes = tf.shape(logits)[-1]
    target = tf.one_hot(labels, classes, dtype=logits.dtype)
    target = target * (1.0 - label_smoothing) + (
        label_smoothing / tf.cast(classes, logits.dtype))
    return tf.nn.softmax_cross_entropy_with_logits(labels=target,
                                                   logits=logits)
  loss.__name__ = "cross_entropy"
  return loss


def accuracy(labels, logits) -> tf.Tensor:
  """1.0 where the largest logit is the label's, else 0.0."""
  predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
  return tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.float32)


def top_k_accuracy(k: int) -> MetricFn:
  """1.0 where the label is among the k largest logits."""
  def top_k(labels, logits):
    return tf.cast(tf.math.in_top_k(tf.cast(labels, tf.int32),
                                    tf.cast(logits, tf.float32), k),
                   tf.float32)
  top_k.__name__ = f"top{k}_accuracy"
  return top_k


def metrics(num_classes: int) -> Dict[str, MetricFn]:
  """accuracy, and top-5 accuracy when there are more than 5 classes."""
  out = {"accuracy": accuracy}
  if num_classes > TOP_K:
    out[f"top{TOP_K}_accuracy"] = top_k_accuracy(TOP_K)
  return out


def serving_outputs(logits) -> Dict[str, tf.Tensor]:
  """`logits` and `probabilities`, what the exported model serves."""
  return {"logits": logits, "probabilities": tf.nn.softmax(logits)}
