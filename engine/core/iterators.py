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
"""
import atexit
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


@atexit.register
def _join_drops() -> None:
  """Before the interpreter finalizes: every drop has left TensorFlow."""
  for thread in _THREADS:
    thread.join()
