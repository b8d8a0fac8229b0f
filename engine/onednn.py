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
0 unless the user set it (docs/design.md, "oneDNN").

Importing this module loads no TensorFlow.
"""
import os

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
  elif set_by_engine:
    source = f"engine default ({ENV}={value}: {WHY_OFF})"
  elif value is not None:
    source = f"user ({ENV}={value})"
  else:
    source = "TensorFlow's default"
  return {"onednn": on, "onednn_source": source}
