"""What a step computes from the labels and the model's outputs.

The task's loss (one function, or one per output with weights, as Keras
`compile(loss={...}, loss_weights={...})` takes them), its per-example
metric functions and its Keras metric objects, resolved once against the
model's outputs and the labels, before training:

  * per-example terms (the loss, each output's own loss, metric functions)
    are summed over a replica's examples into the step's row
    (engine/core/step.py), all-reduced with the row and divided by the
    global count of examples;
  * Keras metric objects (`keras.metrics.AUC()`, `Precision`, ...) keep a
    state per replica (engine/core/metric_states.py): each replica updates
    its own, and the states are summed across replicas and workers.

With several outputs every column is named `OUTPUT/NAME` ("class/loss",
"value/mae"); "loss" is the weighted total the step minimises.
"""
import dataclasses
import re
from typing import Callable, List, Mapping, Optional, Tuple

import keras
import tensorflow as tf

from engine.core import checks
from engine.errors import ConfigError
from engine.task import RESERVED, Task


@dataclasses.dataclass(frozen=True)
class Term:
  """A per-example function of one output (key None: of the whole labels and
  outputs), reported as column `name`."""
  name: str
  key: object  # None, a dict key or a list index
  fn: Callable
  what: str    # for errors: "the loss", "metric 'mae'"
  weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class MetricObject:
  """A Keras metric object of one output; `template` is the task's own: the
  engine updates copies of it (engine/core/metric_states.py), so one object
  may serve several outputs."""
  name: str
  key: object
  template: keras.metrics.Metric


@dataclasses.dataclass(frozen=True)
class Objective:
  """The task's loss and metrics, resolved against its outputs.

  `losses`: the weighted terms of the loss (one with key None for a single
  loss). `columns`: the per-example sums reported after "loss": each
  output's own loss (several outputs only), then the metric functions.
  `objects`: the Keras metric objects.
  """
  task: Task
  losses: Tuple[Term, ...]
  functions: Tuple[Term, ...]
  objects: Tuple[MetricObject, ...]
  per_output: bool

  @property
  def columns(self) -> Tuple[str, ...]:
    own = tuple(t.name for t in self.losses) if self.per_output else ()
    return own + tuple(t.name for t in self.functions)

  @property
  def object_names(self) -> Tuple[str, ...]:
    return tuple(m.name for m in self.objects)

  def sums(self, labels, outputs) -> tf.Tensor:
    """float32 [1 + len(columns)]: the loss sum and each column's sum over
    the batch's examples (without `model.losses`)."""
    parts = [self._values(t, labels, outputs) for t in self.losses]
    total = tf.add_n([tf.reduce_sum(p) if t.weight == 1.0 else
                      t.weight * tf.reduce_sum(p)
                      for t, p in zip(self.losses, parts)])
    own = [tf.reduce_sum(p) for p in parts] if self.per_output else []
    metrics = [tf.reduce_sum(self._values(t, labels, outputs))
               for t in self.functions]
    return tf.stack([total] + own + metrics)

  def _values(self, term: Term, labels, outputs) -> tf.Tensor:
    """float32 [batch]: the term's per-example values, checked
    (engine/core/checks.py)."""
    return checks.checked(self.task, term.what, term.fn,
                          pick(labels, term.key), pick(outputs, term.key))


def pick(structure, key):
  """The part of `structure` a term or metric reads."""
  return structure if key is None else structure[key]


def build(task: Task, model: keras.Model, output_spec,
          label_spec) -> Objective:
  """The task's objective against the model's outputs and the labels.

  Raises:
    ConfigError: a loss for an output the model does not have, a missing or
      extra label, a metric that is not a function or a Keras metric
      object, a name used twice or reserved.
  """
  spec = task.build_loss()
  per_output = isinstance(spec, (Mapping, list, tuple))
  if not per_output:
    losses = (Term("loss", None, spec, "the loss"),)
    names = None
  else:
    names = _output_names(task, model, output_spec, spec)
    losses = _output_losses(task, spec, task.build_loss_weights(), names)
    _check_labels(task, names, label_spec, [t.key for t in losses])
  functions, objects = _metrics(task, task.build_metrics(), names,
                                [t.key for t in losses])
  seen = set(RESERVED)
  for name in ([t.name for t in losses] if per_output else []) + [
      t.name for t in functions] + [m.name for m in objects]:
    if name in seen:
      raise ConfigError(
          f"task {task.name}: metric name {name!r} is "
          + ("reserved by the engine (" + ", ".join(RESERVED) + "); rename it."
             if name in RESERVED else
             "used twice; give each metric its own name."))
    seen.add(name)
  return Objective(task, losses, functions, objects, per_output)


def _output_names(task: Task, model, output_spec, spec) -> dict:
  """{output name: key} of a model with several outputs."""
  if isinstance(output_spec, Mapping):
    return {str(k): k for k in output_spec}
  if isinstance(output_spec, (list, tuple)):
    given = list(getattr(model, "output_names", None) or [])
    if len(given) != len(output_spec):
      given = [f"output_{i}" for i in range(len(output_spec))]
    return {name: i for i, name in enumerate(given)}
  raise ConfigError(
      f"task {task.name}: loss= gives a loss per output "
      f"({_listing(spec)}), but the model has one output; pass one loss "
      "function, or return a dict of outputs from the model.")


def _output_losses(task, spec, weights, names) -> Tuple[Term, ...]:
  """The per-output loss terms, in the model's output order."""
  if isinstance(spec, Mapping):
    given = dict(spec)
  else:
    if len(spec) != len(names):
      raise ConfigError(
          f"task {task.name}: loss= lists {len(spec)} losses for a model "
          f"with {len(names)} outputs ({', '.join(names)}).")
    given = dict(zip(names, spec))
  unknown = [k for k in given if str(k) not in names]
  if unknown:
    raise ConfigError(
        f"task {task.name}: loss for output {unknown[0]!r}, which the model "
        f"does not have (its outputs: {', '.join(names)}).")
  if weights is None:
    weights = {}
  elif not isinstance(weights, Mapping):
    weights = dict(zip(names, weights))
  for k in weights:
    if str(k) not in names or given.get(k) is None:
      raise ConfigError(
          f"task {task.name}: loss_weights names {k!r}, which has no loss "
          f"(outputs with a loss: {', '.join(str(g) for g in given)}).")
  terms = []
  for name, key in names.items():
    fn = given.get(name, given.get(key))
    if fn is None:
      continue
    if not callable(fn):
      raise ConfigError(f"task {task.name}: the loss of output {name!r} is "
                        f"{type(fn).__name__}, not a function (labels, "
                        "outputs) -> one value per example.")
    terms.append(Term(f"{name}/loss", key, fn, f"the loss of output {name!r}",
                      float(weights.get(name, weights.get(key, 1.0)))))
  return tuple(terms)


def _check_labels(task, names, label_spec, keys) -> None:
  """Labels of the same structure as the outputs that have a loss."""
  by_key = {v: k for k, v in names.items()}
  if isinstance(label_spec, Mapping) and not all(
      isinstance(k, str) for k in names.values()):
    raise ConfigError(
        f"task {task.name}: the model returns a list of outputs and the "
        "labels are a dict; give the labels as a tuple in the outputs' "
        "order, or return a dict of outputs from the model.")
  if isinstance(label_spec, Mapping):
    extra = [k for k in label_spec if str(k) not in names]
    if extra:
      raise ConfigError(
          f"task {task.name}: label {extra[0]!r} matches no output of the "
          f"model (its outputs: {', '.join(names)}).")
    missing = [by_key[k] for k in keys if by_key[k] not in label_spec]
  elif isinstance(label_spec, (list, tuple)):
    if len(label_spec) != len(names):
      raise ConfigError(
          f"task {task.name}: {len(label_spec)} labels for a model with "
          f"{len(names)} outputs ({', '.join(names)}).")
    missing = []
  else:
    raise ConfigError(
        f"task {task.name}: the labels are one tensor, but loss= gives a "
        f"loss per output ({', '.join(by_key[k] for k in keys)}); make "
        "the labels a dict keyed by output name.")
  if missing:
    raise ConfigError(
        f"task {task.name}: no label for output {missing[0]!r}, which has a "
        f"loss (the labels' keys: {', '.join(map(str, label_spec))}).")


def _metrics(task, spec, names: Optional[dict], keys: List):
  """(functions, objects): the metrics as Terms and MetricObjects.

  One output: `spec` is {name: metric} or [metric or (name, metric), ...].
  Several: an entry keyed by an output name holds that output's metrics
  (one, a list or a dict); every other entry applies to each output that has
  a loss, as in Keras `compile(metrics=[...])`.
  """
  functions, objects = [], []

  def add(name, key, metric):
    if isinstance(metric, str):
      raise ConfigError(
          f"task {task.name}: metric {name!r} is the string {metric!r}; "
          "pass a function (labels, outputs) -> one value per example or a "
          "Keras metric object (e.g. keras.metrics.BinaryAccuracy()), which "
          "Keras `compile` would pick from the loss and the shapes.")
    if isinstance(metric, keras.metrics.Metric):
      objects.append(MetricObject(name, key, metric))
    elif callable(metric):
      functions.append(Term(name, key, metric, f"metric {name!r}"))
    else:
      raise ConfigError(
          f"task {task.name}: metric {name!r} is {type(metric).__name__}, "
          "not a function (labels, outputs) -> one value per example or a "
          "Keras metric object.")

  if names is None:
    for name, metric in _pairs(spec):
      add(name, None, metric)
    return tuple(functions), tuple(objects)
  by_key = {v: k for k, v in names.items()}
  own = spec if isinstance(spec, Mapping) else {}
  every = ([(n, m) for n, m in own.items() if n not in names]
           if isinstance(spec, Mapping) else _pairs(spec))
  for key in keys:
    output = by_key[key]
    for name, metric in _pairs(own.get(output, ())):
      add(f"{output}/{name}", key, metric)
    for name, metric in every:
      add(f"{output}/{name}", key, metric)
  return tuple(functions), tuple(objects)


def _pairs(spec) -> List[Tuple[str, object]]:
  """[(name, metric)] of a dict, a list of metrics or pairs, or one metric."""
  if isinstance(spec, Mapping):
    return list(spec.items())
  if not isinstance(spec, (list, tuple)):
    spec = [spec]
  return [item if isinstance(item, tuple) else (_name_of(item), item)
          for item in spec]


def _name_of(metric) -> str:
  """A metric's name: a function's `__name__`; a metric object's `name`,
  without the `_1`, `_2`... Keras appends to a default name when the class
  was made before in the process ("auc_1" for a second `AUC()`), so that
  the reported name does not depend on what else the process built."""
  if isinstance(metric, str):
    return metric
  name = (getattr(metric, "name", None) or getattr(metric, "__name__", None)
          or repr(metric))
  if isinstance(metric, keras.metrics.Metric):
    default = re.sub(r"([a-z])([A-Z])", r"\1_\2", re.sub(
        r"(.)([A-Z][a-z]+)", r"\1_\2", type(metric).__name__)).lower()
    if re.fullmatch(re.escape(default) + r"(_\d+)?", name):
      return default
  return name


def _listing(spec) -> str:
  return ", ".join(map(str, spec)) if isinstance(spec, Mapping) else (
      f"{len(spec)} losses")


def example_row(spec) -> object:
  """One row of zeros of each tensor of a batched spec (None dims: 1)."""
  return tf.nest.map_structure(
      lambda s: tf.zeros([1] + [d or 1 for d in s.shape.as_list()[1:]],
                         s.dtype), spec)
