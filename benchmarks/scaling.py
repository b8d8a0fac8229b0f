"""Multi-worker scaling on this host, three set-ups measured side by side in one run.

  (a) one worker pinned to one CPU core;
  (b) two independent one-worker processes, each pinned to its own core, at the
      same time: the no-communication ceiling for two cores;
  (c) two workers through `engine.launch --cpu_pinning`, one core each; with
      `--variant=FLAGS` (repeatable) one more (c) run per repeat with those
      engine flags, e.g. `--variant=--grad_compression=fp16`.

Same per-replica batch and model everywhere. Prints (c)/(a) as the speed-up
and (c)/(b) as communication efficiency. Throughput is the engine's own
steady-state examples/s from summary.json (the first, tracing step excluded).

Each repeat runs (a), then (b) and every (c) in an order rotated by one per
repeat, so no set-up always runs first or last. The machine's speed drifts
during a run (and other jobs on the host come and go), so the efficiency is
reported both ways: the median over repeats of each repeat's own c/b (its
(c) against the (b) measured minutes before or after it), and the ratio of
the medians.

  python -m benchmarks.scaling [--steps=31] [--repeats=1] [--image_size=64]
      [--variant=FLAGS ...] [-- engine flags for every run]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_flags(args, model_dir):
  return [f"--model={args.model}", f"--image_size={args.image_size}",
          f"--batch_size_per_replica={args.batch}",
          f"--train_steps={args.steps}", f"--steps_per_loop={args.steps_per_loop}",
          f"--log_every={args.steps}", "--optimizer=sgd",
          f"--synthetic_examples={args.batch * 2 * (args.steps + 1)}",
          f"--model_dir={model_dir}", "--noexport", "--summary_every=0",
          *args.engine_flags]


def _pinned(core):
  return lambda: os.sched_setaffinity(0, {core})


def _throughput(model_dir):
  with open(os.path.join(model_dir, "summary.json")) as f:
    return json.load(f)["examples_per_sec"]


def single(args, cores, tmp):
  """One one_device process per core, all at the same time; examples/s each."""
  procs, dirs = [], []
  for k, core in enumerate(cores):
    # A fresh directory per run: a reused one would resume from checkpoints.
    d = tempfile.mkdtemp(prefix=f"single_{len(cores)}_{k}_", dir=tmp)
    dirs.append(d)
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "engine.main", "--strategy=one_device",
         *engine_flags(args, d)], cwd=ROOT, preexec_fn=_pinned(core),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
  for p in procs:
    if p.wait(args.timeout) != 0:
      sys.exit(f"a single-worker run failed with code {p.returncode}")
  return [_throughput(d) for d in dirs]


def launched(args, tmp, flags=()):
  d = tempfile.mkdtemp(prefix="launched_", dir=tmp)
  code = subprocess.run(
      [sys.executable, "-m", "engine.launch", "--num_workers=2",
       "--cpu_pinning", "--", f"--cross_device_ops={args.cross_device_ops}",
       *engine_flags(args, d), *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL, timeout=args.timeout, check=False).returncode
  if code != 0:
    sys.exit(f"the launched 2-worker run {' '.join(flags)} failed with code "
             f"{code}")
  return _throughput(d)


def efficiency(b, c):
  """(median of the per-repeat c/b, c/b of the medians, per-repeat c/b)."""
  paired = [ci / bi for bi, ci in zip(b, c)]
  return (statistics.median(paired),
          statistics.median(c) / statistics.median(b), paired)


def rotated(items, k):
  k %= len(items)
  return items[k:] + items[:k]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="mobilenet_v2")
  parser.add_argument("--image_size", type=int, default=64)
  parser.add_argument("--batch", type=int, default=64, help="per replica")
  parser.add_argument("--steps", type=int, default=31)
  parser.add_argument("--steps_per_loop", type=int, default=10)
  parser.add_argument("--cross_device_ops", default="ring")
  parser.add_argument("--repeats", type=int, default=1,
                      help="run a, b, c this many times, interleaved; "
                      "report the median of each")
  parser.add_argument("--timeout", type=float, default=1800)
  parser.add_argument("--variant", action="append", default=[],
                      help="engine flags (space-separated) for one more (c) "
                      "run per repeat; repeatable")
  parser.add_argument("engine_flags", nargs="*",
                      help="after --: more engine flags, for all three set-ups")
  args = parser.parse_args()
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    sys.exit(f"needs 2 CPU cores, this process may use {len(cores)}")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  variants = [("c", ())] + [
      (f"c{k + 1}", tuple(v.split())) for k, v in enumerate(args.variant)]
  with tempfile.TemporaryDirectory() as tmp:
    start, load = time.time(), os.getloadavg()[0]
    runs = {"a": [], "b": [], **{name: [] for name, _ in variants}}
    per_core = []  # (b)'s two processes, to show how unevenly the cores run
    jobs = [("b", None)] + variants
    for repeat in range(args.repeats):
      runs["a"] += single(args, cores[:1], tmp)
      for name, flags in rotated(jobs, repeat):
        if name == "b":
          per_core.append(single(args, cores[:2], tmp))
          runs["b"].append(sum(per_core[-1]))
        else:
          runs[name].append(launched(args, tmp, flags))
  a, b = (statistics.median(runs[k]) for k in "ab")
  print(f"{args.model} {args.image_size}x{args.image_size}, batch {args.batch} "
        f"per replica, {args.steps} steps, cores {cores[:2]}, "
        f"{args.repeats} repeat(s), {time.time() - start:.0f} s in all, "
        f"flags {' '.join(args.engine_flags) or '(none)'}; "
        f"1-min load average at start {load:.2f} (other jobs skew (b))")
  for name in runs:
    print(f"  runs {name}: {', '.join(f'{v:.1f}' for v in runs[name])}")
  print("  (b) per core: " + ", ".join(
      " + ".join(f"{v:.1f}" for v in pair) for pair in per_core))
  print(f"(a) 1 worker, 1 core:                  {a:8.1f} examples/s")
  print(f"(b) 2 independent workers, 1 core each: {b:8.1f} examples/s")
  for name, flags in variants:
    c = statistics.median(runs[name])
    paired, of_medians, each = efficiency(runs["b"], runs[name])
    print(f"({name}) 2 workers ({args.cross_device_ops}), 1 core each, "
          f"{' '.join(flags) or 'no extra flags'}: {c:.1f} examples/s")
    print(f"    speed-up (c)/(a) = {c / a:.3f}; communication efficiency "
          f"(c)/(b) = {paired:.3f} median of repeats "
          f"({', '.join(f'{e:.3f}' for e in each)}), {of_medians:.3f} "
          f"of medians (target >= 0.95)")


if __name__ == "__main__":
  main()
