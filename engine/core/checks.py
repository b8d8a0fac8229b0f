"""Checks of a task's pieces against its contract (engine/task.py).

Each mistake is a one-line ConfigError naming the task and what is wrong,
raised before training: at the data set's construction (`check_examples`)
or when the step is first traced (`checked_loss`, `checked_metric`, called
by engine/core/step.py).
"""
import tensorflow as tf

from engine.errors import ConfigError
from engine.task import MetricFn, Task


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


def checked_loss(task: Task, labels, outputs) -> tf.Tensor:
  """The task's per-example loss as float32 [batch], checked at trace time.

  Raises:
    ConfigError: the loss failed on these labels and outputs, or did not
      return one value per example.
  """
  try:
    per_example = task.per_example_loss(labels, outputs)
  except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
    raise ConfigError(
        f"task {task.name}: the loss failed on the model's outputs "
        f"({_shapes(outputs)}) and the labels ({_shapes(labels)}): "
        f"{_first_line(e)}") from e
  per_example = tf.convert_to_tensor(per_example)
  if per_example.shape.rank != 1:
    raise ConfigError(
        f"task {task.name}: the loss returned shape "
        f"{per_example.shape.as_list()} for outputs {_shapes(outputs)}; it "
        "must return one value per example (shape [batch]), e.g. a Keras "
        "loss made with reduction=None.")
  return tf.cast(per_example, tf.float32)


def checked_metric(task: Task, name: str, fn: MetricFn, labels,
                   outputs) -> tf.Tensor:
  """A metric's per-example values as float32 [batch], checked likewise."""
  try:
    values = tf.convert_to_tensor(fn(labels, outputs))
  except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
    raise ConfigError(
        f"task {task.name}: metric {name!r} failed on the model's outputs "
        f"({_shapes(outputs)}) and the labels ({_shapes(labels)}): "
        f"{_first_line(e)}") from e
  if values.shape.rank != 1:
    raise ConfigError(
        f"task {task.name}: metric {name!r} returned shape "
        f"{values.shape.as_list()}; it must return one value per example "
        "(shape [batch]).")
  return tf.cast(values, tf.float32)


def _shapes(structure) -> str:
  shapes = [str(t.shape.as_list()) for t in tf.nest.flatten(structure)
            if hasattr(t, "shape")]
  return "shape " + ", ".join(shapes) if shapes else "no tensors"


def _first_line(error: Exception) -> str:
  text = str(error).strip().splitlines()
  return text[0][:300] if text else type(error).__name__
