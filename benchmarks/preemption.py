"""What the preemption agreement costs: 2 workers with the stop-flag exchange on and off.

Runs `engine.launch --num_workers=2` with `--preemption_sync` and
`--nopreemption_sync`, interleaved, for each `--steps_per_loop` (1: one
exchange per step, the worst case; 10: the default). The time per step comes
from worker 0's absl timestamps on its progress lines after the warm-up, so
start-up and tracing are left out and the hooks' work between host calls,
where the exchange happens, is counted (summary.json's examples/s counts only
the compiled loop). Prints per-step times, the ratio on/off and the extra
time per host call (= per exchange).

  python -m benchmarks.preemption [--steps=301] [--repeats=2] [--model=small_cnn]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# "[worker 0] I1202 17:29:00.368455 140411 hooks.py:46] step 10/301 | ..."
_LINE = re.compile(r"^\[worker 0\] I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] step "
                   r"(\d+)/\d+ \|")


def seconds_per_step(log: str, every: int, warmup: int, total: int) -> float:
  """From the first progress line at or after `warmup` to the last regular one.

  With `--log_every` equal to `--steps_per_loop` (`every`), the line for a
  multiple of `every` is printed at the end of the host call holding that
  step, which always sits at the same place in its call (the first call runs
  one step), so the interval between two lines is whole host calls. The line
  for the final step, when it is not a multiple, is left out for that reason.
  """
  points = []
  for m in map(_LINE.match, log.splitlines()):
    if m:
      h, mi, s, step = int(m[1]), int(m[2]), float(m[3]), int(m[4])
      if step >= warmup and step % every == 0 and step < total:
        points.append((step, h * 3600 + mi * 60 + s))
  if len(points) < 2:
    sys.exit(f"too few progress lines to time:\n{log[-2000:]}")
  (s0, t0), (s1, t1) = points[0], points[-1]
  return ((t1 - t0) % 86400) / (s1 - s0)  # % 86400: a run across midnight


def run(args, steps_per_loop: int, sync: bool) -> float:
  with tempfile.TemporaryDirectory(prefix="preempt_bench_") as model_dir:
    out = subprocess.run(
        [sys.executable, "-m", "engine.launch", "--num_workers=2", "--",
         f"--model={args.model}", f"--image_size={args.image_size}",
         f"--batch_size_per_replica={args.batch}",
         f"--synthetic_examples={args.batch * 2 * 16}",
         f"--train_steps={args.steps}", f"--steps_per_loop={steps_per_loop}",
         f"--log_every={steps_per_loop}", "--optimizer=sgd",
         "--preemption_sync" if sync else "--nopreemption_sync",
         f"--model_dir={model_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
        check=False)
  if out.returncode != 0:
    sys.exit(f"a launched run failed with code {out.returncode}:\n"
             f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
  return seconds_per_step(out.stdout, steps_per_loop, args.warmup, args.steps)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="small_cnn")
  parser.add_argument("--image_size", type=int, default=32)
  parser.add_argument("--batch", type=int, default=8, help="per replica")
  parser.add_argument("--steps", type=int, default=301)
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--steps_per_loop", default="1,10")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=600)
  args = parser.parse_args()
  loops = [int(k) for k in args.steps_per_loop.split(",")]
  times = {(k, s): [] for k in loops for s in (True, False)}
  for _ in range(args.repeats):  # interleaved, so load drifts hit both
    for k in loops:
      for sync in (True, False):
        times[(k, sync)].append(run(args, k, sync))
  with open("/proc/loadavg") as f:
    load = f.read().split()[0]
  print(f"{args.model} {args.image_size}x{args.image_size}, "
        f"{args.batch} per replica, 2 workers, steps {args.warmup}.."
        f"{args.steps}, medians of {args.repeats}; load average {load}")
  print("steps_per_loop | exchange on ms/step | off ms/step | on/off | "
        "extra ms per host call")
  for k in loops:
    on = statistics.median(times[(k, True)]) * 1e3
    off = statistics.median(times[(k, False)]) * 1e3
    print(f"{k:14d} | {on:19.3f} | {off:11.3f} | {on / off:6.3f} | "
          f"{(on - off) * k:.2f}")
    print(f"{'':14s}   runs on: {', '.join(f'{t * 1e3:.3f}' for t in times[(k, True)])}"
          f"; off: {', '.join(f'{t * 1e3:.3f}' for t in times[(k, False)])}")


if __name__ == "__main__":
  main()
