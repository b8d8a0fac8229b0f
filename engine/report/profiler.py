"""`--profile_steps=START,END`: a TensorFlow profiler trace of exactly those steps.

The hook makes the loop end a host call after step START - 1 and after step
END (through `next_stop`), starts the profiler at the first of those and stops
it at the second, so the trace holds steps START..END and nothing else. The
trace goes to model_dir/plugins/profile/<time>/, where TensorBoard's profile
tab (the tensorboard-plugin-profile package) finds it.

On multi_worker every worker cuts its host calls at the same steps, and the
chief traces. With --profile_all_workers worker k > 0 traces the same steps
into model_dir/worker_k/ (engine/core/roles.py), so the traces show which
worker the others waited for in each all-reduce (benchmarks/worker_skew.py
reads them). That is off by default because TensorFlow 2.21's profiler can
crash a non-chief worker as its trace stops: a double free or a segmentation
fault in TraceMeRecorder::Consume (SplitEventTracker), found in 2 of 40
2-worker launches on a loaded host and in a CI run; the chief's traces never
failed in 240 trace stops.
"""
import math
from typing import Tuple

from absl import logging
import tensorflow as tf

from engine import hooks


class ProfileHook(hooks.Hook):
  """Profiles steps START..END (1-based, inclusive) into `logdir`."""

  def __init__(self, logdir: str, steps: Tuple[int, int], start_step: int,
               trace: bool = True):
    """Starts at once if the run begins right before START.

    Args:
      logdir: the profiler's log directory (this worker's, see run.py).
      steps: (START, END).
      start_step: the step this run starts from (after a resume).
      trace: False on a worker that only cuts its host calls at START and
        END, as the tracing workers do, without tracing.
    """
    self._logdir = logdir
    self._first, self._last = steps
    self._trace = trace
    self._on = False
    # Every worker cuts its host calls at START and END alike: every worker
    # joins the same collectives per host call (the stop-flag exchange), so
    # calls that ended at different steps would wait on different
    # collectives.
    self._window = start_step <= self._first - 1
    if not self._window:
      logging.warning("--profile_steps=%d,%d: the run starts at step %d, "
                      "after START; no trace is taken.", self._first,
                      self._last, start_step + 1)
    elif start_step == self._first - 1:
      self._start()

  def next_stop(self, step):
    if not self._window:
      return math.inf
    if step < self._first - 1:
      return self._first - 1
    return self._last if step < self._last else math.inf

  def after_loop(self, step, rows, seconds):
    if self._window and step == self._first - 1:
      self._start()
    elif self._on and step >= self._last:
      self.close()

  def end(self, summary):
    self.close()

  def _start(self):
    if self._window and self._trace:
      tf.profiler.experimental.start(self._logdir)
      self._on = True

  def close(self):
    """Stops a trace in progress (also when training ends early)."""
    if self._on:
      tf.profiler.experimental.stop()
      self._on = False
      logging.info("Profiled steps %d-%d into %s/plugins/profile.",
                   self._first, self._last, self._logdir)
