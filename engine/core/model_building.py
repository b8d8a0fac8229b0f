"""The task's model as the engine trains it: dtype policy, BatchNorm, frozen layers.

Built inside the strategy's scope by training and by --mode=eval alike, so a
checkpoint restores into the same variables either way.
"""
import contextlib

import keras

from engine.config import BatchNormConfig
from engine.core import batchnorm as batchnorm_lib
from engine.core import init_weights
from engine.errors import ConfigError
from engine.task import Task


def build_model(task: Task, *, mixed_precision: str,
                batchnorm: BatchNormConfig, freeze: str = "") -> keras.Model:
  """The task's model under --mixed_precision's dtype policy, its
  BatchNormalization layers set (--fused_batchnorm, --sync_batchnorm) and
  --freeze's layers frozen (before the optimizer takes the variables).

  Raises:
    ConfigError: the task's build_model() did not return a keras.Model.
  """
  with dtype_policy(mixed_precision):
    model = task.build_model()
  if not isinstance(model, keras.Model):
    raise ConfigError(f"task {task.name}: build_model() returned "
                      f"{type(model).__name__}, not a keras.Model.")
  batchnorm_lib.configure(model, synchronized=batchnorm.sync_batchnorm,
                          fused=batchnorm.fused_batchnorm)
  if freeze:
    init_weights.freeze(model, freeze)
  return model


@contextlib.contextmanager
def dtype_policy(mixed_precision: str):
  """The global Keras policy for the layers built inside; restored after.

  keras.applications models take no dtype argument, so the global policy is
  the only way in; restoring it keeps other models in the process float32.
  """
  before = keras.config.dtype_policy()
  keras.config.set_dtype_policy(
      "float32" if mixed_precision == "none" else mixed_precision)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(before)
