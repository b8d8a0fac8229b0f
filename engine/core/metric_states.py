"""Keras metric objects across replicas and workers: a state per replica,
summed.

A metric object (`keras.metrics.AUC()`, `Precision`, `F1Score`, ...) is not a
mean of per-example values; its result comes from a state (AUC: counts of
true and false positives and negatives per threshold) that Keras builds as
variables. The engine makes a copy of each of the task's metrics in the
strategy's scope, once for training and once for evaluation: Keras creates
their variables synchronized on read, so each replica updates its own state
(`Replicas.update`). A compiled call starts from zeros (`reset`) and ends
by flattening each replica's state into one float32 vector (`read`), which
rides in the call's one all-reduce (training: the host call's, evaluation:
one at the pass's end); the sum is the state one device would have over
the same examples, because every such state is a sum over examples. A
metric whose variables do not aggregate by sum (a maximum, a running mean)
is refused.

On the host, `Totals` adds the calls' sums up (float64) and a plain copy of
each metric (`Reader`) turns them into results: training's over the epoch so
far (reset at each epoch's start, as Keras `fit` resets them) and
checkpointed, so a resumed run continues the epoch's state; evaluation's
over the whole pass.
"""
from typing import Dict, Sequence

import keras
import numpy as np
import tensorflow as tf

from engine.core import checks
from engine.core.objective import MetricObject, example_row, pick
from engine.errors import ConfigError
from engine.hooks import Hook, every


def _copy(task_name: str, entry: MetricObject) -> keras.metrics.Metric:
  metric = entry.template
  try:
    return type(metric).from_config(metric.get_config())
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(
        f"task {task_name}: metric {entry.name!r} ({type(metric).__name__}) "
        "cannot be copied with from_config(get_config()) "
        f"({checks.first_line(e)}); give its class a get_config().") from e


def _build_row(entry: MetricObject, labels_spec, outputs_spec):
  """One row of zeros for `entry`'s labels and outputs (rank as the step
  pairs them, engine/core/checks.py)."""
  return checks.common_rank(pick(example_row(labels_spec), entry.key),
                            pick(example_row(outputs_spec), entry.key))


class Replicas:
  """Copies of the task's metric objects with a state per replica.

  Made in the strategy's scope; a metric that builds its variables on its
  first update (F1Score) is built here, by one update of a row of zeros on
  every replica, outside any tf.function.
  """

  def __init__(self, strategy, task_name: str,
               entries: Sequence[MetricObject], labels_spec, outputs_spec):
    self.entries = tuple(entries)
    with strategy.scope():
      self.metrics = [_copy(task_name, e) for e in self.entries]
    for entry, metric in zip(self.entries, self.metrics):
      if not metric.variables:
        row = _build_row(entry, labels_spec, outputs_spec)
        strategy.run(lambda m=metric, r=row: m.update_state(*r))
    self.width = sum(int(np.prod(v.shape)) for m in self.metrics
                     for v in m.variables)

  def __bool__(self) -> bool:
    return bool(self.entries)

  def reset(self) -> tf.Tensor:
    """Replica context: this replica's states to zeros."""
    for m in self.metrics:
      for v in m.variables:
        v.assign(tf.zeros(v.shape, v.dtype))
    return tf.constant(0.0)

  def update(self, labels, outputs) -> tf.Tensor:
    """Replica context: adds a batch's examples to this replica's states
    (nothing for an empty batch)."""
    if not self.entries:
      return tf.constant(0.0)
    rows = tf.shape(tf.nest.flatten(labels)[0])[0]

    def add():
      for entry, metric in zip(self.entries, self.metrics):
        metric.update_state(*checks.common_rank(pick(labels, entry.key),
                                                pick(outputs, entry.key)))
      return tf.constant(0.0)
    return tf.cond(rows > 0, add, lambda: tf.constant(0.0))

  def read(self) -> tf.Tensor:
    """Replica context: this replica's states, float32 [width]."""
    if not self.width:
      return tf.zeros([0], tf.float32)
    return tf.concat([tf.reshape(tf.cast(v.value, tf.float32), [-1])
                      for m in self.metrics for v in m.variables], axis=0)


class Reader:
  """Results from summed states: a plain copy of each metric (no strategy),
  its variables set to the sums before `result()`.

  Raises (at construction):
    ConfigError: a metric whose state is not a sum, or whose result is not
      one number.
  """

  def __init__(self, task_name: str, entries: Sequence[MetricObject],
               labels_spec, outputs_spec):
    self.names = tuple(e.name for e in entries)
    self._metrics = [_copy(task_name, e) for e in entries]
    for entry, metric in zip(entries, self._metrics):
      if not metric.variables:
        metric.update_state(*_build_row(entry, labels_spec, outputs_spec))
      kinds = {str(getattr(v, "aggregation", "sum")) for v in metric.variables}
      if kinds != {"sum"}:
        raise ConfigError(
            f"task {task_name}: metric {entry.name!r} "
            f"({type(metric).__name__}) keeps a state that is not a sum "
            f"(its variables aggregate by {', '.join(sorted(kinds))}); the "
            "engine sums each replica's state, so it cannot report it "
            "exactly: use a metric whose variables add up over examples, or "
            "a per-example function.")
      metric.reset_state()
      shape = tf.convert_to_tensor(metric.result()).shape
      if shape.rank != 0:
        raise ConfigError(
            f"task {task_name}: metric {entry.name!r} "
            f"({type(metric).__name__}) returns shape {shape.as_list()}, not "
            "one number; configure it to give one (e.g. average='macro').")
    self._sizes = [[int(np.prod(v.shape)) for v in m.variables]
                   for m in self._metrics]

  def results(self, state: np.ndarray) -> Dict[str, float]:
    """{name: result} of the summed states (float [width])."""
    out, at = {}, 0
    for name, metric, sizes in zip(self.names, self._metrics, self._sizes):
      for v, size in zip(metric.variables, sizes):
        v.assign(np.reshape(state[at:at + size], v.shape).astype(v.dtype))
        at += size
      out[name] = float(metric.result())
    return out


class Totals:
  """Training's states summed over the host calls of the current epoch.

  `variable` (float64, in the strategy's scope) holds them for the
  checkpoint, so a run resumed mid-epoch continues the epoch's state.
  """

  def __init__(self, width: int):
    self.variable = tf.Variable(tf.zeros([width], tf.float64),
                                trainable=False)

  def trackable(self) -> tf.train.Checkpoint:
    return tf.train.Checkpoint(states=self.variable)

  def add(self, delta: np.ndarray, restart: bool) -> np.ndarray:
    """The epoch's states after a host call's sums `delta`; `restart`: the
    call began an epoch."""
    base = 0.0 if restart else self.variable.numpy()
    total = base + delta.astype(np.float64)
    self.variable.assign(total)
    return total


class BoundaryHook(Hook):
  """Ends host calls where metric objects' results are read: at each epoch's
  end (their states restart there) and at every log and summary step (a
  result is known at a call's last step only)."""

  def __init__(self, steps_per_epoch: int, log_every: int,
               summary_every: int):
    self._periods = [p for p in (steps_per_epoch, log_every, summary_every)
                     if p > 0]

  def next_stop(self, step: int) -> float:
    return min(every(p, step) for p in self._periods)
