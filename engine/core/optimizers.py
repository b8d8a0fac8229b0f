"""Keras optimizers that apply gradients the engine has already all-reduced.

Keras 3's TensorFlow optimizer sums gradients across replicas by itself when it
is applied inside a replica context (`TFOptimizer._all_reduce_sum_gradients`).
The engine all-reduces explicitly in `engine/core/step.py`, so letting Keras do it
too would sum every gradient twice. Applying in cross-replica context is not an
option either: Keras then calls `merge_call` on a missing replica context. The
clean cut is the one hook Keras uses for that reduction, overridden to pass the
gradients through. `tests/test_parity.py` (N replicas == 1 replica) proves that
exactly one reduction happens.

With `--mixed_precision=mixed_float16` the optimizer is wrapped in Keras's
`LossScaleOptimizer` (dynamic loss scaling). The train step multiplies the loss
by its `dynamic_scale` and all-reduces the scaled gradients itself; the
wrapper only unscales what it is given, skips the update and halves the scale
when a gradient is not finite (every replica sees the same reduced gradient,
so all skip together, with no extra collective), and doubles the scale after
`dynamic_growth_steps` finite steps. It never reduces: its `apply` does not go
through the reduction hook, and the inner optimizer's hook passes through.

Every optimizer here (adam, adamw, sgd with momentum and Nesterov, rmsprop,
lion) is the Keras class behind the same hook; `tests/test_recipe_optimizers.py`
proves parity for each. `--weight_decay` is Keras's decoupled decay: before
each update a variable loses weight_decay x the scheduled learning rate x
itself, on every replica alike (the variable is the same everywhere, so no
reduction is involved). Which variables decay is decided by
`--weight_decay_exclude` over variable paths alone (see `build` below).
"""
import re
from typing import Optional

import keras

from engine.config import OptimizationConfig
from engine.core import schedules

_HOOK = "_all_reduce_sum_gradients"


def _explicit_all_reduce(cls):
  """Subclass of a Keras optimizer class that never reduces gradients itself,
  and whose weight decay spares exactly the variables whose path matches
  `_decay_exclude` (set by `create_optimizer`)."""
  if not hasattr(cls, _HOOK):
    # A Keras that reduces somewhere else would silently double the sum.
    raise RuntimeError(
        f"{cls.__name__} has no {_HOOK}; this Keras version reduces gradients "
        "elsewhere, so engine/core/optimizers.py must be updated.")

  def passthrough(self, grads_and_vars):
    del self  # already all-reduced once by the train step
    return list(grads_and_vars)

  def build(self, var_list):
    # Keras's own `exclude_from_weight_decay(var_names=...)` searches
    # `variable.name` ("bias", not "dense/bias"), and under tf.distribute it
    # sees each replica's component ("bias/replica_1:0"). A list of
    # variables is matched by identity instead, which Keras maps from the
    # components back to the variable: the regex over paths decides alone.
    pattern = getattr(self, "_decay_exclude", None)
    if pattern is not None:
      self.exclude_from_weight_decay(
          var_list=[v for v in var_list if pattern.search(v.path)])
    cls.build(self, var_list)

  return type(cls.__name__, (cls,), {_HOOK: passthrough, "build": build})


_CLASSES = {
    name: _explicit_all_reduce(cls) for name, cls in (
        ("adam", keras.optimizers.Adam), ("adamw", keras.optimizers.AdamW),
        ("sgd", keras.optimizers.SGD), ("rmsprop", keras.optimizers.RMSprop),
        ("lion", keras.optimizers.Lion))}


def create_optimizer(config: OptimizationConfig, *,
                     total_steps: Optional[int] = None,
                     steps_per_epoch: Optional[int] = None,
                     global_batch: Optional[int] = None
                     ) -> keras.optimizers.Optimizer:
  """Builds the optimizer `--optimizer` names; call inside strategy.scope().

  Args:
    config: the optimization section.
    total_steps, steps_per_epoch, global_batch: the run's numbers, which a
      learning-rate schedule needs (engine/core/schedules.py); a constant,
      unscaled rate works without them.

  Raises:
    ConfigError: the schedule does not fit the run (warmup too long, ...).
  """
  kwargs = {"learning_rate": schedules.learning_rate(
      config, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
      global_batch=global_batch)}
  if config.weight_decay:
    kwargs["weight_decay"] = config.weight_decay
  if config.optimizer == "sgd":
    kwargs.update(momentum=config.momentum, nesterov=config.nesterov)
  elif config.optimizer == "rmsprop":
    kwargs.update(momentum=config.momentum)
  inner = _CLASSES[config.optimizer](**kwargs)
  if config.weight_decay:
    inner._decay_exclude = re.compile(config.weight_decay_exclude)
  if config.loss_scaling:
    return keras.optimizers.LossScaleOptimizer(inner)
  return inner
