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

Each repeat runs (a), then every (c) variant right after a (b), the
variants in an order rotated by one per repeat, and one more (b) ends the
run: every (c) has a (b) just before and just after it. The machine's speed
drifts during a run (and other jobs on the host come and go), so each (c)
is compared with the mean of those two (b) runs, and the efficiency is the
median of these ratios (the ratio of the medians is printed beside it).

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


def schedule(variants, repeats):
  """The run order: per repeat (a), then each (c) variant after a (b), in an
  order rotated by one per repeat; one more (b) at the very end.

  So every (c) run has a (b) run right before it and one right after it.
  """
  order = []
  for repeat in range(repeats):
    order.append("a")
    for name in rotated(list(variants), repeat):
      order += ["b", name]
  return order + ["b"]


def sandwiched(order, rates):
  """{variant: [c / mean of the (b) just before and just after it]}.

  The machine's speed drifts by several per cent within minutes; pairing
  each (c) with the ceiling measured on both sides of it cancels a drift
  that is steady over those minutes.
  """
  out = {}
  for k, name in enumerate(order):
    if name in ("a", "b"):
      continue
    before = next(rates[j] for j in range(k - 1, -1, -1) if order[j] == "b")
    after = next(rates[j] for j in range(k + 1, len(order))
                 if order[j] == "b")
    out.setdefault(name, []).append(rates[k] / ((before + after) / 2))
  return out


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
  variants = {"c": ()}
  variants.update((f"c{k + 1}", tuple(v.split()))
                  for k, v in enumerate(args.variant))
  order = schedule(variants, args.repeats)
  rates, per_core = [], []  # per_core: (b)'s two processes, to show drift
  with tempfile.TemporaryDirectory() as tmp:
    start, load = time.time(), os.getloadavg()[0]
    for name in order:
      if name == "a":
        rates.append(single(args, cores[:1], tmp)[0])
      elif name == "b":
        per_core.append(single(args, cores[:2], tmp))
        rates.append(sum(per_core[-1]))
      else:
        rates.append(launched(args, tmp, variants[name]))
  runs = {name: [r for n, r in zip(order, rates) if n == name]
          for name in ("a", "b", *variants)}
  a, b = (statistics.median(runs[k]) for k in "ab")
  print(f"{args.model} {args.image_size}x{args.image_size}, batch {args.batch} "
        f"per replica, {args.steps} steps, cores {cores[:2]}, "
        f"{args.repeats} repeat(s), {time.time() - start:.0f} s in all, "
        f"flags {' '.join(args.engine_flags) or '(none)'}; "
        f"1-min load average at start {load:.2f} (other jobs skew (b))")
  print("  order: " + " ".join(order))
  for name in runs:
    print(f"  runs {name}: {', '.join(f'{v:.1f}' for v in runs[name])}")
  print("  (b) per core: " + ", ".join(
      " + ".join(f"{v:.1f}" for v in pair) for pair in per_core))
  print(f"(a) 1 worker, 1 core:                  {a:8.1f} examples/s")
  print(f"(b) 2 independent workers, 1 core each: {b:8.1f} examples/s")
  paired = sandwiched(order, rates)
  for name, flags in variants.items():
    c = statistics.median(runs[name])
    print(f"({name}) 2 workers ({args.cross_device_ops}), 1 core each, "
          f"{' '.join(flags) or 'no extra flags'}: {c:.1f} examples/s")
    print(f"    speed-up (c)/(a) = {c / a:.3f}; communication efficiency "
          f"(c)/(b) = {statistics.median(paired[name]):.3f} median of each "
          f"(c) over the mean of the (b) before and after it "
          f"({', '.join(f'{e:.3f}' for e in paired[name])}), "
          f"{c / b:.3f} of medians (target >= 0.95)")


if __name__ == "__main__":
  main()
