"""An exponential moving average of the trainable weights (--ema_decay).

After every optimizer update, inside the replica step:

    average = weights                                   at the first update
    average = decay * average + (1 - decay) * weights   after every later one

(Keras's `use_ema` rule: the first update copies, so an average never holds
the initial random weights, nor weights replaced by a fine-tuning load.)

Why no collective: the update reads only the weights, which every replica
holds identically after the one gradient all-reduce; so every replica's copy
of the average is the same value computed locally, on 1 replica, N replicas
or N workers alike. The averages are mirrored variables made in the
strategy's scope before the first tf.function call; the replica step updates
each replica's own copy through `merge_call` + `extended.update` (as Keras's
optimizers update their slots), which runs per device and sends nothing.

Evaluation and export use the averages: `swapped()` puts them into the model
and the trained weights back afterwards, bit for bit. The averages are part
of the checkpoint (`trackable()`), so a resumed run continues them exactly.
"""
import contextlib
from typing import List, Optional

import tensorflow as tf


class EMA:
  """The averages of `variables`; create inside `strategy.scope()`."""

  def __init__(self, variables, decay: float):
    self.decay = float(decay)
    self._variables = list(variables)
    self.averages: List[tf.Variable] = [
        tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                    name="ema_" + v.path.replace("/", "_"))
        for v in self._variables]

  def trackable(self) -> tf.train.Checkpoint:
    """What a checkpoint holds of the averages (under the key "ema")."""
    return tf.train.Checkpoint(averages=self.averages)

  def update(self, iterations: tf.Tensor) -> None:
    """Call in the replica step, after the optimizer applied its update.

    Args:
      iterations: the optimizer's update count after this update (1 at the
        first); the first one copies the weights.
    """
    decay = tf.where(iterations <= 1, 0.0, self.decay)
    pairs = list(zip(self.averages, self._variables))

    def per_device(average, value, decay):
      return average.assign(decay * average + (1.0 - decay) * value)

    def merged(strategy, decay):
      for average, variable in pairs:
        # `variable` resolves to this device's copy of the weights.
        strategy.extended.update(average, per_device,
                                 args=(variable, decay), group=False)

    tf.distribute.get_replica_context().merge_call(merged, args=(decay,))

  @contextlib.contextmanager
  def swapped(self):
    """The averages in the model inside the block; the weights back after."""
    kept = [tf.identity(v) for v in self._variables]
    for variable, average in zip(self._variables, self.averages):
      variable.assign(average)
    try:
      yield
    finally:
      for variable, value in zip(self._variables, kept):
        variable.assign(value)

  def values(self):
    """The averages as numpy arrays (replica 0's copy)."""
    return [a.numpy() for a in self.averages]


def swapped(ema: Optional[EMA]):
  """`ema.swapped()`, or a block that changes nothing without an average."""
  return contextlib.nullcontext() if ema is None else ema.swapped()
