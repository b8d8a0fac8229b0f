"""Learning-rate schedules: linear warmup from 0, then a decay, by update count.

A schedule is a function of `optimizer.iterations`, the number of updates
made before the current one, so step s (counted from 1, as summaries and
`--train_steps` count) uses the rate at s - 1. With `--grad_accum_steps` one
step is one update, so the schedule counts steps; a resumed run restores
`iterations` with the optimizer and continues the same curve.

With W warmup updates, T updates in the run and peak rate P (--learning_rate,
or the first of --lr_values, times global batch / --base_batch_size under
--lr_scaling=linear), the rate before update t is

    t < W        P * t / W                        (from 0, as Model Garden's
                                                    LinearWarmup and Keras's
                                                    CosineDecay warm up)
    constant     P
    cosine       P * (1 + cos(pi * (t - W) / (T - W))) / 2
    linear       P * (1 - (t - W) / (T - W))
    exponential  P * rate ** ((t - W) / decay_steps)
    piecewise    values[i] * scale, i = how many boundaries are <= t

so cosine and linear reach 0 at t = T, after the last update (the last update
itself uses the smallest rate above 0); piecewise's boundary b means "from
step b + 1 on".
"""
import dataclasses
import math
from typing import Optional, Tuple

from absl import logging
import keras
import tensorflow as tf

from engine.config import OptimizationConfig
from engine.errors import flag_error


@dataclasses.dataclass(frozen=True)
class Plan:
  """A schedule in plain numbers, checked against the run's length."""
  kind: str
  peak: float  # the rate warmup climbs to (piecewise: the first value)
  warmup: int  # updates
  total: int   # updates in the whole run
  scale: float = 1.0  # --lr_scaling's factor, already in `peak` and `values`
  boundaries: Tuple[int, ...] = ()
  values: Tuple[float, ...] = ()
  decay_rate: float = 0.0
  decay_steps: int = 0

  @property
  def constant(self) -> bool:
    """True when the rate never changes (a plain float will do)."""
    return self.kind == "constant" and self.warmup == 0

  def describe(self) -> str:
    """The one log line: peak, warmup, decay."""
    decay = {
        "constant": "then constant",
        "cosine": f"then cosine decay to 0 at step {self.total}",
        "linear": f"then linear decay to 0 at step {self.total}",
        "exponential": f"then x{self.decay_rate:g} every {self.decay_steps} "
                       "steps",
        "piecewise": "then " + ", ".join(
            f"{v:g} from step {b + 1}" for b, v in
            zip(self.boundaries, self.values[1:])),
    }[self.kind]
    scaled = (f" (scaled x{self.scale:g} by --lr_scaling=linear)"
              if self.scale != 1 else "")
    warmup = (f"linear warmup from 0 over {self.warmup} steps"
              if self.warmup else "no warmup")
    return (f"Learning rate: {self.kind}, peak {self.peak:g}{scaled}, "
            f"{warmup}, {decay}.")


def plan(config: OptimizationConfig, *, total_steps: int,
         steps_per_epoch: int, global_batch: int) -> Plan:
  """The run's schedule; checks what needs the run's length.

  Args:
    config: the optimization section (its own checks already passed).
    total_steps: optimizer updates in the whole run.
    steps_per_epoch: for --warmup_epochs.
    global_batch: examples per update, for --lr_scaling=linear.

  Raises:
    ConfigError: warmup not shorter than the run, or a piecewise boundary
      inside the warmup or at or past the last step.
  """
  scale = (global_batch / config.base_batch_size
           if config.lr_scaling == "linear" else 1.0)
  if config.warmup_epochs:
    flag, given = "warmup_epochs", config.warmup_epochs
    warmup = config.warmup_epochs * steps_per_epoch
  else:
    flag, given = "warmup_steps", config.warmup_steps
    warmup = config.warmup_steps
  if warmup and warmup >= total_steps:
    raise flag_error(flag, given, f"is {warmup} steps, but the run has "
                     f"{total_steps}; warmup must end before the last step.")
  values = tuple(v * scale for v in config.lr_values)
  bounds = config.lr_boundaries
  if bounds and (bounds[0] <= warmup or bounds[-1] >= total_steps):
    raise flag_error("lr_boundaries", ",".join(map(str, bounds)),
                     f"must lie after the warmup ({warmup} steps) and before "
                     f"the last step ({total_steps}).")
  peak = values[0] if values else config.learning_rate * scale
  return Plan(config.lr_schedule, peak, warmup, total_steps, scale, bounds,
              values, config.lr_decay_rate, config.lr_decay_steps)


class Schedule(keras.optimizers.schedules.LearningRateSchedule):
  """A `Plan` as the Keras schedule the optimizer calls with `iterations`."""

  def __init__(self, p: Plan):
    self.plan = p

  def __call__(self, step):
    # float64: exact step counts and no drift between the schedule and the
    # hand-computed values the tests and logs use; cast once at the end.
    p = self.plan
    t = tf.cast(step, tf.float64)
    after = _decayed(p, t, t - p.warmup)
    if p.warmup:
      warm = p.peak * t / p.warmup
      after = tf.where(t < p.warmup, warm, after)
    return tf.cast(after, tf.float32)

  def get_config(self):
    return dataclasses.asdict(self.plan)


def _decayed(p: Plan, t, since_warmup):
  """The rate after warmup, float64."""
  length = float(p.total - p.warmup)
  if p.kind == "cosine":
    return p.peak * 0.5 * (1.0 + tf.cos(math.pi * since_warmup / length))
  if p.kind == "linear":
    return p.peak * (1.0 - since_warmup / length)
  if p.kind == "exponential":
    return p.peak * tf.pow(tf.constant(p.decay_rate, tf.float64),
                           since_warmup / p.decay_steps)
  if p.kind == "piecewise":
    index = tf.reduce_sum(tf.cast(
        t >= tf.constant(p.boundaries, tf.float64), tf.int32))
    return tf.gather(tf.constant(p.values, tf.float64), index)
  return tf.constant(p.peak, tf.float64)


def learning_rate(config: OptimizationConfig, *, total_steps: Optional[int],
                  steps_per_epoch: Optional[int],
                  global_batch: Optional[int]):
  """The optimizer's `learning_rate`: a float when constant, else a Schedule.

  Logs the schedule once. Without the run's numbers (a caller building an
  optimizer outside `engine.run`) only an unscaled constant rate works.

  Raises:
    ConfigError: see `plan`.
    ValueError: a schedule that needs numbers the caller did not give.
  """
  if None in (total_steps, steps_per_epoch, global_batch):
    if not (config.lr_schedule == "constant" and not config.warmup_steps and
            not config.warmup_epochs and config.lr_scaling == "none"):
      raise ValueError("this learning-rate schedule needs total_steps, "
                       "steps_per_epoch and global_batch.")
    return config.learning_rate
  p = plan(config, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
           global_batch=global_batch)
  logging.info(p.describe())
  return p.peak if p.constant else Schedule(p)
