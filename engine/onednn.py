"""oneDNN: the engine's process default, and what a run got.

TF 2.21 turns its oneDNN rewrites on by default on CPUs with AVX-512, and
reads `TF_ENABLE_ONEDNN_OPTS` once, when TensorFlow is imported. With them
on, Conv2D on an empty batch returns a tensor of its input's shape instead
of its output's (tests/onednn_repro.py, plain TensorFlow): in tf.distribute
a replica whose share of a partial batch is empty then fails ("input depth
must be evenly divisible by filter depth: 3 vs 16") or computes on the wrong
shape. No narrower switch exists in TF 2.21: the fault is in the oneDNN
convolution kernel itself (turning grappler's remapper off leaves it), and
TF offers no per-op oneDNN switch. So `import engine` sets the variable to
0 unless the user set it, and a command line (engine/cli.py) whose run has
one replica on one worker -- no replica can get an empty batch there -- turns
it back to 1 before TensorFlow is imported (docs/design.md, "oneDNN").

Importing this module loads no TensorFlow.
"""
import os
import sys

from engine.errors import ConfigError

ENV = "TF_ENABLE_ONEDNN_OPTS"
ENGINE_DEFAULT = "0"
WHY_OFF = ("Conv2D on an empty per-replica batch returns the wrong shape "
           "with oneDNN on (tests/onednn_repro.py)")


def set_process_default() -> tuple:
  """Sets ENV to ENGINE_DEFAULT unless already set; returns what it set."""
  if ENV in os.environ:
    return ()
  os.environ[ENV] = ENGINE_DEFAULT
  return (ENV,)


_ON_FOR_ONE_REPLICA = []  # [True] once prefer_for turned oneDNN on


def one_replica(distribution) -> bool:
  """Whether a DistributionConfig has one replica on one worker, by its flags
  alone (mirrored with no --devices/--cpu_devices counts its GPUs: unknown)."""
  if distribution.strategy == "one_device":
    return True
  return distribution.strategy == "mirrored" and (
      distribution.cpu_devices == 1 or len(distribution.devices) == 1)


def prefer_for(distribution, set_by_engine: bool) -> bool:
  """Turns oneDNN on for a run with one replica, if the engine chose 0.

  Only while TensorFlow is not imported (it reads ENV once) and only where
  the engine, not the user, set ENV. Returns whether it turned it on.
  """
  if (not set_by_engine or "tensorflow" in sys.modules or
      not one_replica(distribution)):
    return False
  os.environ[ENV] = "1"
  _ON_FOR_ONE_REPLICA.append(True)
  return True


def check_replicas(replicas: int) -> None:
  """Refuses a run that prefer_for judged one replica but that has more (a
  task's make_task changed the strategy after TensorFlow was imported).

  Raises:
    ConfigError: oneDNN is on by prefer_for and `replicas` > 1.
  """
  if _ON_FOR_ONE_REPLICA and replicas > 1:
    raise ConfigError(
        f"oneDNN was turned on for one replica (the flags' strategy) but the "
        f"run has {replicas}, where it computes empty batches wrong; set "
        f"{ENV}=0 or change the strategy by flag, not in make_task.")


def state(set_by_engine: bool, tensorflow_first: bool) -> dict:
  """What this process runs with, for the log and summary.json.

  Args:
    set_by_engine: whether `import engine` set ENV (engine._SET_AT_IMPORT).
    tensorflow_first: whether TensorFlow was imported before the engine,
      so that it read ENV before the engine could set it.

  Returns:
    {"onednn": bool, TensorFlow's own answer; "onednn_source": who chose}.
  """
  from tensorflow.python.util import _pywrap_util_port as port  # pylint: disable=g-import-not-at-top
  on = bool(port.IsMklEnabled())
  value = os.environ.get(ENV)
  if tensorflow_first and set_by_engine:
    source = ("TensorFlow's default (TensorFlow was imported before the "
              "engine; import engine first)")
  elif set_by_engine and _ON_FOR_ONE_REPLICA:
    source = (f"engine ({ENV}={value}: one replica on one worker, so no "
              "replica gets an empty batch)")
  elif set_by_engine:
    source = f"engine default ({ENV}={value}: {WHY_OFF})"
  elif value is not None:
    source = f"user ({ENV}={value})"
  else:
    source = "TensorFlow's default"
  return {"onednn": on, "onednn_source": source}
