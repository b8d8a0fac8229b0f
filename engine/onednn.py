"""oneDNN: on wherever the engine computes correctly with it, and what a run got.

TF 2.21 turns its oneDNN rewrites on by default on x86 CPUs and reads
`TF_ENABLE_ONEDNN_OPTS` once, when TensorFlow is imported. With them on,
Conv2D on an empty batch returns a tensor of its input's shape instead of
its output's (tests/onednn_repro.py, plain TensorFlow). In tf.distribute a
replica's share of a partial batch can be empty. The engine never runs a
model on an empty batch: an empty replica skips the forward and backward
pass in training and evaluation (engine/core/step.py, evaluate.py), and with
--sync_batchnorm, where it must join the BatchNorm all-reduces, runs on one
padded row that the fused BatchNorm leaves out of the moments. So oneDNN
stays on (TensorFlow's default) for every run but one combination: Keras's
own synchronized BatchNorm (--sync_batchnorm --nofused_batchnorm) on
several CPU replicas, which counts rows itself and so must see the empty
batch. For it the command line sets the variable to 0 before TensorFlow is
imported; `engine.run`, called after TensorFlow is imported, refuses it
with one line instead (docs/design/onednn.md).

Importing this module loads no TensorFlow.
"""
import os
import sys

from engine.errors import ConfigError

ENV = "TF_ENABLE_ONEDNN_OPTS"
WHY_OFF = ("Keras's synchronized BatchNorm (--sync_batchnorm "
           "--nofused_batchnorm) on several replicas must run Conv2D on empty "
           "batches, which oneDNN computes wrong (tests/onednn_repro.py)")

_TURNED_OFF = []  # [True] once turn_off_for turned oneDNN off


def one_replica(distribution) -> bool:
  """Whether a DistributionConfig has one replica on one worker, by its flags
  alone (mirrored with no --devices/--cpu_devices counts its GPUs: unknown)."""
  if distribution.strategy == "one_device":
    return True
  return distribution.strategy == "mirrored" and (
      distribution.cpu_devices == 1 or len(distribution.devices) == 1)


def faulty(config) -> bool:
  """Whether a Config's run could run Conv2D on an empty batch (WHY_OFF),
  by its flags alone."""
  return (config.batchnorm.sync_batchnorm and
          not config.batchnorm.fused_batchnorm and
          not one_replica(config.distribution))


def turn_off_for(config) -> bool:
  """Sets ENV to 0 for a run that `faulty` names, before TensorFlow reads it.

  Only while TensorFlow is not imported and only where the user did not set
  ENV. Returns whether it turned oneDNN off.
  """
  if ENV in os.environ or "tensorflow" in sys.modules or not faulty(config):
    return False
  os.environ[ENV] = "0"
  _TURNED_OFF.append(True)
  return True


def active() -> bool:
  """TensorFlow's own answer: are its oneDNN rewrites on in this process?"""
  from tensorflow.python.util import _pywrap_util_port as port  # pylint: disable=g-import-not-at-top
  return bool(port.IsMklEnabled())


def check(config, replica_devices) -> None:
  """Refuses the one combination oneDNN computes wrong, once it is on.

  Args:
    config: the run's Config.
    replica_devices: this worker's replica devices (strings); the fault is
      in the CPU kernel, so GPU replicas are fine.

  Raises:
    ConfigError: oneDNN is on and the run is `faulty` on CPU replicas.
  """
  cpu = any("CPU" in d.upper() for d in replica_devices)
  if cpu and faulty(config) and active():
    raise ConfigError(
        f"--sync_batchnorm with --nofused_batchnorm on several CPU replicas "
        f"needs oneDNN off ({WHY_OFF}); drop --nofused_batchnorm, or set "
        f"{ENV}=0 before TensorFlow is imported (the command line does).")


def state(tensorflow_first: bool) -> dict:
  """What this process runs with, for the log and summary.json.

  Args:
    tensorflow_first: whether TensorFlow was imported before the engine.

  Returns:
    {"onednn": bool, TensorFlow's own answer; "onednn_source": who chose}.
  """
  value = os.environ.get(ENV)
  if _TURNED_OFF:
    source = f"engine ({ENV}={value}: {WHY_OFF})"
  elif value is not None:
    source = f"user ({ENV}={value})"
  elif tensorflow_first:
    source = "TensorFlow's default (TensorFlow was imported before the engine)"
  else:
    source = "TensorFlow's default"
  return {"onednn": active(), "onednn_source": source}
