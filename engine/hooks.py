"""Hooks the outer loop calls between compiled host calls (Orbit's loop hooks).

`Hook` declares every event a run raises; the engine's own hooks (progress,
TensorBoard, profiler, evaluation, best checkpoint, Keras callbacks,
checkpoints, resource guards) are Hooks like a user's, wired only through
these methods. A hook that must act at an exact step (a checkpoint, an
evaluation, a summary) says so through `next_stop`; the loop then ends its
host call there. Hooks never run inside the compiled loop, so they cannot
slow a step, only the gaps.
"""
import contextlib
import math
from typing import Callable, Dict, Optional, Sequence

import numpy as np


class Rows:
  """The steps of one host call, by name: `rows["loss"]` is one value per step.

  Columns: "loss" and each task metric (means over the step's examples),
  "examples" (the step's example count), "grad_norm" and "learning_rate"
  (the rate the step's update used). `votes`: the stop
  votes the call summed over the workers (engine/core/preemption.py).
  `running`: the columns of Keras metric objects, whose value is over the
  epoch so far and known at the call's last step only (NaN before it).
  """

  def __init__(self, names: Sequence[str], values: np.ndarray,
               votes: float = 0.0, running: Sequence[str] = ()):
    self.names = tuple(names)
    self.values = values  # float32 [steps, len(names)]
    self.votes = votes
    self.running = tuple(running)

  def __getitem__(self, name: str) -> np.ndarray:
    return self.values[:, self.names.index(name)]

  def __len__(self) -> int:
    return len(self.values)

  def metrics(self):
    """The names of the loss and the task's metrics, in order."""
    return [n for n in self.names
            if n not in ("examples", "grad_norm", "learning_rate")]


class Hook:
  """The events of a run, in the order they come; override what you need.

  Per run: `begin` once; then per host call `next_stop` (before it),
  `after_loop`, `on_eval` for an evaluation at that step, `stop_reason`;
  when the loop ends (normally or by an exception) `close`; after a normal
  end `end` with the summary. Hooks are called in the run's order: the
  engine's reporting hooks, then the ones passed to `engine.run(hooks=...)`,
  evaluation, best checkpoint, Keras callbacks, the rest; every hook hears
  every event, the user's included.
  """

  def begin(self, step: int) -> None:
    """Called once before the first host call; `step` is the start step."""

  def next_stop(self, step: int) -> float:
    """The first step > `step` at which this hook needs control (inf: none)."""
    del step
    return math.inf

  def after_loop(self, step: int, rows: Rows, seconds: float) -> None:
    """Called after each host call; `rows` holds its steps, `step` the last."""

  def on_eval(self, step: int, metrics: Dict[str, float]) -> None:
    """Called after each evaluation, with the weights of step `step`.

    `metrics`: "eval_loss", "eval_<metric>" per task metric (means over the
    evaluation's examples) and "eval_examples" (how many). The same values on
    every worker (all-reduced). Evaluations come every --eval_every steps,
    at each epoch's end, and at the last step (also from `end`'s side, for a
    resumed run that had nothing left to train).
    """

  def stop_reason(self) -> Optional[str]:
    """Why training should end after this host call (None: go on).

    Read after every host call on every worker: the answer must be the same
    on all of them at the same step (e.g. decided from all-reduced values),
    or the workers would part at different collectives.
    """
    return None

  def close(self) -> None:
    """Called once when the host loop ends, normally or by an exception,
    before `end`: release what the hook holds (a profiler trace running, a
    signal handler). Every hook's `close` is called even if one raises."""

  def end(self, summary: dict) -> None:
    """Called once with the final summary, before summary.json is written;
    a hook may add its keys."""


def eval_listeners(hook_list: Sequence[Hook]
                   ) -> Callable[[int, Dict[str, float]], None]:
  """on_eval(step, metrics) for each hook of `hook_list`, in order: what the
  evaluation hook calls with each result."""
  def on_eval(step, metrics):
    for h in hook_list:
      h.on_eval(step, metrics)
  return on_eval


@contextlib.contextmanager
def closing(hook_list: Sequence[Hook]):
  """Calls every hook's `close` on leaving, in order, also when one raises."""
  try:
    yield
  finally:
    with contextlib.ExitStack() as stack:
      for h in reversed(hook_list):  # the stack closes the last added first
        stack.callback(h.close)


def every(n: int, step: int) -> float:
  """The first multiple of n after `step`; inf for n <= 0."""
  return (step // n + 1) * n if n > 0 else math.inf

