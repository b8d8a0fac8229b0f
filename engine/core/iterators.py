"""Input iterators dropped on a thread of their own, not the caller's.

TensorFlow 2.21: destroying a tf.data iterator waits for its autotuning
thread (`Model::OptimizeLoop`) to wake up, and that thread's sleep doubles
over the iterator's life, up to 60 s. In a process pinned to one core
(`engine.launch --cpu_pinning`) or on a busy machine the wake-up does not
come sooner: measured (benchmarks/RESULTS.md, "Iterator teardown") 16 s for
a plain iterator after a 25 s loop, 57-117 s for MirroredStrategy's on 4
logical devices, between the last step and `engine.run`'s return or the
process's exit. tf.distribute builds per-device pipelines of its own with
autotuning on, so no option of the engine's datasets avoids it.

`drop_later(owner, name)` takes `owner.name` away from its owner and lets a
daemon thread drop the last reference, so that thread waits in the
destructor while the run returns; a process that exits meanwhile abandons
the thread (and the wait) as it abandons any daemon thread.
"""
import threading


def drop_later(owner, name: str) -> None:
  """Sets `owner.name` to None; its value is released on a daemon thread.

  The value must have no other reference, or the last one to go still
  waits wherever it goes.
  """
  box = [getattr(owner, name)]
  setattr(owner, name, None)
  if box[0] is not None:
    threading.Thread(target=box.clear, name="tfengine_drop_iterator",
                     daemon=True).start()
