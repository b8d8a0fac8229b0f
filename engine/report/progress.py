"""What a user watching the run sees: a progress bar on a terminal, log lines otherwise.

Only the chief reports progress; engine/report/reporting.py lowers other
workers' logging to warnings, so N workers do not print N copies of every
line.
"""
import sys
from typing import TextIO

from absl import logging

from engine import hooks

_BAR_WIDTH = 30


def make_hook(*, chief: bool, enabled: bool, log_every: int, total_steps: int,
              steps_per_epoch: int, stream: TextIO = None) -> hooks.Hook:
  """The progress hook for this process.

  Args:
    chief: only the chief reports progress; other workers get a no-op hook.
    enabled: False for --noprogress: log lines even on a terminal.
    log_every: steps between log lines (when there is no bar).
    total_steps: the step the run ends at.
    steps_per_epoch: steps in one epoch; the bar restarts every epoch.
    stream: where the bar goes, if it is a terminal (default: stdout as it
      is now, not as it was at import).
  """
  stream = stream or sys.stdout
  if not chief:
    return hooks.Hook()
  if enabled and stream.isatty():
    return ProgressBar(total_steps, steps_per_epoch, stream)
  return LogHook(log_every, total_steps)


def _clock(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  return (f"{h}:" if h else "") + "{:02d}:{:02d}".format(*divmod(rest, 60))


class ProgressBar(hooks.Hook):
  """One bar per epoch, redrawn after each host call, like Keras `fit`.

      epoch 2/8 [==========>-----------]  17/32 ETA 00:03 | loss 0.1234 | 9876.5 examples/s

  The ETA is the epoch's remaining steps at the mean step time of the run
  so far, leaving out the first host call (it traces the loop) once there
  are others.
  """

  def __init__(self, total_steps: int, steps_per_epoch: int, stream: TextIO):
    self._total = total_steps
    self._per_epoch = steps_per_epoch
    self._epochs = -(-total_steps // steps_per_epoch)
    self._stream = stream
    self._epoch_seconds = 0.0
    self._calls = 0
    self._steady_steps, self._steady_seconds = 0, 0.0

  def after_loop(self, step, rows, seconds):
    first = step - len(rows) + 1
    rate = float(rows["examples"].sum()) / seconds if seconds > 0 else 0.0
    losses = rows["loss"]
    per_step = seconds / len(rows)
    self._calls += 1
    if self._calls == 2:  # from now on, leave the tracing call out
      self._steady_steps, self._steady_seconds = 0, 0.0
    self._steady_steps += len(rows)
    self._steady_seconds += seconds
    for k in range(len(rows)):
      s = first + k
      self._epoch_seconds += per_step
      end_of_epoch = s % self._per_epoch == 0 or s == self._total
      if end_of_epoch or k == len(rows) - 1:
        self._draw(s, float(losses[k]), rate, end_of_epoch)
      if end_of_epoch:
        self._epoch_seconds = 0.0

  def _draw(self, step, loss, rate, end_of_epoch):
    epoch = (step - 1) // self._per_epoch + 1
    in_epoch = step - (epoch - 1) * self._per_epoch
    size = min(self._per_epoch, self._total - (epoch - 1) * self._per_epoch)
    done = int(_BAR_WIDTH * in_epoch / size)
    bar = "=" * done + (">" if done < _BAR_WIDTH else "") + "-" * max(
        0, _BAR_WIDTH - done - 1)
    if end_of_epoch:
      tail = f"{_clock(self._epoch_seconds)} total"
    else:
      eta = (size - in_epoch) * self._steady_seconds / self._steady_steps
      tail = f"ETA {_clock(eta)}"
    width = len(str(size))
    line = (f"epoch {epoch}/{self._epochs} [{bar}] {in_epoch:>{width}}/{size}"
            f" {tail} | loss {loss:.4f} | {rate:.1f} examples/s")
    # \r redraws the line; \x1b[K clears what a longer previous line left.
    self._stream.write("\r" + line + "\x1b[K" + ("\n" if end_of_epoch else ""))
    self._stream.flush()


class LogHook(hooks.Hook):
  """One absl log line per `log_every` steps and at the last step:

      step 40/256 | loss 0.4123 | accuracy 0.8750 | 9876.5 examples/s
  """

  def __init__(self, log_every: int, total_steps: int):
    self._every = log_every
    self._total = total_steps

  def after_loop(self, step, rows, seconds):
    first = step - len(rows) + 1
    rate = rows["examples"].sum() / seconds if seconds > 0 else float("nan")
    names = rows.metrics()
    for k in range(len(rows)):
      s = first + k
      if s % self._every == 0 or s == self._total:
        shown = " | ".join(f"{n} {rows[n][k]:.4f}" for n in names)
        logging.info("step %d/%d | %s | %.1f examples/s", s, self._total,
                     shown, rate)
