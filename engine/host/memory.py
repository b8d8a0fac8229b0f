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
`TRIM_SECONDS` between host calls: about 4 ms each time, and the resident
size stays flat.

`use_cpu_allocator` chooses where TensorFlow's CPU tensors come from
(--cpu_allocator): `bfc`, TensorFlow's best-fit-with-coalescing pool (what
it uses for GPU memory), or `tensorflow`, TensorFlow's own choice (glibc's
malloc where oneDNN is off; with oneDNN on, its oneDNN allocator, itself a
BFC pool for large blocks). With malloc, the large per-step scratch
tensors (TensorFlow's Conv2D backprop kernels take 10-19 MB each, five per
step of the soak's small CNN) come from whichever malloc arena the thread
running the kernel uses; each arena keeps the largest such blocks it has
held, and more arenas come to hold them as the run goes on: RSS rose 3-5%
in 30 minutes on a host without oneDNN. BFC serves every tensor from one
pool that reuses and coalesces its free chunks, so the tensors' share of
RSS stops at the pool's high-water mark (benchmarks/RESULTS.md, "Soak").
"""
import ctypes
import os
import time
from typing import Optional

from absl import logging
import tensorflow as tf

from engine.hooks import Hook

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (4 MiB * sizeof(long)): the
# largest value its dynamic threshold reaches and mallopt accepts.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # glibc pairs the two this way
TRIM_SECONDS = 10.0
# Read by TensorFlow once per process, when it makes its CPU devices.
BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
BFC_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"  # TF's default: 64 GiB


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


_TF_THRESHOLD_SET = False


def _let_tensorflow_set_its_threshold():
  """TF's one-time mallopt runs when the first GeneratorDataset kernel is
  built, which is when a generator data set is first iterated; iterating an
  empty one makes it run now, before ours. Once per process (a fork
  inherits both TF's guard and this one): building and iterating the data
  set took ~50 ms of each run."""
  global _TF_THRESHOLD_SET
  if not _TF_THRESHOLD_SET:
    # Built without AutoGraph (engine/core/inputs.py's `_as_written`).
    for _ in tf.autograph.experimental.do_not_convert(
        tf.data.Dataset.from_generator)(
            lambda: iter(()), output_signature=tf.TensorSpec([], tf.int32)):
      pass
    _TF_THRESHOLD_SET = True


def tune_malloc() -> bool:
  """Sets the mmap and trim thresholds above; True if glibc took them."""
  libc = glibc()
  if libc is None:
    logging.info("Host memory: the C library is not glibc; malloc left as "
                 "it is.")
    return False
  _let_tensorflow_set_its_threshold()
  ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
  logging.info(
      "Host memory: glibc mmap threshold %d MiB, trim threshold %d MiB "
      "(TensorFlow's is 128 KiB; --nomalloc_tuning keeps it)%s.",
      MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, "" if ok else ": REFUSED")
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


_BFC_TAKEN = []  # [True] once use_cpu_allocator chose BFC before TF's devices


def use_cpu_allocator(allocator: str) -> None:
  """Makes TensorFlow's CPU devices allocate from `allocator` (see above).

  TensorFlow reads the choice once, when it makes its devices (its eager
  context, before the first op); once they are made this changes nothing.
  `tensorflow` leaves the environment as it is. BFC's limit, unless set, is
  the memory this process may use (engine/host/resources.py), not
  TensorFlow's fixed 64 GiB. The variables stay in os.environ: processes
  this one starts inherit them.
  """
  if allocator != "bfc" or _devices_made():
    return
  os.environ[BFC_ENV] = "true"
  if BFC_LIMIT_ENV not in os.environ:
    from engine.host import resources  # pylint: disable=g-import-not-at-top
    mib = resources.limits().get("rss_mib")
    if mib:
      os.environ[BFC_LIMIT_ENV] = str(int(mib))
  _BFC_TAKEN[:] = [True]


def cpu_allocator() -> str:
  """The choice that took effect: "bfc" if `use_cpu_allocator` chose it
  before TensorFlow made its devices, else "tensorflow" (its own)."""
  return "bfc" if _BFC_TAKEN else "tensorflow"


def _devices_made() -> bool:
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  return bool(getattr(context.context(), "_initialized", False))
