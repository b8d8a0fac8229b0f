"""Coordinated preemption: a SIGTERM/SIGINT stops every worker at the same step.

A signal only sets a flag on the process that got it: the handler cannot save,
it may run in the middle of a host call. Each worker hands its flag (its
vote) to the next host call, whose end-of-call all-reduce (engine/core/
step.py, `make_train_loop`) sums the votes of all replicas of all workers
along with the step metrics. So at the end of the same host call every
worker learns whether any of them was signalled, and all of them save a
checkpoint at that step and exit with 75. It does not matter which worker
got the signal, or whether several got it at slightly different times: a
signal noted before a worker's k-th host call starts stops everyone after
host call k, one noted later after host call k + 1.

The k-th call of every worker is the same collective because host calls are
aligned: every worker computes the same schedule (`Hook.next_stop` depends
only on the step and the config, and all resume from the chief's
checkpoint). With one worker (one_device, mirrored) the agreement is the
local flag itself, read after each host call, so a signal is acted on at the
first boundary after it.

The votes ride in the metrics' all-reduce rather than in an exchange of
their own: TensorFlow 2.21 keeps about 1.6 KB per call of a tf.function
holding a collective (docs/design/host.md, "Memory over hours"), and one
call per host call is half of two.

Why not `tf.distribute.experimental.PreemptionCheckpointHandler`: it counts
its own `run` calls (one step each; ours run a variable number of steps), adds
its own counter variable to the checkpoint, writes through its own
CheckpointManagers (`max_to_keep=1`, its own non-chief directories, no
`run.json`), handles SIGTERM but not SIGINT, and exits the process from inside
the save. Matching all that to this loop would be more code than the votes
(measured in benchmarks/RESULTS.md).
"""
import signal
from typing import Optional

from absl import logging

from engine.distribute import cluster

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A worker's vote: 1 for a signal, this for a resource
# (engine/host/resources.py). float32 sums integers exactly up to 2**24.
_RESOURCE_FLAG = float(2**16)
# A vote to finish normally (a Keras callback set model.stop_training): the
# run saves, exports and exits 0. Each replica carries its worker's vote, so
# fewer than 2**8 replicas keep the three kinds apart in one float32 sum.
_FINISH_FLAG = float(2**8)


class StopAgreement:
  """Notes SIGTERM/SIGINT and agrees with all workers when to act on it.

  Create it before the first host call and `close()` it after the last: while
  it exists the signals are only noted (the previous handlers come back on
  close).

  Args:
    exchanged: the votes are summed over the workers by the host call
      (multi_worker with --preemption_sync); otherwise each worker acts on
      its own flag (one worker, or --nopreemption_sync, which only exists to
      measure what the agreement costs).
  """

  def __init__(self, *, exchanged: bool):
    self.exchanged = exchanged
    self._signal = None
    self._resource = None  # why engine/host/resources.py asked to stop
    self._finish = None  # why this worker asked to finish (a callback)
    # Set when the agreed stop is for a resource on any worker.
    self.for_resource = False
    self._previous = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}

  def _on_signal(self, signum, frame):
    del frame
    self._signal = signum

  def request_stop(self, reason: str) -> None:
    """A stop for `reason` (a host resource nearly exhausted), not a signal."""
    self._resource = reason

  def request_finish(self, reason: str) -> None:
    """Asks every worker to end training normally (`finish_reason`)."""
    if self._finish is None:
      self._finish = reason

  def vote(self) -> float:
    """This worker's flag, for the next host call to carry.

    One number says whether a worker wants to stop, and whether any wants
    it for a resource or only to finish: a sum of 1s stays below
    _FINISH_FLAG, a sum of those below _RESOURCE_FLAG.
    """
    return (_RESOURCE_FLAG if self._resource is not None else
            1.0 if self._signal is not None else
            _FINISH_FLAG if self._finish is not None else 0.0)

  def finish_reason(self, votes: float) -> Optional[str]:
    """Whether the host call just made carried a vote to finish.

    Unlike signals, a finish is always acted on at the end of the host call
    that carried it, also with one worker (where `votes` is the vote handed
    in): so 1 replica, N replicas and N workers stop at the same step.
    """
    if votes % _RESOURCE_FLAG < _FINISH_FLAG:
      return None
    return self._finish or "a callback on another worker asked to stop"

  def should_stop(self, step_reached: int, votes: float) -> Optional[str]:
    """Called by every worker after every host call, at the same boundary.

    Args:
      step_reached: the step the host call ended at.
      votes: the votes the call summed (used when `exchanged`).

    Returns:
      None to go on, else why all workers stop at `step_reached`: the signal's
      name where it arrived, "stop requested by another worker" elsewhere.
    """
    total = votes if self.exchanged else self.vote()
    if total % _FINISH_FLAG == 0.0 and total < _RESOURCE_FLAG:
      return None  # nobody signalled (a finish is `finish_reason`'s)
    self.for_resource = total >= _RESOURCE_FLAG
    # No collective follows, only the save: peers may now exit in any order
    # without the watchdog taking one that is still saving for a lost task.
    cluster.stop_watchdog()
    # Read again: a signal noted since the vote is this worker's too.
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
