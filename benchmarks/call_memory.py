"""Memory a run keeps per host call: the slope of peak RSS over host calls.

    python -m benchmarks.call_memory [--calls=2000,12000] [--rounds=1]
        [--setup=mirrored|multi_worker] [--baseline_tree=DIR]

Runs `python -m engine.main` (small_cnn at 32x32, 2 examples per replica)
with one step per host call (`--steps_per_loop=1`), no checkpoints,
summaries or export, once for each number of calls in `--calls`, each in a
fresh process, and reads its peak RSS (`os.wait4`): on mirrored, one
process with 2 logical CPUs; on multi_worker, 2 workers through
`engine.launch`, whose wait reports the larger worker's peak. The
difference between the longest and the shortest run, divided by the calls
between them, is what a host call leaves behind: TensorFlow's records of
collective instance keys (engine/distribute/instance_keys.py), and
anything else that grows per call. With --baseline_tree (another checkout,
e.g. `git worktree add /tmp/base main`) every round runs that tree's engine
and then this one's, side by side.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["--model=small_cnn", "--image_size=32", "--synthetic_examples=512",
       "--batch_size_per_replica=2", "--steps_per_loop=1", "--noexport",
       "--log_every=1000000", "--summary_every=0", "--checkpoint_every=0",
       "--noprogress"]
# The command before the job's flags, per --setup.
SETUPS = {
    "mirrored": ["-m", "engine.main", "--strategy=mirrored",
                 "--cpu_devices=2"],
    "multi_worker": ["-m", "engine.launch", "--num_workers=2", "--",
                     "--strategy=multi_worker"],
}


def peak_rss(tree: str, calls: int, setup: str = "mirrored"):
  """(peak RSS in MiB, seconds) of one run of `calls` host calls."""
  with tempfile.TemporaryDirectory(prefix="tfengine_calls_") as model_dir:
    cmd = [sys.executable, *SETUPS[setup], *JOB,
           f"--train_steps={calls}", f"--model_dir={model_dir}"]
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    # Reaped here: recorded on the Popen, which would otherwise wait again.
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
  if proc.returncode:
    sys.exit(f"{tree}: exit {proc.returncode}\n"
             f"{err.decode(errors='replace')[-2000:]}")
  return usage.ru_maxrss / 1024, seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", default="2000,12000",
                      help="Host calls per run, comma-separated.")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--setup", default="mirrored", choices=sorted(SETUPS),
                      help="One process with 2 replicas, or 2 workers.")
  parser.add_argument("--baseline_tree", default="",
                      help="Another checkout, run side by side.")
  args = parser.parse_args()
  calls = sorted(int(c) for c in args.calls.split(","))
  trees = {"this": ROOT}
  if args.baseline_tree:
    trees = {"baseline": os.path.abspath(args.baseline_tree), **trees}
  slopes = {name: [] for name in trees}
  for r in range(1, args.rounds + 1):
    for name, tree in trees.items():
      peaks = {}
      for n in calls:
        peaks[n], seconds = peak_rss(tree, n, args.setup)
        print(f"round {r}: {name:8s} {n:6d} calls: peak RSS "
              f"{peaks[n]:.1f} MiB, {seconds:.1f} s", flush=True)
      slope = (peaks[calls[-1]] - peaks[calls[0]]) * 1024 * 1024 / (
          calls[-1] - calls[0])
      slopes[name].append(slope)
      print(f"round {r}: {name:8s} {slope:.0f} bytes per host call",
            flush=True)
  print(f"{args.setup}:")
  print("| engine | bytes per host call (each round) |")
  print("|---|---|")
  for name, values in slopes.items():
    print(f"| {name} | {', '.join(f'{v:.0f}' for v in values)} |")


if __name__ == "__main__":
  main()
