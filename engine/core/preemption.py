"""Coordinated preemption: a SIGTERM/SIGINT stops every worker at the same step.

A signal only sets a flag on the process that got it: the handler cannot save,
it may run in the middle of a host call. After every host call all workers
exchange their flags in one tiny all-reduce (`step.make_stop_exchange`), so at
the same host-call boundary every worker learns whether any of them was
signalled, and all of them save a checkpoint at that step and exit with 75.
It does not matter which worker got the signal, or whether several got it at
slightly different times: a signal noted before a worker's k-th exchange
stops everyone after host call k, one noted later after host call k + 1.

The k-th exchange of every worker is the same collective because host calls
are aligned: every worker computes the same schedule (`Hook.next_stop`
depends only on the step and the config, and all resume from the chief's
checkpoint). With one worker (one_device, mirrored) the agreement is the
local flag itself and no exchange runs: every call of a tf.function that
holds a collective leaves about 1.6 KB behind in TensorFlow 2.21 (measured in
docs/design.md, "Memory over hours"), so a collective that decides nothing
is not worth its call.

Why not `tf.distribute.experimental.PreemptionCheckpointHandler`: it counts
its own `run` calls (one step each; ours run a variable number of steps), adds
its own counter variable to the checkpoint, writes through its own
CheckpointManagers (`max_to_keep=1`, its own non-chief directories, no
`run.json`), handles SIGTERM but not SIGINT, and exits the process from inside
the save. Matching all that to this loop would be more code than the
exchange, which costs one scalar all-reduce per host call (measured in
benchmarks/RESULTS.md).
"""
import signal
from typing import Optional

from absl import logging
import tensorflow as tf

from engine.config import DistributionConfig
from engine.core import step
from engine.distribute import cluster, hang

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A worker's flag in the exchange: 1 for a signal, this for a resource
# (engine/resources.py). float32 sums integers exactly up to 2**24.
_RESOURCE_FLAG = float(2**16)


class StopAgreement:
  """Notes SIGTERM/SIGINT and agrees with all workers when to act on it.

  Create it before the first host call and `close()` it after the last: while
  it exists the signals are only noted (the previous handlers come back on
  close).
  """

  def __init__(self, strategy: tf.distribute.Strategy,
               distribution: DistributionConfig, *, enabled: bool = True,
               watch=hang.unbounded):
    """Starts noting the signals.

    Args:
      strategy: the run's strategy; the exchange spans all its replicas.
      distribution: the communication options of the exchange.
      enabled: --preemption_sync; without it each worker acts on its own
        signal alone (only for measuring the exchange's cost; see README).
      watch: engine/hang.py's bound for the exchange.
    """
    self._watch = watch
    workers = getattr(strategy.extended, "_num_workers", 1)
    self._exchange = (step.make_stop_exchange(strategy, distribution)
                      if enabled and workers > 1 else None)
    self._signal = None
    self._resource = None  # why engine/resources.py asked to stop
    # Set when the agreed stop is for a resource on any worker.
    self.for_resource = False
    self._previous = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}

  def _on_signal(self, signum, frame):
    del frame
    self._signal = signum

  def request_stop(self, reason: str) -> None:
    """A stop for `reason` (a host resource nearly exhausted), not a signal."""
    self._resource = reason

  def should_stop(self, step_reached: int) -> Optional[str]:
    """Called by every worker after every host call, at the same boundary.

    Returns:
      None to go on, else why all workers stop at `step_reached`: the signal's
      name where it arrived, "stop requested by another worker" elsewhere.
    """
    # One number says both whether any worker wants to stop and whether
    # any wants it for a resource: the sum of 1s stays below _RESOURCE_FLAG.
    local = (_RESOURCE_FLAG if self._resource is not None else
             0.0 if self._signal is None else 1.0)
    if self._exchange is None:
      total = local
    else:
      with self._watch("exchange"):
        total = float(self._exchange(tf.constant(local, tf.float32)))
    if total == 0.0:
      return None
    self.for_resource = total >= _RESOURCE_FLAG
    # No collective follows, only the save: peers may now exit in any order
    # without the watchdog taking one that is still saving for a lost task.
    cluster.stop_watchdog()
    # Read again: a signal noted during the exchange is this worker's too.
    if self._resource is not None:
      reason = self._resource
    elif self.for_resource:
      reason = "stop requested by another worker (host resource)"
    elif self._signal is not None:
      reason = signal.Signals(self._signal).name
    else:
      reason = "stop requested by another worker"
    logging.info("Preemption: %s; every worker saves a checkpoint at step %d.",
                 reason, step_reached)
    return reason

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
