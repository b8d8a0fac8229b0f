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
"""
import keras

from engine.config import OptimizationConfig

_HOOK = "_all_reduce_sum_gradients"


def _explicit_all_reduce(cls):
  """Subclass of a Keras optimizer class that never reduces gradients itself."""
  if not hasattr(cls, _HOOK):
    # A Keras that reduces somewhere else would silently double the sum.
    raise RuntimeError(
        f"{cls.__name__} has no {_HOOK}; this Keras version reduces gradients "
        "elsewhere, so engine/optimizers.py must be updated.")

  def passthrough(self, grads_and_vars):
    del self  # already all-reduced once by the train step
    return list(grads_and_vars)

  return type(cls.__name__, (cls,), {_HOOK: passthrough})


_CLASSES = {
    "adam": _explicit_all_reduce(keras.optimizers.Adam),
    "sgd": _explicit_all_reduce(keras.optimizers.SGD),
}


def create_optimizer(config: OptimizationConfig) -> keras.optimizers.Optimizer:
  """Builds the optimizer `--optimizer` names; call inside strategy.scope()."""
  if config.optimizer == "sgd":
    inner = _CLASSES["sgd"](learning_rate=config.learning_rate,
                            momentum=config.momentum)
  else:
    inner = _CLASSES["adam"](learning_rate=config.learning_rate)
  if uses_loss_scaling(config):
    return keras.optimizers.LossScaleOptimizer(inner)
  return inner


def uses_loss_scaling(config: OptimizationConfig) -> bool:
  """float16's range is too small for small gradients; bfloat16's is not."""
  return config.mixed_precision == "mixed_float16"
