"""Input iterators dropped on a thread of their own, not the caller's.

TensorFlow 2.21: destroying a tf.data iterator waits for its autotuning
thread (`Model::OptimizeLoop`) to wake up, and that thread's sleep doubles
over the iterator's life, up to 60 s. In a process pinned to one core
(`engine.launch --cpu_pinning`) or on a busy machine the wake-up does not
come sooner: measured (benchmarks/RESULTS.md, "Iterator teardown") 16 s for
a plain iterator after a 25 s loop and about a minute for MirroredStrategy's
on 4 logical devices. tf.distribute builds per-device pipelines of its own
with autotuning on, so no option of the engine's datasets avoids it.

`drop_later(owner, name)` takes `owner.name` away from its owner and lets a
thread drop the last reference, so that thread waits in the destructor and
`engine.run` returns at once. A process that ends the ordinary way waits
for those threads (an atexit handler joins them): a thread still inside
TensorFlow when the interpreter finalizes is torn down mid-call, and with
MultiWorkerMirroredStrategy that aborted the process ("terminate called
after throwing an instance of ''", exit -6) after its run had finished.
The command line does not end that way: it exits with `os._exit` once
everything is written (engine/ending.py), so neither the wait nor the
teardown happens.

A run that ends by an exception leaves references behind: the traceback's
frames of the TensorFlow call that raised still hold the iterator it was
passed (`release_frames` clears them), and the evaluation hook its own
(engine/core/run_hooks.release_inputs).
"""
import atexit
import os
import sys
import threading

_THREADS = []


def drop_later(owner, name: str) -> None:
  """Sets `owner.name` to None; its value is released on another thread.

  The value must have no other reference, or the last one to go still
  waits wherever it goes.
  """
  box = [getattr(owner, name)]
  setattr(owner, name, None)
  if box[0] is None:
    return
  thread = threading.Thread(target=box.clear, name="tfengine_drop_iterator",
                            daemon=True)
  thread.start()
  _THREADS[:] = [t for t in _THREADS if t.is_alive()] + [thread]


def release_frames(error: BaseException) -> None:
  """Clears the local variables of TensorFlow's frames in the tracebacks of
  `error` and of the exceptions it chains (its cause and context).

  A `tf.function` call that raises keeps its arguments (the distributed
  iterator) in its frames, and the traceback keeps those frames as long as
  the exception lives, so the last reference to the iterator would go with
  the exception, wherever the garbage collector frees it, and wait there.
  Only frames of TensorFlow's own code are cleared, those in the traceback
  and their callers: the lines of the traceback stay, and the user's and
  the engine's frames keep their variables for a debugger.
  """
  package = os.path.dirname(sys.modules["tensorflow"].__file__) + os.sep
  pending, seen = [error], set()
  while pending:
    e = pending.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    tb = e.__traceback__
    while tb is not None:
      # TensorFlow shortens its tracebacks to the frame that raised; the
      # frames that called it (tf.function's, holding the arguments) are
      # reached through each frame's caller.
      frame = tb.tb_frame
      while frame is not None:
        if frame.f_code.co_filename.startswith(package):
          try:
            frame.clear()
          except RuntimeError:  # still running: not one the error left
            pass
        frame = frame.f_back
      tb = tb.tb_next
    pending.extend((e.__cause__, e.__context__))


@atexit.register
def _join_drops() -> None:
  """Before the interpreter finalizes: every drop has left TensorFlow."""
  for thread in _THREADS:
    thread.join()
