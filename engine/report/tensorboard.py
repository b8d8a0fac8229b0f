"""TensorBoard event files: model_dir/train from the host loop, model_dir/eval on request.

Everything here runs on the host between compiled host calls, from the rows
the compiled loop already returns (per step: loss, accuracy, examples,
gradient norm, the learning rate the step's update used), so writing
summaries adds no op and no host sync to a step.
Workers other than the chief get no-op writers (as Orbit does) instead of
`if chief` branches, so every worker runs the same code.
"""
import os
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from engine import hooks

# Written with the loss and the task's metrics, from each host call.
RATE_TAGS = ("learning_rate", "examples_per_sec", "steps_per_sec",
             "grad_norm")


def train_tags(names: Sequence[str]):
  """The train run's tags: the loss and metrics of a step's row, then rates."""
  return tuple(n for n in names if n not in ("examples",) + RATE_TAGS) + (
      RATE_TAGS)


def make_writer(logdir: str, enabled: bool):
  """A file writer for `logdir`, or a no-op writer that creates nothing."""
  if not enabled:
    return tf.summary.create_noop_writer()
  return tf.summary.create_file_writer(logdir)


class SummaryHook(hooks.Hook):
  """Writes `train_tags` every `every` steps, and each evaluation (`on_eval`).

  The rates of a step are those of the host call that ran it: examples of
  that call divided by its wall time. The call that traced the loop (the
  first) shows as a low rate at its step.
  """

  def __init__(self, model_dir: str, names: Sequence[str], *, enabled: bool,
               every: int):
    """Opens model_dir/train now and model_dir/eval at the first evaluation.

    Args:
      model_dir: event files go to model_dir/train and model_dir/eval.
      names: the columns of a step's row (engine/core/step.py).
      enabled: False on non-chief workers (no-op writers, no files).
      every: write at every step that is a multiple of this (0: never).
    """
    self._every = every
    self._tags = train_tags(names)
    on = enabled and every > 0
    self._train = make_writer(os.path.join(model_dir, "train"), on)
    self._write = self._write_fn()
    # Opened lazily, so a run without evaluation has no empty eval run in
    # TensorBoard; it does not depend on --summary_every.
    self._eval_dir = os.path.join(model_dir, "eval")
    self._enabled = enabled
    self._eval = None

  def after_loop(self, step, rows, seconds):
    if not self._every:
      return
    first = step - len(rows) + 1
    wanted = [k for k in range(len(rows)) if (first + k) % self._every == 0]
    if not wanted:
      return
    n = len(wanted)
    rates = {"examples_per_sec": float(rows["examples"].sum()) / seconds,
             "steps_per_sec": len(rows) / seconds}
    values = np.stack([
        rows[tag][wanted] if tag in rows.names else np.full(n, rates[tag])
        for tag in self._tags], axis=1).astype(np.float32)
    for k, row in zip(wanted, values):
      self._write(row, np.int64(first + k))

  def _write_fn(self):
    """All tags of one summary step in one traced call.

    Eager `tf.summary.scalar` costs about 1 ms per scalar on a busy CPU; one
    tf.function call for all of them costs a few times less. It runs on the
    host after the host call, never inside the compiled train loop. (No
    `tf.range` over steps here: its while loop would prefix every tag.)
    """
    @tf.function(input_signature=[
        tf.TensorSpec([len(self._tags)], tf.float32),
        tf.TensorSpec([], tf.int64)], autograph=False)  # a Python loop
    def write(values, step):
      with self._train.as_default():
        for k, tag in enumerate(self._tags):
          tf.summary.scalar(tag, values[k], step=step)
    return write

  def on_eval(self, step: int, metrics: Mapping[str, float]) -> None:
    """Writes one evaluation to model_dir/eval.

    A leading "eval_" is dropped from each name ("eval_loss" -> "loss"), so
    TensorBoard draws the train and eval runs of a tag in one chart.
    """
    if self._eval is None:
      self._eval = make_writer(self._eval_dir, self._enabled)
    with self._eval.as_default():
      for name, value in metrics.items():
        tag = name[len("eval_"):] if name.startswith("eval_") else name
        tf.summary.scalar(tag, float(value), step=step)
    self._eval.flush()

  def end(self, summary):
    # Flushed, not closed: an evaluation at the end may still be written.
    del summary
    self._train.flush()
    if self._eval is not None:
      self._eval.flush()
