"""How a command-line run's process ends: at once, once everything is written.

TensorFlow 2.21 keeps a finished process alive. Destroying a tf.data
iterator waits for tf.data's autotuning thread, up to a minute on a pinned
or busy host (engine/core/iterators.py hands iterators to threads of their
own for that reason), and the interpreter's shutdown must not tear down a
thread that is still inside TensorFlow: with MultiWorkerMirroredStrategy
that aborted finished processes ("terminate called after throwing an
instance of ''", exit -6).

The command line needs none of that shutdown. When `engine.cli` knows its
exit code, every output is written: summary.json, the checkpoint, the
weights and the export are written synchronously, the run's hooks closed
their TensorBoard writers and profiler, and (multi_worker) every worker has
passed `engine.distribute.cluster.meet_peers`. `end(code)` then flushes
Python's and absl's logging and the standard streams, runs the engine's own
clean-ups (`at_exit`: a non-chief's temporary output directory) and calls
`os._exit(code)`: no interpreter finalization, no wait for TensorFlow's
threads, no teardown of them.

A process of the user's own (`engine.run` from Python) ends the ordinary
way: the clean-ups then run from `atexit`, and the iterator threads are
joined there (engine/core/iterators.py).
"""
import atexit
import logging as std_logging
import os
import sys
from typing import Callable

from absl import logging

_CLEANUPS = []


def at_exit(fn: Callable, *args, **kwargs) -> None:
  """Runs `fn(*args, **kwargs)` when the process ends, by `end` or atexit."""
  _CLEANUPS.append((fn, args, kwargs))


@atexit.register
def _clean_up() -> None:
  while _CLEANUPS:
    fn, args, kwargs = _CLEANUPS.pop()
    fn(*args, **kwargs)


def end(code: int) -> None:
  """Flushes every output, runs the clean-ups and exits with `code` now."""
  logging.flush()
  std_logging.shutdown()  # flushes and closes every logging handler
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a closed pipe: nothing more can be said
      pass
  _clean_up()
  os._exit(code)  # pylint: disable=protected-access
