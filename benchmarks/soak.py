"""Soak test: does a long run keep its threads and memory flat?

Trains the default job shape (small_cnn, 32x32 synthetic images, 32 examples
per replica) for a wall time, first on `mirrored` with 2 logical CPUs, then on
2 workers through `engine.launch`, with periodic checkpoints, TensorBoard
summaries and evaluations on, so each of them would show a leak. Every
`--sample_seconds` it prints, per training process, its threads, resident
memory (RSS, and its anonymous part), open files, examples/s since the last
sample and the host call's length (`--steps_per_loop=auto`, the default,
logs each change). RSS is read every READ_SECONDS: a sample's RSS and
anonymous memory are the medians of the readings since the sample before
(the RSS read at the sample's moment is printed beside them). At the end
it sends SIGTERM (the run saves a checkpoint and exits 75) and judges each
process:

  threads  stay within +10 of the count at the second sample (minute 2);
  RSS      grows less than 2% (--rss_growth) from the second sample to the
           end.

Why medians: the engine gives free heap pages back every 10 s
(engine/host/memory.py) and the heaps touch them again within seconds, so
RSS swings within a minute: a reading at the sample's moment differed
from its minute's median by up to 14 MiB on 2 workers and 29 MiB on
mirrored (2-4%; benchmarks/RESULTS.md, "Soak"). One reading per minute
measured where in that swing it fell as much as how the memory grew; the
median of a minute's readings is its level.

Exit status 0 when every process passes.

  python -m benchmarks.soak [--minutes=10] [--sample_seconds=60]
      [--setups=mirrored,multi_worker] [--rss_growth=0.02]
      [-- more engine flags]
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from engine.host import resources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_SLACK = 10
RSS_GROWTH = 0.02
# "... hooks.py:46] step 1200/100000000 | loss ..." (with "[worker 0] " first
# under the launcher).
_STEP = re.compile(r"\] step (\d+)/\d+ \|")
_PID = re.compile(r"^launcher: worker (\d+) pid (\d+):")
_PACE = re.compile(r"host calls of (\d+) steps from step")
READ_SECONDS = 5.0
BATCH_PER_REPLICA = 32
GLOBAL_BATCH = 64

JOB = ["--model=small_cnn", "--image_size=32",
       f"--batch_size_per_replica={BATCH_PER_REPLICA}",
       "--train_steps=1000000000", "--noprogress", "--log_every=100",
       "--checkpoint_every=2000", "--summary_every=100",
       "--eval_split=train[:512]", "--eval_every=2000", "--noexport"]


def judge(samples, thread_slack: int = THREAD_SLACK,
          rss_growth: float = RSS_GROWTH):
  """(passed, reason) for one process's samples [(threads, rss_mib[,
  anon_mib[, rss_mib read at the sample's moment]]), ...].

  Both are compared with the second sample: the first minute includes
  tracing and the allocator's warm-up, and on a slow host it can end before
  the first evaluation starts the evaluation iterator's threads. The anonymous
  part of RSS (the heap: what a leak grows), when sampled, is reported
  beside it: the rest is the shared libraries' pages mapped so far, which
  also grows when other processes read more of those libraries into the
  page cache (the kernel maps cached neighbours of a page on each fault).
  """
  if len(samples) < 3:
    return False, f"only {len(samples)} samples; run longer"
  threads0, rss1 = samples[1][0], samples[1][1]
  threads_max = max(s[0] for s in samples[1:])
  rss_end = samples[-1][1]
  growth = rss_end / rss1 - 1.0
  ok_threads = threads_max <= threads0 + thread_slack
  ok_rss = growth < rss_growth
  reason = (f"threads {threads0} -> max {threads_max} "
            f"({'ok' if ok_threads else 'FAIL'}: limit +{thread_slack}); "
            f"RSS {rss1:.0f} -> {rss_end:.0f} MiB ({growth:+.1%}, "
            f"{'ok' if ok_rss else 'FAIL'}: limit +{rss_growth:.0%})")
  if len(samples[1]) > 2:
    anon1, anon_end = samples[1][2], samples[-1][2]
    reason += (f"; anonymous {anon1:.0f} -> {anon_end:.0f} MiB "
               f"({anon_end / anon1 - 1.0:+.1%})")
  if len(samples[1]) > 3:
    now1, now_end = samples[1][3], samples[-1][3]
    reason += (f"; RSS read at the two samples' moments {now1:.0f} -> "
               f"{now_end:.0f} MiB ({now_end / now1 - 1.0:+.1%}, not judged)")
  return ok_threads and ok_rss, reason


def anonymous_mib(pid: int) -> float:
  """The anonymous part of a process's RSS (RssAnon), in MiB."""
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) / 1024
  raise RuntimeError(f"no RssAnon for pid {pid}")


class _Output:
  """Reads a child's output lines: the last step and the workers' pids."""

  def __init__(self, proc, log):
    self.step = 0
    self.pids = {}
    self.steps_per_call = None  # the last length --steps_per_loop=auto chose
    self._proc, self._log = proc, log
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self):
    for line in self._proc.stdout:
      self._log.write(line)
      m = _STEP.search(line)
      if m:
        self.step = int(m[1])
      m = _PID.match(line)
      if m:
        self.pids[int(m[1])] = int(m[2])
      m = _PACE.search(line)
      if m:
        self.steps_per_call = int(m[1])

  def join(self):
    self._thread.join(30)


def soak(setup: str, minutes: float, sample_seconds: float, extra, log_dir,
         rss_growth: float = RSS_GROWTH):
  """Runs one setup; returns [(name, passed, reason)]."""
  model_dir = tempfile.mkdtemp(prefix=f"soak_{setup}_")
  flags = JOB + [f"--model_dir={model_dir}", *extra]
  if setup == "mirrored":
    cmd = [sys.executable, "-m", "engine.main", "--strategy=mirrored",
           "--cpu_devices=2", *flags]
  else:
    cmd = [sys.executable, "-m", "engine.launch", "--num_workers=2", "--",
           *flags]
  log_path = os.path.join(log_dir, f"{setup}.log")
  print(f"\n== {setup}: {' '.join(cmd)}\n   log: {log_path}", flush=True)
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = _Output(proc, log)
    try:
      names = (["mirrored"] if setup == "mirrored" else
               ["worker 0", "worker 1"])
      samples = {n: [] for n in names}
      start = time.monotonic()
      last_step, last_time = 0, start
      print(f"{'min':>5} {'process':>9} {'threads':>8} {'RSS MiB':>9} "
            f"{'anon MiB':>9} {'RSS now':>8} {'files':>6} {'examples/s':>11} "
            f"{'steps/call':>10}", flush=True)
      for k in range(1, int(minutes * 60 / sample_seconds) + 1):
        readings = {n: [] for n in names}
        while True:  # RSS every READ_SECONDS until this sample's time
          if proc.poll() is not None:
            raise RuntimeError(f"{setup} ended early with "
                               f"{proc.returncode}; see {log_path}")
          for name in names:
            pid = (proc.pid if setup == "mirrored" else
                   out.pids.get(int(name.split()[1])))
            use = resources.usage(str(pid)) if pid else None
            if use is None and not (k == 1 and pid is None):
              raise RuntimeError(f"cannot read {name}'s /proc entry")
            if use is not None:
              readings[name].append((use, anonymous_mib(pid)))
          left = start + k * sample_seconds - time.monotonic()
          if left <= 0:
            break
          time.sleep(min(READ_SECONDS, left))
        now, step = time.monotonic(), out.step
        rate = (step - last_step) * GLOBAL_BATCH / (now - last_time)
        last_step, last_time = step, now
        for name in names:
          if not readings[name]:
            raise RuntimeError(f"no pid for {name}; see {log_path}")
          use = readings[name][-1][0]
          rss = statistics.median(u.rss_mib for u, _ in readings[name])
          anon = statistics.median(a for _, a in readings[name])
          samples[name].append((use.threads, rss, anon, use.rss_mib))
          print(f"{k * sample_seconds / 60:5.1f} {name:>9} {use.threads:8d} "
                f"{rss:9.1f} {anon:9.1f} {use.rss_mib:8.1f} "
                f"{use.open_files:6d} {rate:11.1f} "
                f"{out.steps_per_call or '-':>10}", flush=True)
    finally:
      if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # saves a checkpoint, exits 75
      try:
        code = proc.wait(120)
      except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait(10)
      out.join()
  print(f"   {setup} stopped with exit code {code} at step {out.step}",
        flush=True)
  results = []
  for name in names:
    passed, reason = judge(samples[name], rss_growth=rss_growth)
    results.append((f"{setup} {name}" if setup != "mirrored" else name,
                    passed and code == 75, reason +
                    ("" if code == 75 else f"; exit code {code}, want 75")))
  return results


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ours, extra = ((argv[:argv.index("--")], argv[argv.index("--") + 1:])
                 if "--" in argv else (argv, []))
  parser = argparse.ArgumentParser(prog="python -m benchmarks.soak")
  parser.add_argument("--minutes", type=float, default=10.0)
  parser.add_argument("--sample_seconds", type=float, default=60.0)
  parser.add_argument("--setups", default="mirrored,multi_worker")
  parser.add_argument("--rss_growth", type=float, default=RSS_GROWTH,
                      help="the largest RSS growth from minute 2 that passes")
  args = parser.parse_args(ours)
  setups = args.setups.split(",")
  for s in setups:
    if s not in ("mirrored", "multi_worker"):
      parser.error(f"--setups: unknown setup {s!r}; use mirrored, "
                   "multi_worker.")
  log_dir = tempfile.mkdtemp(prefix="soak_logs_")
  results = []
  for setup in setups:
    results += soak(setup, args.minutes, args.sample_seconds, extra, log_dir,
                    args.rss_growth)
  print()
  for name, passed, reason in results:
    print(f"{'PASS' if passed else 'FAIL'} {name}: {reason}")
  return 0 if all(p for _, p, _ in results) else 1


if __name__ == "__main__":
  sys.exit(main())
