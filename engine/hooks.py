"""Hooks the outer loop calls between compiled host calls (Orbit's loop hooks).

A hook that must act at an exact step (a checkpoint, an evaluation, a summary)
says so through `next_stop`; the loop then ends its host call there. Hooks never
run inside the compiled loop, so they cannot slow a step, only the gaps.
"""
import math

from absl import logging
import numpy as np


class Hook:
  """No-op base: override what you need."""

  def next_stop(self, step: int) -> float:
    """The first step > `step` at which this hook needs control (inf: none)."""
    del step
    return math.inf

  def after_loop(self, step: int, rows: np.ndarray, seconds: float) -> None:
    """Called after each host call; `rows`: its steps' [loss, acc, count, grad norm]."""

  def end(self, summary: dict) -> None:
    """Called once with the final summary, before summary.json is written."""


def every(n: int, step: int) -> float:
  """The first multiple of n after `step`; inf for n <= 0."""
  return (step // n + 1) * n if n > 0 else math.inf


class LogHook(Hook):
  """One absl log line per `log_every` steps and at the last step."""

  def __init__(self, log_every: int, total_steps: int):
    self._every = log_every
    self._total = total_steps

  def after_loop(self, step, rows, seconds):
    first = step - len(rows) + 1
    rate = rows[:, 2].sum() / seconds if seconds > 0 else float("nan")
    for k, (loss, accuracy, _, _) in enumerate(rows):
      s = first + k
      if s % self._every == 0 or s == self._total:
        logging.info("step %d/%d | loss %.4f | accuracy %.4f | %.1f examples/s",
                     s, self._total, loss, accuracy, rate)
