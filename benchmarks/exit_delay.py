"""How long a finished command-line run takes to end after its `Done:` line.

    python -m benchmarks.exit_delay [--repeats=2] [--cases=pinned,launcher]
        [--baseline_tree=DIR]

Two cases, the ones where TensorFlow 2.21's tf.data kept a finished process
alive (RESULTS.md, "Iterator teardown"):

  pinned    `taskset -c 0 python -m engine.main` on 4 logical CPUs (4
            replicas on one core);
  launcher  `python -m engine.launch --num_workers=2 --cpu_pinning` (each
            worker pinned to a core of its own).

Each runs the same small job (small_cnn, 1,500 steps in host calls of 50,
evaluations every 500 steps). The figure is the wall time from the last
`Done:` line the command printed to the command's exit (for the launcher,
the launcher's exit, i.e. every worker ended), and the whole run's time.
With --baseline_tree (another checkout, e.g. `git worktree add /tmp/base
main`) each repeat runs that tree's engine and then this one's, side by
side.
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["--model=small_cnn", "--image_size=32", "--batch_size_per_replica=8",
       "--train_steps=1500", "--steps_per_loop=50", "--log_every=500",
       "--synthetic_examples=512", "--eval_every=500",
       "--eval_split=train[:64]", "--noexport"]


def command(case: str, model_dir: str):
  flags = [*JOB, f"--model_dir={model_dir}"]
  if case == "pinned":
    return ["taskset", "-c", "0", sys.executable, "-m", "engine.main",
            "--cpu_devices=4", *flags]
  return [sys.executable, "-m", "engine.launch", "--num_workers=2",
          "--cpu_pinning", "--", *flags]


def timed_run(cmd, tree: str):
  """(seconds from the last `Done:` line to the exit, seconds in all, code)."""
  env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2")
  start = time.monotonic()
  proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  done_at = []
  tail = []

  def read():
    for line in proc.stdout:
      tail[:] = (tail + [line])[-20:]
      if "Done: " in line:
        done_at.append(time.monotonic())
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  code = proc.wait(900)
  end = time.monotonic()
  reader.join(10)
  if code != 0 or not done_at:
    raise RuntimeError(f"{' '.join(cmd)} ended with {code}:\n" +
                       "".join(tail))
  return end - done_at[-1], end - start, code


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.exit_delay")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--cases", default="pinned,launcher")
  parser.add_argument("--baseline_tree", default="",
                      help="another checkout to measure side by side")
  args = parser.parse_args(argv)
  cases = args.cases.split(",")
  for c in cases:
    if c not in ("pinned", "launcher"):
      parser.error(f"--cases: unknown case {c!r}; use pinned, launcher.")
  trees = ([("baseline", os.path.abspath(args.baseline_tree))]
           if args.baseline_tree else []) + [("this", ROOT)]
  results = {}
  import tempfile  # pylint: disable=g-import-not-at-top
  for r in range(args.repeats):
    for case in cases:
      for name, tree in trees:
        with tempfile.TemporaryDirectory(prefix="exit_delay_") as model_dir:
          delay, total, _ = timed_run(command(case, model_dir), tree)
        results.setdefault((case, name), []).append((delay, total))
        print(f"repeat {r + 1} {case:8s} {name:8s}: Done: -> exit "
              f"{delay:6.2f} s, run {total:6.1f} s", flush=True)
  print()
  print("| case | tree | Done: -> exit (median, s) | whole run (median, s) |")
  print("|---|---|---|---|")
  for (case, name), values in results.items():
    print(f"| {case} | {name} | "
          f"{statistics.median(v[0] for v in values):.2f} | "
          f"{statistics.median(v[1] for v in values):.1f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
