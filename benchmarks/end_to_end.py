"""A small job end to end: the engine's command line against Keras `fit`.

    python -m benchmarks.end_to_end [--rounds=5] [--baseline_tree=DIR]
        [-- more engine flags]

benchmarks/small_job.py's regression job (4,000 examples, 1,260 steps of
64, an evaluation after each of the 20 epochs) is run in a fresh process by
each runner, alternating, `--rounds` times:

  engine    `python benchmarks/small_job.py --runner=engine` (the engine's
            command line with its defaults, --noexport);
  keras     `python benchmarks/small_job.py --runner=keras` (`fit` with
            `validation_data`, Keras's defaults);
  baseline  with --baseline_tree, the engine of another checkout (e.g. `git
            worktree add /tmp/base main`) on the same job, side by side.

For each it prints the wall time from the process's start to its exit and
the CPU time it used; for the engine also where the wall time went, from
its log's timestamps: until the strategy and data are set up ("Global
batch" line), until the first host call starts (the loop's hooks begin),
until the first progress line (the first call traced and run), training and
evaluation until `Done:`, and `Done:` to the exit. Medians over the rounds,
and engine / keras.
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The engine's log lines that mark its phases (absl's "HH:MM:SS.micro").
_MARKS = (("set_up", "] Global batch "), ("loop_starts", "] Each step "),
          ("first_progress", "] step "), ("done", "] Done: "))


def _run(cmd, cwd):
  """(wall seconds, CPU seconds, {mark: seconds since start}, output)."""
  env = dict(os.environ, PYTHONPATH=cwd, TF_CPP_MIN_LOG_LEVEL="2")
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.monotonic()
  proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  marks, lines = {}, []

  def read():
    for line in proc.stdout:
      lines.append(line)
      for name, text in _MARKS:
        if name not in marks and text in line:
          marks[name] = time.monotonic() - start
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  code = proc.wait(900)
  wall = time.monotonic() - start
  reader.join(10)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  if code != 0:
    raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n" +
                       "".join(lines[-30:]))
  return wall, cpu, marks, "".join(lines)


def _phases(marks, wall):
  """Where an engine run's wall time went, from its marks."""
  points = [("start -> set up", "set_up"), ("-> first host call", "loop_starts"),
            ("-> first progress line", "first_progress"),
            ("-> Done:", "done")]
  out, last = {}, 0.0
  for label, key in points:
    if key in marks:
      out[label] = marks[key] - last
      last = marks[key]
  out["Done: -> exit"] = wall - last
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ours, extra = ((argv[:argv.index("--")], argv[argv.index("--") + 1:])
                 if "--" in argv else (argv, []))
  parser = argparse.ArgumentParser(prog="python -m benchmarks.end_to_end")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--baseline_tree", default="")
  args = parser.parse_args(ours)
  runners = [("engine", ROOT, "engine"), ("keras", ROOT, "keras")]
  if args.baseline_tree:
    runners.insert(1, ("baseline", os.path.abspath(args.baseline_tree),
                       "engine"))
  results = {name: [] for name, _, _ in runners}
  for r in range(args.rounds):
    for name, tree, runner in runners:
      with tempfile.TemporaryDirectory(prefix="end_to_end_") as model_dir:
        # The job script is this tree's; the engine it imports, the tree's.
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "small_job.py"),
               f"--runner={runner}"]
        if runner == "engine":
          cmd += [f"--model_dir={model_dir}", *extra]
        wall, cpu, marks, out = _run(cmd, tree)
      results[name].append((wall, cpu, marks))
      final = re.findall(r'"final_loss": ([0-9.e-]+)', out) or re.findall(
          r"keras done: loss ([0-9.]+)", out)
      print(f"round {r + 1} {name:8s}: {wall:6.2f} s wall, {cpu:6.2f} s CPU"
            f" (final loss {final[-1] if final else '?'})", flush=True)
  print()
  print("| runner | wall s (median) | CPU s (median) | runs |")
  print("|---|---|---|---|")
  medians = {}
  for name, values in results.items():
    medians[name] = statistics.median(v[0] for v in values)
    print(f"| {name} | {medians[name]:.2f} | "
          f"{statistics.median(v[1] for v in values):.2f} | "
          f"{', '.join(f'{v[0]:.2f}' for v in values)} |")
  print(f"\nengine / keras (wall): {medians['engine'] / medians['keras']:.3f}")
  if "baseline" in medians:
    print(f"baseline / keras (wall): "
          f"{medians['baseline'] / medians['keras']:.3f}")
  for name in (n for n in ("baseline", "engine") if n in results):
    phases = [_phases(m, w) for w, _, m in results[name]]
    print(f"\n{name}: where the wall time went (medians, s)")
    for label in phases[0]:
      print(f"  {label:24s} {statistics.median(p.get(label, 0.0) for p in phases):6.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
