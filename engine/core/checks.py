"""Checks of a task's pieces against its contract (engine/task.py).

Each mistake is a one-line ConfigError naming the task and what is wrong,
raised before training: at the data set's construction (`check_examples`)
or when the step is first traced (`checked`, called by
engine/core/objective.py).
"""
from typing import Callable

import tensorflow as tf

from engine.errors import ConfigError
from engine.task import Task


def check_examples(task: Task, split: str, dataset: tf.data.Dataset) -> None:
  """Refuses a data set whose elements are not (features, labels) pairs.

  Raises:
    ConfigError: naming the task, the split and what it yields.
  """
  if not isinstance(dataset, tf.data.Dataset):
    raise ConfigError(f"task {task.name}: build_inputs({split!r}) returned "
                      f"{type(dataset).__name__}, not a tf.data.Dataset.")
  spec = dataset.element_spec
  if not (isinstance(spec, tuple) and len(spec) == 2):
    raise ConfigError(
        f"task {task.name}: build_inputs({split!r}) yields "
        f"{_describe_spec(spec)}, not (features, labels) pairs; map each "
        "example to a (features, labels) tuple.")
  if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
    raise ConfigError(
        f"task {task.name}: build_inputs({split!r}) never ends (infinite "
        "cardinality); return one pass over the split: the engine repeats "
        "it epoch by epoch.")


def _describe_spec(spec) -> str:
  if isinstance(spec, tf.TensorSpec):
    return f"single tensors {spec.dtype.name}{spec.shape.as_list()}"
  if isinstance(spec, dict):
    return f"dicts with keys {sorted(spec)}"
  if isinstance(spec, tuple):
    return f"{len(spec)}-tuples"
  return type(spec).__name__


def common_rank(labels, outputs):
  """Labels and outputs as a Keras loss or metric function needs them to
  give one value per example, the way Keras `fit` pairs them.

  Keras's losses and metric functions average over the last axis, so
  `[batch]` labels and outputs would give one scalar for the batch. A
  `[batch]` tensor is given as `[batch, 1]` when its partner is `[batch]` or
  `[batch, 1]`; everything else (e.g. `[batch]` class ids against
  `[batch, classes]` logits, dicts) is passed as it is.
  """
  if not (tf.is_tensor(labels) and tf.is_tensor(outputs)):
    return labels, outputs

  def column(t):  # [batch] or [batch, 1]
    return t.shape.rank == 1 or (t.shape.rank == 2 and t.shape[-1] == 1)

  if column(labels) and column(outputs):
    labels, outputs = (t[:, None] if t.shape.rank == 1 else t
                       for t in (labels, outputs))
  return labels, outputs


def checked(task: Task, what: str, fn: Callable, labels,
            outputs) -> tf.Tensor:
  """`fn(labels, outputs)` as float32 [batch], checked at trace time; `what`
  names it in errors ("the loss", "metric 'mae'", "the loss of output 'x'").

  Raises:
    ConfigError: it failed on these labels and outputs, or did not return
      one value per example.
  """
  labels, outputs = common_rank(labels, outputs)
  try:
    values = fn(labels, outputs)
  except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
    raise ConfigError(
        f"task {task.name}: {what} failed on the model's outputs "
        f"({_shapes(outputs)}) and the labels ({_shapes(labels)}): "
        f"{first_line(e)}") from e
  return _per_example(task, what, values, labels, outputs)


def _per_example(task: Task, what: str, values, labels,
                 outputs) -> tf.Tensor:
  """`values` as float32 [batch]: [batch] or [batch, 1] (one column).

  Raises:
    ConfigError: any other shape, with the shapes that produced it and the
      likely cause.
  """
  values = tf.convert_to_tensor(values)
  if values.shape.rank == 2 and values.shape[-1] == 1:
    values = values[:, 0]
  if values.shape.rank != 1:
    cause = (
        "it averaged over the batch (a Keras loss object needs "
        "reduction=None; a function must keep the batch axis)"
        if values.shape.rank == 0 else
        "it gives several values per example (average them, e.g. "
        "tf.reduce_mean(..., axis=-1))")
    raise ConfigError(
        f"task {task.name}: {what} returned {_shapes(values)} for labels "
        f"{_shapes(labels)} and outputs {_shapes(outputs)}; it must return "
        f"one value per example (shape [batch]): {cause}.")
  return tf.cast(values, tf.float32)


def _shapes(structure) -> str:
  shapes = [str(t.shape.as_list()) for t in tf.nest.flatten(structure)
            if hasattr(t, "shape")]
  return "shape " + ", ".join(shapes) if shapes else "no tensors"


def first_line(error: Exception) -> str:
  text = str(error).strip().splitlines()
  return text[0][:300] if text else type(error).__name__
