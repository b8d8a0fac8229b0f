"""The gradient all-reduce with an instance key fixed when the step is traced.

TensorFlow gives every collective op in a tf.function a new instance key at
every call of the function (`CollectiveReplicaLauncher.
_prefer_unique_instance_key`), so that workers which trace at different
moments still agree, and it keeps a record of every key it has seen for as
long as the process lives: a run's memory grows with its host calls
(benchmarks/RESULTS.md, "Soak"). A key fixed at tracing is one record for
the whole run, but that record keeps the shapes of the op's first call, so a
fixed key suits only an op whose shapes never change. The gradient
all-reduce is such an op: the same dense gradients (an embedding's too), the
same packs and the example count, in every step of every call. The
engine's other collectives keep TensorFlow's default: the end-of-call reduce
changes length with the host call, and a user's model may hold an
all-reduce whose shapes change.

Workers agree on a fixed key because they take it from the same counter at
the same moment: every worker traces the same step at the same point of the
run (the engine's code path is one for 1..N workers; the host call's length
is the chief's), after the same collectives.
"""
import contextlib
import threading

from tensorflow.python.distribute import cross_device_utils

_LAUNCHER = cross_device_utils.CollectiveReplicaLauncher
_LOCK = threading.Lock()
_depth = 0
_outside = True  # the setting before the first entry, given back at the last exit


@contextlib.contextmanager
def fixed():
  """Collectives created inside get an instance key fixed at tracing.

  MirroredStrategy traces each replica in a thread of its own and the
  setting is TensorFlow's class attribute, so entries are counted: the
  setting found at the first entry comes back when the last replica leaves.
  """
  global _depth, _outside
  with _LOCK:
    if not _depth:
      _outside = _LAUNCHER._prefer_unique_instance_key  # pylint: disable=protected-access
    _depth += 1
    _LAUNCHER._prefer_unique_instance_key = False  # pylint: disable=protected-access
  try:
    yield
  finally:
    with _LOCK:
      _depth -= 1
      if not _depth:
        _LAUNCHER._prefer_unique_instance_key = _outside  # pylint: disable=protected-access
