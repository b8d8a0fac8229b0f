"""Hang detection: one guard thread per process bounds every host call.

TensorFlow can bound each collective op itself
(`CommunicationOptions.timeout_seconds`), but it pays for that with one
thread per op that sleeps for the whole timeout (base_collective_executor.cc,
"TODO: Share the timeout watchdog thread among collectives";
tensorflow#62466): with 2 replicas about 4 threads per step, so a run of a
few thousand steps holds tens of thousands of threads and dies in
`std::system_error` when the next one cannot be made. The engine therefore
gives no collective a timeout (engine/distribute/devices.py) and bounds the calls
instead: the loop opens a `watch` around every compiled call that can wait on
peers (a training host call, an evaluation pass), and
this one thread aborts every collective of the process
(`abort_collective_ops`) when a call outlives its bound. The call then raises
at once, and `engine.main` prints `reason` as one line and exits with 3.

The bound. `--collective_timeout` is the longest a step may wait on its peers.
Inside one compiled call the host cannot tell waiting from computing, so a
call may take what it is expected to compute plus `--collective_timeout`:

    bound = collective_timeout + 2 * units * (slowest seconds per unit seen)

where the units are steps (training) or examples (evaluation),
and the slowest rate is taken over the earlier calls of the same kind except
each kind's first, which includes graph optimisation, the collectives' group
set-up and the input pipeline's warm-up. Until a kind has a rate, its bound is
`--init_timeout` + `--collective_timeout`. The rate never falls, so a slow
phase only makes later bounds more lenient.

On multi_worker the same thread also listens to the cluster watchdog process
(engine/distribute/watchdog.py): a peer that stopped accepting connections is reported
there within seconds, and aborting the collectives here, rather than killing
the process, lets the worker exit with its documented code.

Cost: one thread for the whole run; entering and leaving a watch takes a lock
(microseconds per host call); the thread wakes twice a second.
"""
import contextlib
import os
import select
import threading
import time
from typing import Callable, Dict, Optional, TextIO

from absl import logging
import tensorflow as tf
from tensorflow.python.eager import context

from engine.errors import ClusterError

_POLL_SECONDS = 0.5
_SLACK = 2.0  # a call may take twice its expected compute time


class HangGuard:
  """Aborts the process's collectives when a watched call outlives its bound.

  Args:
    collective_timeout: seconds a call may wait on peers beyond its expected
      compute time (`--collective_timeout`).
    warmup_seconds: extra allowance for a kind's calls until it has a rate
      (`--init_timeout`).
    peer_messages: the cluster watchdog process's stdout (multi_worker), or
      None. A line `lost <reason>` aborts the collectives with that reason.
    name_stuck: called after a call outlived its bound; returns a line naming
      the peers that stopped responding, or None when it cannot name any.
    abort: what aborting does (the default aborts TensorFlow's collectives);
      tests pass their own.
  """

  def __init__(self, collective_timeout: float, warmup_seconds: float, *,
               peer_messages: Optional[TextIO] = None,
               name_stuck: Callable[[], Optional[str]] = lambda: None,
               abort: Optional[Callable[[str], None]] = None):
    self._timeout = collective_timeout
    self._warmup = warmup_seconds
    self._peers = peer_messages
    self._name_stuck = name_stuck
    self._abort_fn = abort or _abort_collectives
    self._lock = threading.Lock()
    self._calls: Dict[str, int] = {}
    self._rate: Dict[str, float] = {}  # slowest seconds per unit, per kind
    self._watch = None  # (kind, units, deadline, what the bound allows)
    self.reason: Optional[str] = None
    self._closed = threading.Event()
    self._thread = threading.Thread(target=self._run, name="hang-guard",
                                    daemon=True)
    self._thread.start()

  def bound(self, kind: str, units: int) -> float:
    """Seconds the next call of `kind` over `units` units may take."""
    rate = self._rate.get(kind)
    if rate is None:
      return self._warmup + self._timeout
    return self._timeout + _SLACK * units * rate

  def _allowance(self, kind: str, units: int) -> str:
    """What the bound is made of, for the error line."""
    rate = self._rate.get(kind)
    if rate is None:
      return (f"--collective_timeout={self._timeout:g} plus the "
              f"--init_timeout={self._warmup:g} a kind's first calls get")
    return (f"--collective_timeout={self._timeout:g} beyond its expected "
            f"{_seconds(_SLACK * units * rate)}")

  @contextlib.contextmanager
  def watch(self, kind: str, units: int = 1):
    """Bounds the call made inside; learns its rate when it returns.

    Args:
      kind: "train" or "eval"; each kind has its own rate.
      units: steps or examples the call runs (its expected time scales).
    """
    bound = self.bound(kind, units)
    started = time.monotonic()
    with self._lock:
      self._watch = (kind, units, started + bound,
                     self._allowance(kind, units))
    try:
      yield
    finally:
      seconds = time.monotonic() - started
      with self._lock:
        self._watch = None
        calls = self._calls.get(kind, 0) + 1
        self._calls[kind] = calls
        if calls > 1 and self.reason is None:
          self._rate[kind] = max(self._rate.get(kind, 0.0),
                                 seconds / max(units, 1))

  def close(self) -> None:
    """Stops the thread; later calls are no longer bounded."""
    self._closed.set()
    self._thread.join(5)

  def _run(self):
    fd = self._peers.fileno() if self._peers is not None else None
    pending = ""
    while not self._closed.is_set():
      if fd is None:
        self._closed.wait(_POLL_SECONDS)
      elif select.select([fd], [], [], _POLL_SECONDS)[0]:
        chunk = os.read(fd, 4096).decode(errors="replace")
        if not chunk:  # the cluster watchdog ended
          fd = None
          continue
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
          if line.startswith("lost "):
            self._fire(line[len("lost "):])
            return
      with self._lock:
        watch = self._watch
      if watch is not None and time.monotonic() > watch[2]:
        self._fire(self._name_stuck() or _overdue_line(*watch))
        return

  def _fire(self, reason: str) -> None:
    self.reason = reason
    logging.error("Hang guard: %s Aborting the collectives.", reason)
    self._abort_fn(reason)


def _overdue_line(kind: str, units: int, deadline: float,
                  allowance: str) -> str:
  del deadline
  what = {"train": f"a training host call of {units} step(s)",
          "eval": f"an evaluation pass over {units} examples"}.get(kind, kind)
  return (f"{what} took longer than {allowance}: a collective is stuck; "
          "stopping.")


def _seconds(value: float) -> str:
  return f"{value:.1f} s" if value >= 0.1 else f"{value * 1000:.0f} ms"


def _abort_collectives(reason: str) -> None:
  # Every pending and later collective of this process fails with this
  # status; TensorFlow asks for a restart to use collectives again, which is
  # what happens: the run ends.
  context.context().abort_collective_ops(tf.errors.UNAVAILABLE, reason)


@contextlib.contextmanager
def bounded_calls(collective_timeout: float, warmup_seconds: float, **kwargs):
  """A HangGuard for the block; yields its `watch`.

  A TensorFlow error raised in the block after the guard fired becomes a
  `ClusterError` with the guard's one line: the error TensorFlow raises
  for an aborted collective only says that it was aborted.
  """
  guard = HangGuard(collective_timeout, warmup_seconds, **kwargs)
  try:
    yield guard.watch
  except tf.errors.OpError as e:
    if guard.reason is None:
      raise
    raise ClusterError(guard.reason) from e
  finally:
    guard.close()


def unbounded(kind: str, units: int = 1):
  """A `watch` that bounds nothing, for callers outside a training run."""
  del kind, units
  return contextlib.nullcontext()
