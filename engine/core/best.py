"""--keep_best and --early_stopping_patience: acting on evaluation results.

After each evaluation the hook compares the metric with the best so far.
Which way is better follows from the name (`minimised`): losses and errors
go down, everything else (accuracies) up. An improvement saves the
checkpoint and the export of that step to model_dir/best (with
--keep_best); N evaluations in a row without one (--early_stopping_patience)
end training at that step.

Every worker decides alike at the same step without exchanging anything:
the evaluation's sums are all-reduced (engine/core/evaluate.py), so every
worker holds the same metric values, bit for bit, and evaluations happen at
the same steps everywhere. The best value, its step and the count of
evaluations since are variables in the checkpoint, so a resumed run
continues the comparison exactly where the checkpoint left it.
"""
import json
import math
import os
from typing import Callable, Optional, Sequence

from absl import logging
import tensorflow as tf

from engine.hooks import Hook
from engine.errors import flag_error

# Name parts of metrics that are better when lower (docs/guide/checkpoints.md
# states the rule).
_MINIMISED = ("loss", "error", "mae", "mse", "mape", "crossentropy")


def minimised(metric: str) -> bool:
  """Whether lower values of `metric` are better."""
  name = metric.lower()
  return any(part in name for part in _MINIMISED)


def tracked_metric(keep_best: str, patience: int) -> str:
  """The metric compared: --keep_best's, else eval_loss; "" for none."""
  if keep_best:
    return keep_best
  return "eval_loss" if patience else ""


def check_metric(keep_best: str, eval_keys: Sequence[str]) -> None:
  """Refuses a --keep_best metric the task's evaluation does not produce.

  Raises:
    ConfigError: the name is not one of `eval_keys`.
  """
  valid = [k for k in eval_keys if k != "eval_examples"]
  if keep_best and keep_best not in valid:
    raise flag_error("keep_best", keep_best,
                     f"no such evaluation metric; valid: {', '.join(valid)}.")


class BestState:
  """The comparison's state as checkpointed variables (make in the scope)."""

  def __init__(self):
    self.value = tf.Variable(math.nan, dtype=tf.float64, trainable=False)
    self.step = tf.Variable(-1, dtype=tf.int64, trainable=False)
    self.since = tf.Variable(0, dtype=tf.int64, trainable=False)

  def trackable(self) -> tf.train.Checkpoint:
    return tf.train.Checkpoint(value=self.value, step=self.step,
                               since=self.since)


class BestHook(Hook):
  """Keeps the best evaluation and stops after `patience` without one.

  Args:
    metric: the summary key compared, e.g. "eval_accuracy".
    patience: evaluations without improvement before stopping (0: never).
    state: the checkpointed `BestState`.
    on_best: called as on_best(step, metrics) at each improvement (saves the
      checkpoint and the export into model_dir/best), or None.
  """

  def __init__(self, metric: str, patience: int, state: BestState,
               on_best: Optional[Callable[[int, dict], None]]):
    self.metric = metric
    self._patience = patience
    self._state = state
    self._on_best = on_best
    self._minimised = minimised(metric)
    self._stop = None

  def on_eval(self, step: int, metrics: dict) -> None:
    value = float(metrics[self.metric])
    best = float(self._state.value.numpy())
    better = (math.isnan(best) and not math.isnan(value)) or (
        value < best if self._minimised else value > best)
    if better:
      self._state.value.assign(value)
      self._state.step.assign(step)
      self._state.since.assign(0)
      logging.info("New best %s %.6g at step %d.", self.metric, value, step)
      if self._on_best is not None:
        self._on_best(step, metrics)
      return
    since = int(self._state.since.numpy()) + 1
    self._state.since.assign(since)
    if self._patience and since >= self._patience:
      self._stop = (f"early stopping: {self.metric} did not improve in "
                    f"{since} evaluation(s) (best {best:.6g} at step "
                    f"{int(self._state.step.numpy())})")

  def stop_reason(self) -> Optional[str]:
    return self._stop

  def end(self, summary):
    step = int(self._state.step.numpy())
    summary.update(best_metric=self.metric,
                   best_value=float(self._state.value.numpy())
                   if step >= 0 else None,
                   best_step=step if step >= 0 else None)


def best_saver(best_dir: str, save_checkpoint: Callable[[int], str],
               export: Optional[Callable[[str], None]]):
  """on_best for --keep_best: checkpoint, export and best.json in best_dir.

  Every worker writes (non-chief workers into their private directory), as
  the final checkpoint and export are written.
  """
  def on_best(step: int, metrics: dict) -> None:
    path = save_checkpoint(step)
    if export is not None:
      export(os.path.join(best_dir, "export"))
    tmp = os.path.join(best_dir, "best.json.tmp")
    with open(tmp, "w") as f:
      json.dump({"step": step, "checkpoint": path, **metrics}, f, indent=2)
    os.replace(tmp, os.path.join(best_dir, "best.json"))
  return on_best
