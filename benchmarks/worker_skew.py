"""Where a 2-worker step's extra time goes: waiting for the peer, or the all-reduce.

    python -m benchmarks.worker_skew [--steps=41 --profile=31,40] [-- flags]
    python -m benchmarks.worker_skew --traces=MODEL_DIR   # an existing run's

Launches 2 workers pinned to one core each (`engine.launch --cpu_pinning`,
MobileNetV2 64x64, 64 per replica, as benchmarks.scaling's (c)) with
`--profile_steps --profile_all_workers`, which traces every worker (worker 1
into model_dir/worker_1), and reads both traces. (TensorFlow 2.21's profiler
can crash worker 1 as its trace stops, engine/report/profiler.py: this
script then exits with the launcher's failure; run it again.) Both workers
run on this host, so their trace clocks are one clock. Per traced step it
takes each worker's gradient all-reduce (the step's last-ending
CollectiveReduceV2 in the training loop) and prints the medians of:

  compute   from the end of the previous step's all-reduce to the start of
            this one (forward, backward, update, input), per worker;
  skew      how long the first worker to arrive waited for the other;
  transfer  from the later arrival to the end of the all-reduce: the data
            moving and adding, which no waiting is left in;
  step      the interval between two starts of the all-reduce.

compute / step is what the all-reduce and the skew leave of each step: about
the efficiency benchmarks.scaling measures against independent workers.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks import scaling
from benchmarks import xplane_summary

ROOT = scaling.ROOT
LOOP_COLLECTIVE = "while/CollectiveReduceV2:CollectiveReduceV2"


def gradient_all_reduces(directory, steps):
  """[(start ms, end ms)] of each traced step's last-ending collective."""
  spans = sorted((start, start + duration) for _, _, name, start, duration
                 in xplane_summary.events(directory)
                 if name.endswith(LOOP_COLLECTIVE))
  if not spans or len(spans) % steps:
    raise SystemExit(f"error: {directory}: {len(spans)} collectives in the "
                     f"training loop for {steps} traced steps")
  per_step = len(spans) // steps
  return [max(spans[k * per_step:(k + 1) * per_step], key=lambda s: s[1])
          for k in range(steps)]


def breakdown(chief, other):
  """Per-step figures (ms) of two workers' [(start, end)] all-reduces."""
  rows = []
  for k in range(1, len(chief)):
    (s0, e0), (s1, e1) = chief[k], other[k]
    rows.append(dict(
        compute=[s0 - chief[k - 1][1], s1 - other[k - 1][1]],
        skew=abs(s1 - s0), transfer=max(e0, e1) - max(s0, s1),
        step=[s0 - chief[k - 1][0], s1 - other[k - 1][0]]))
  return rows


def report(rows):
  med = lambda key, w=None: statistics.median(
      r[key][w] if w is not None else r[key] for r in rows)
  lines = [f"{'step':>4} {'compute w0':>11} {'compute w1':>11} "
           f"{'skew':>7} {'transfer':>9} {'step w0':>8}"]
  for k, r in enumerate(rows, 1):
    lines.append(f"{k:4d} {r['compute'][0]:11.1f} {r['compute'][1]:11.1f} "
                 f"{r['skew']:7.1f} {r['transfer']:9.1f} {r['step'][0]:8.1f}")
  compute = (med("compute", 0) + med("compute", 1)) / 2
  step = (med("step", 0) + med("step", 1)) / 2
  lines.append(
      f"medians (ms): compute {compute:.1f} (w0 {med('compute', 0):.1f}, w1 "
      f"{med('compute', 1):.1f}), skew {med('skew'):.1f}, transfer "
      f"{med('transfer'):.1f}, step {step:.1f}; compute / step = "
      f"{compute / step:.3f}")
  return "\n".join(lines)


def launch(args, model_dir):
  """benchmarks.scaling's (c) run, traced on both workers."""
  first, last = args.profile
  args.steps_per_loop = last - first + 1  # one host call is the trace
  cmd = [sys.executable, "-m", "engine.launch", "--num_workers=2",
         "--cpu_pinning", "--", "--cross_device_ops=ring",
         *scaling.engine_flags(args, model_dir),
         f"--profile_steps={first},{last}", "--profile_all_workers"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                        timeout=args.timeout, check=False)
  if proc.returncode:
    raise SystemExit(f"the 2-worker run failed ({proc.returncode}):\n"
                     f"{proc.stderr[-3000:]}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=41)
  parser.add_argument("--profile", default="31,40",
                      help="START,END: the traced steps")
  parser.add_argument("--model", default="mobilenet_v2")
  parser.add_argument("--image_size", type=int, default=64)
  parser.add_argument("--batch", type=int, default=64, help="per replica")
  parser.add_argument("--timeout", type=float, default=900)
  parser.add_argument("--traces", default="",
                      help="read this 2-worker run's model_dir, run nothing")
  parser.add_argument("engine_flags", nargs="*",
                      help="after --: more engine flags")
  args = parser.parse_args()
  args.profile = tuple(int(v) for v in args.profile.split(","))
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = args.traces or os.path.join(tmp, "run")
    if not args.traces:
      launch(args, model_dir)
    steps = args.profile[1] - args.profile[0] + 1
    chief = gradient_all_reduces(os.path.join(model_dir, "plugins"), steps)
    other = gradient_all_reduces(
        os.path.join(model_dir, "worker_1", "plugins"), steps)
    print(report(breakdown(chief, other)))


if __name__ == "__main__":
  main()
