"""Host resources: threads, memory and open files, read between host calls.

A process that runs out of threads, memory or file descriptors does not get a
Python exception it could save a checkpoint from: TensorFlow's C++ runtime
aborts (`std::system_error: Resource temporarily unavailable`), or the kernel
kills it. So `ResourceHook` reads the process's use after host calls (at most
once per `_SAMPLE_SECONDS`, from /proc: tens of microseconds) and compares it
with the limits that apply to it. When one reaches `_HEADROOM` of its limit,
the hook asks the preemption agreement (engine/core/preemption.py) to stop: every
worker saves a checkpoint at the same step and the run ends with one line and
exit code 5 (engine/errors.py's `ResourceStop`), resumable like a preemption.

summary.json gets the first, largest and last reading of each (keys
`host_threads`, `host_rss_mib`, `host_open_files`), so a leak shows in any
run, and the soak benchmark (benchmarks/soak.py) checks that they stay flat.
Off Linux there is no /proc: nothing is read and the keys are null.
"""
import dataclasses
import os
import resource
import time
from typing import Callable, Dict, Optional

from absl import logging

from engine.hooks import Hook

_HEADROOM = 0.9
_SAMPLE_SECONDS = 1.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Summary key of each resource.
KEYS = {"threads": "host_threads", "rss_mib": "host_rss_mib",
        "open_files": "host_open_files"}


@dataclasses.dataclass(frozen=True)
class Usage:
  threads: int
  rss_mib: float
  open_files: int


def usage(pid: str = "self") -> Optional[Usage]:
  """This process's (or `pid`'s) threads, resident memory and descriptors."""
  try:
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/statm") as f:
      rss_pages = int(f.read().split()[1])
    files = len(os.listdir(f"/proc/{pid}/fd"))
  except OSError:
    return None
  return Usage(threads, rss_pages * _PAGE / 2**20, files)


def _read_int(path: str) -> Optional[int]:
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_dir() -> Optional[str]:
  """This process's cgroup v2 directory, if the unified hierarchy is mounted."""
  try:
    with open("/proc/self/cgroup") as f:
      for line in f:
        if line.startswith("0::"):
          return "/sys/fs/cgroup" + line.strip()[3:]
  except OSError:
    pass
  return None


def _soft(limit) -> Optional[int]:
  soft = resource.getrlimit(limit)[0]
  return None if soft == resource.RLIM_INFINITY else soft


def limits() -> Dict[str, float]:
  """The smallest limit that applies to each resource, where one is known.

  Threads: kernel.threads-max, the cgroup's pids.max, and half of
  vm.max_map_count (every thread's stack and guard page are two mappings).
  RLIMIT_NPROC counts every process of the user, not ours, so it is left out.
  Memory: the cgroup's memory.max and the machine's memory. Open files:
  RLIMIT_NOFILE's soft limit.
  """
  cgroup = _cgroup_dir()
  threads = [_read_int("/proc/sys/kernel/threads-max"),
             _read_int(f"{cgroup}/pids.max") if cgroup else None]
  maps = _read_int("/proc/sys/vm/max_map_count")
  threads.append(maps // 2 if maps else None)
  memory = [_read_int(f"{cgroup}/memory.max") if cgroup else None]
  try:
    memory.append(os.sysconf("SC_PHYS_PAGES") * _PAGE)
  except (ValueError, OSError, AttributeError):
    pass
  found = {"threads": [t for t in threads if t],
           "rss_mib": [m / 2**20 for m in memory if m],
           "open_files": [f for f in [_soft(resource.RLIMIT_NOFILE)] if f]}
  return {k: min(v) for k, v in found.items() if v}


class ResourceHook(Hook):
  """Records host resource use; asks for a coordinated stop near a limit.

  Args:
    request_stop: called once with a one-line reason when a resource reaches
      `_HEADROOM` of its limit (the preemption agreement's `request_stop`).
    limits_: the limits to compare with (default: `limits()`).
    sample: returns the current `Usage` (default: `usage()`).
  """

  def __init__(self, request_stop: Callable[[str], None],
               limits_: Optional[Dict[str, float]] = None,
               sample: Callable[[], Optional[Usage]] = usage):
    self._request_stop = request_stop
    self._limits = limits() if limits_ is None else limits_
    self._sample = sample
    self._last_read = -float("inf")
    self._first: Optional[Usage] = None
    self._max: Dict[str, float] = {}
    self._last: Optional[Usage] = None
    self._requested = False

  def after_loop(self, step, rows, seconds):
    now = time.monotonic()
    if now - self._last_read < _SAMPLE_SECONDS and self._first is not None:
      return
    self._last_read = now
    self._read(step)

  def _read(self, step):
    current = self._sample()
    if current is None:
      return
    self._first = self._first or current
    self._last = current
    for name in KEYS:
      value = getattr(current, name)
      self._max[name] = max(self._max.get(name, value), value)
      limit = self._limits.get(name)
      if limit and value >= _HEADROOM * limit and not self._requested:
        self._requested = True
        line = (f"host resource nearly exhausted at step {step}: "
                f"{name.replace('_', ' ')} {value:.0f} of a limit of "
                f"{limit:.0f} (stopping at {_HEADROOM:.0%})")
        logging.error("%s; every worker saves a checkpoint.", line)
        self._request_stop(line)

  def end(self, summary):
    if self._first is not None:
      self._read(summary["global_step"])
    for name, key in KEYS.items():
      summary[key] = None if self._first is None else {
          "first_call": _round(getattr(self._first, name)),
          "max": _round(self._max[name]),
          "last_call": _round(getattr(self._last, name))}


def _round(value):
  return round(value, 1) if isinstance(value, float) else value
