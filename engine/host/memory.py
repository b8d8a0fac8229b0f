"""Host memory: glibc malloc settings for TensorFlow's CPU tensors.

TensorFlow allocates CPU tensors with `posix_memalign`, i.e. glibc malloc.
TF 2.21, the first time a process builds a `GeneratorDataset` kernel, calls
`mallopt(M_MMAP_THRESHOLD, 128 KiB)` (its log line names M_TRIM_THRESHOLD,
but the parameter it sets is -3, M_MMAP_THRESHOLD; a guard against a Python
3.11 `from_generator` memory growth, tensorflow/tensorflow#65675). Every
distributed data set builds such a kernel (tf.distribute's multi-device
iterator), so in every training run a tensor over 128 KiB that the heap
cannot serve is then a fresh `mmap`: its pages fault in and are zeroed by
the kernel on first touch, and are unmapped again when the tensor is freed,
so the heap never keeps such blocks for the next step. Measured on MobileNetV2 64x64,
batch 64, one pinned core: about 1,200 mmap/munmap pairs and 400,000 page
faults per step, a third of the step spent in the kernel
(docs/design/host.md).

`tune_malloc` puts back what glibc itself does without that call: large
blocks come from the heap and are reused. glibc's own dynamic threshold
grows to at most 32 MiB on 64-bit hosts, with a trim threshold of twice the
mmap threshold; these are the values set here. A fixed threshold cannot be
returned to glibc's dynamic mode, so they are set explicitly.

TF applies its value once per process; `tune_malloc` first makes TF apply
it (by iterating an empty generator data set), so the engine's values come
after it and stay. Only glibc has these knobs: elsewhere it does nothing.

The price of keeping blocks: freed memory stays in the process's heaps
(TensorFlow's threads use many malloc arenas, each may keep up to the trim
threshold), and fragmentation made the resident size creep up by about
15 MiB a minute in a 10-minute soak (benchmarks/soak.py). `TrimHook` hands
free heap pages back to the kernel with `malloc_trim(0)` every
`TRIM_SECONDS` between host calls: about 4 ms each time. Pages that still
hold a live block cannot be handed back, and each arena fragments on its
own: glibc's default allows 8 arenas per core, and a training process has
40-150 threads. With that default the 30-minute mirrored soak grew ~15 MiB
in its first 10 minutes (+4.0%); the same job without evaluations,
checkpoints or summaries grew 0.85 MiB a minute from minute 1 to 3 with the
tuning, 0.15 a minute from minute 2 without it, and 0.3-0.5 with the tuning
and MALLOC_ARENA_MAX=2. So the tuning also caps the arenas at one per core
the process may use (at least 2): no more threads than that run at once,
so they seldom wait for an arena's lock. glibc gives each new thread an
arena of its own until the cap, and TensorFlow starts its thread pools with
its runtime, so `cap_arenas` must run before TensorFlow's first op
(`engine.configure_host` calls it; `tune_malloc` calls it again for runs
that did not, where it holds only for threads started later).
"""
import os
import ctypes
import time
from typing import Optional

from absl import logging
import tensorflow as tf

from engine.hooks import Hook

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (4 MiB * sizeof(long)): the
# largest value its dynamic threshold reaches and mallopt accepts.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # glibc pairs the two this way
TRIM_SECONDS = 10.0


def glibc() -> Optional[ctypes.CDLL]:
  """This process's C library if it is glibc, else None (musl, macOS)."""
  try:
    libc = ctypes.CDLL(None)
  except OSError:
    return None
  if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc,
                                                               "mallopt"):
    return None
  return libc


def arena_limit() -> int:
  """One malloc arena per core this process may use, at least 2."""
  return max(2, len(os.sched_getaffinity(0)))


def cap_arenas() -> bool:
  """Caps glibc's malloc arenas at `arena_limit()`; True if glibc took it.
  The arenas made before the call stay."""
  libc = glibc()
  return libc is not None and libc.mallopt(M_ARENA_MAX, arena_limit()) == 1


def tune_malloc() -> bool:
  """Sets the mmap and trim thresholds and the arena cap above; True if
  glibc took them."""
  libc = glibc()
  if libc is None:
    logging.info("Host memory: the C library is not glibc; malloc left as "
                 "it is.")
    return False
  capped = cap_arenas()  # before the data set below starts TF's threads
  # TF's one-time mallopt runs when the first GeneratorDataset kernel is
  # built, which is when a generator data set is first iterated; iterating
  # an empty one here makes it run now, before ours.
  for _ in tf.data.Dataset.from_generator(
      lambda: iter(()), output_signature=tf.TensorSpec([], tf.int32)):
    pass
  ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and capped)
  logging.info(
      "Host memory: glibc mmap threshold %d MiB, trim threshold %d MiB, at "
      "most %d malloc arenas (TensorFlow's threshold is 128 KiB; "
      "--nomalloc_tuning keeps it and glibc's 8 arenas per core)%s.",
      MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, arena_limit(),
      "" if ok else ": REFUSED")
  return ok


class TrimHook(Hook):
  """Returns free heap pages to the kernel every TRIM_SECONDS (see above)."""

  def __init__(self, enabled: bool):
    self._libc = glibc() if enabled else None
    self._last = time.monotonic()

  def after_loop(self, step, rows, seconds):
    now = time.monotonic()
    if self._libc is not None and now - self._last >= TRIM_SECONDS:
      self._libc.malloc_trim(0)
      self._last = now
