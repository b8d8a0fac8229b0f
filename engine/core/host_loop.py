"""The host loop: calls of the compiled train loop until the last step.

`train` hands each call's rows to the hooks, keeps every step's row, times
the steady state (every call after the first, tracing one), stops at a NaN
before any hook can save it, and ends early where a hook or the workers'
stop vote says so, at the same step on every worker. `state` is run.py's
_State: `names`, `start_step`, `total_steps`, `train_loop`, `iterator`.
"""
import re
import time

from absl import logging
import numpy as np
import tensorflow as tf

from engine.core import inputs
from engine.hooks import Rows
from engine.errors import ConfigError, Diverged


def train(state, pace, hook_list, watch, stop):
  """Calls the compiled loop until the last step, handing each call to hooks.

  The first call runs a single step: it includes tracing, so it is left out of
  the steady-state throughput. Later calls run `pace.steps` steps
  (engine/core/pace.py), ended early where a hook needs control at an exact
  step.

  A hook's `stop_reason`, or a vote to finish the host call carried
  (engine/core/preemption.py), ends the loop early on every worker alike.

  Returns:
    (the History of the steps' rows, (steady examples, steady seconds),
    {"stop_step", "stop_reason"}: both None unless the loop ended early).
  """
  history, done = History(state.names), state.start_step
  steady_examples, steady_seconds = 0.0, 0.0
  loss_at = state.names.index("loss")
  norm_at = state.names.index("grad_norm")
  stopped = {"stop_step": None, "stop_reason": None}
  for h in hook_list:
    h.begin(done)
  while done < state.total_steps:
    first = done == state.start_step
    end = min([state.total_steps, done + (1 if first else pace.steps)] +
              [h.next_stop(done) for h in hook_list])
    n = int(end - done)
    vote = [stop.vote(), float(pace.proposal())]
    start = time.perf_counter()
    with watch("train", n):
      out, votes, proposed, delta = _host_call(state, n, vote, first=first)
    if state.metric_totals is not None:
      out = _with_results(state, done, out, delta)
    seconds = time.perf_counter() - start
    if not first:
      pace.timed(n, seconds)
    before = pace.steps
    pace.agreed(proposed)  # the next call's length, the same on every worker
    if pace.steps != before:
      logging.info("--steps_per_loop=auto: host calls of %d steps from step "
                   "%d (the last call: %d steps in %.3f s).", pace.steps,
                   done + n, n, seconds)
    rows = Rows(state.names, out, votes,
                running=state.objective.object_names)
    if not first:
      steady_examples += float(rows["examples"].sum())
      steady_seconds += seconds
    # NaN guard: raised before any hook, so no non-finite weights are saved.
    bad = np.flatnonzero(~np.isfinite(out[:, [loss_at, norm_at]]).all(axis=1))
    if bad.size:
      raise Diverged(
          f"loss {out[bad[0], loss_at]}, gradient norm {out[bad[0], norm_at]}"
          f" at step {done + bad[0] + 1}")
    done += n
    for h in hook_list:
      h.after_loop(done, rows, seconds)
    history.add(out)
    # The same answer on every worker at the same step: votes summed by the
    # host call, or hooks deciding from all-reduced values.
    reasons = [r for r in [stop.finish_reason(votes)] +
               [h.stop_reason() for h in hook_list] if r]
    if reasons and done < state.total_steps:
      stopped = {"stop_step": done, "stop_reason": "; ".join(reasons)}
      # A warning, so that every worker logs it (not only the chief).
      logging.warning("Stopping at step %d of %d: %s.", done,
                      state.total_steps, stopped["stop_reason"])
      break
  return history, (steady_examples, steady_seconds), stopped


class History:
  """The steps' rows, by column: every value of the last `keep` steps (4
  bytes each, in a ring that doubles up to `keep` rows), and of all steps
  the count, the first row and the column sums, so that a long run's memory
  stays flat (a multi-day run at 100 steps a second would otherwise keep
  gigabytes) and summary.json still says how it began."""

  def __init__(self, names, keep: int = 65_536):
    self.names = tuple(names)
    self.keep = keep
    self.steps = 0       # rows added in this run
    self.first = None    # the first row
    self.totals = np.zeros(len(self.names), np.float64)
    self._rows = np.zeros((min(1024, keep), len(self.names)), np.float32)

  def add(self, rows: np.ndarray) -> None:
    if not len(rows):
      return
    if self.first is None:
      self.first = rows[0].copy()
    self.totals += np.nansum(rows, axis=0, dtype=np.float64)
    end = self.steps + len(rows)
    if len(self._rows) < self.keep and end > len(self._rows):
      # Not wrapped yet: the rows so far are [0, steps).
      grown = np.zeros((min(self.keep, max(end, 2 * len(self._rows))),
                        len(self.names)), np.float32)
      grown[:self.steps] = self._rows[:self.steps]
      self._rows = grown
    kept = rows[-len(self._rows):]
    self._rows[np.arange(end - len(kept), end) % len(self._rows)] = kept
    self.steps = end

  def values(self) -> np.ndarray:
    """[min(steps, keep), columns], oldest first."""
    size = min(self.steps, len(self._rows))
    start = self.steps - size
    return self._rows[np.arange(start, self.steps) % len(self._rows)]

  def columns(self):
    """{name: the last `keep` steps' values}."""
    values = self.values()
    return {name: values[:, k] for k, name in enumerate(self.names)}


def _with_results(state, done: int, out: np.ndarray,
                  delta: np.ndarray) -> np.ndarray:
  """`out` with a column per Keras metric object: its result over the epoch
  so far at the call's last step, NaN at the steps before (a host call ends
  at every epoch's end, log and summary step when the task has metric
  objects: engine/core/metric_states.py's BoundaryHook)."""
  restart = done % state.data.steps_per_epoch == 0
  results = state.metric_reader.results(
      state.metric_totals.add(delta, restart))
  extra = np.full((len(out), len(results)), np.nan, np.float32)
  extra[-1] = [results[name] for name in state.metric_reader.names]
  return np.concatenate([out, extra], axis=1)


def _host_call(state, n: int, vote, first: bool):
  """One call of the compiled loop: ([n, columns], summed stop votes, the
  agreed length of the next call, the metric objects' summed states) on the
  host.

  The first call traces the step. A task mistake that only shows when the
  step runs (a label outside the model's classes, say) fails there, and is
  reported as the task's, in one line, before anything was trained.
  """
  try:
    rows, votes, delta = state.train_loop(
        state.iterator, tf.constant(n, tf.int32),
        tf.constant(vote, tf.float32))
    stop_votes, proposed = votes.numpy()
    return rows.numpy(), float(stop_votes), float(proposed), delta.numpy()
  except tf.errors.InvalidArgumentError as e:
    refused = inputs.input_error(e)
    if refused is not None:  # e.g. --strict_images met a corrupt image
      raise refused from e
    if not first:
      raise
    cause = _cause(str(e.message)) or type(e).__name__
    hint = ("--jit_compile: XLA cannot compile an op of the model; train "
            "without --jit_compile" if "XLA" in cause else
            "check that the task's labels fit the model's outputs")
    raise ConfigError(
        f"the first training step failed: {cause} ({hint}).") from e


def _cause(message: str) -> str:
  """The kernel's own line of a TensorFlow error message, which comes after
  "Graph execution error:" and "Detected at node ... (most recent call
  last):" with its indented traceback. On several replicas each one's
  error is listed after "N root error(s) found." as "  (0) CODE:  line":
  the first one's line."""
  for line in message.splitlines():
    listed = re.match(r"\s*\(\d+\) [A-Z_]+:\s*(\S.*)", line)
    if listed:
      return listed.group(1).strip()[:300]
    if (not line.strip() or line[0].isspace() or
        re.match(r"\d+ root error\(s\) found", line) or
        line.startswith(("Graph execution error", "Detected at node",
                         "<stack traces unavailable>"))):
      continue
    return line.strip()[:300]
  return ""
