"""How many steps a host call runs: `--steps_per_loop=N`, or `auto`.

A host call is one call of the compiled loop (engine/core/step.py): a Python
round trip and a point where every worker meets. Many short calls cost
speed on small models, and memory on multi_worker (TensorFlow 2.21 keeps
about 1.6 KB per call of a tf.function holding a collective; docs/
design.md); few long ones delay what happens between calls (progress,
the preemption agreement, resource checks). `auto` (the default) aims at
one host call about every TARGET_SECONDS:

* the first call runs one step (it traces); the calls after it start at
  one step and, from the second call's timing on, the speed of the last
  _WINDOW calls (their steps over their seconds, so a long call outweighs
  a short one) gives the length that would take TARGET_SECONDS, which is
  proposed unless it is within _HYSTERESIS of the current proposal (timing
  noise on a busy host does not move it), up to MAX_STEPS;
* the proposal rides in the host call's end-of-call all-reduce, and every
  worker takes replica 0's, i.e. the chief's (step.make_train_loop): host
  calls must hold the same number of steps on every worker, or their
  collectives would not match. A proposal takes effect one call after the
  call that carried it, on every worker alike.

Either way a call still ends where a hook needs an exact step (logging,
summaries, evaluation, checkpoints, profiling: `Hook.next_stop`), and the
results do not depend on the lengths: every step's batch and randomness are
functions of the step (engine/core/inputs.py). An explicit N keeps its
meaning: N steps per call (the first call still one).
"""
from typing import Union

TARGET_SECONDS = 1.0
MAX_STEPS = 100_000  # float32 carries it exactly (below 2**24)
_HYSTERESIS = 0.25
_WINDOW = 4


class Pace:
  """The length of the next host call, and this worker's proposal for it.

  Args:
    steps_per_loop: a positive number of steps, or "auto".
  """

  def __init__(self, steps_per_loop: Union[int, str]):
    self.auto = steps_per_loop == "auto"
    self.steps = 1 if self.auto else int(steps_per_loop)
    self._proposal = self.steps
    self._recent = []  # (steps, seconds) of the last _WINDOW timed calls
    self.calls = 0  # host calls made

  def proposal(self) -> int:
    """What this worker would run next, from the calls timed so far."""
    return self._proposal

  def timed(self, steps: int, seconds: float) -> None:
    """A call of `steps` steps (not the first, which traces) took `seconds`."""
    if not self.auto or seconds <= 0:
      return
    self._recent = (self._recent + [(steps, seconds)])[-_WINDOW:]
    rate = (sum(n for n, _ in self._recent) /
            sum(t for _, t in self._recent))
    ideal = min(MAX_STEPS, max(1, round(rate * TARGET_SECONDS)))
    if abs(ideal - self._proposal) > _HYSTERESIS * self._proposal:
      self._proposal = ideal

  def agreed(self, proposed: float) -> None:
    """The proposal all workers share (replica 0's), for the next call."""
    self.calls += 1
    if self.auto:
      self.steps = max(1, int(round(proposed)))
