"""Op types of two TF profiler traces side by side (benchmarks/op_profile.py).

    python -m benchmarks.throughput --baselines=orbit --profile_dir=/tmp/p
    python -m benchmarks.op_profile /tmp/p/engine /tmp/p/orbit --steps=10

Sums, per trace directory, the time of every TensorFlow op event (named
"name:OpType") by OpType, and prints the largest types per step, with the
difference B - A: where one step's time goes, and where two loops differ.
Also the wall time of the traced host call (the event spanning the steps).

--counts counts the op executions instead of summing their time: a
comparison of two versions of the engine that the machine's load cannot
move (the same counts per step: the same compiled work), e.g. with traces
from `--profile_steps` of each version:

    python -m benchmarks.op_profile /tmp/a/plugins/profile /tmp/b/... \
        --steps=10 --counts
"""
import collections

from absl import app
from absl import flags

from benchmarks import xplane_summary

flags.DEFINE_integer("steps", 10, "Steps in each trace (the divisor).")
flags.DEFINE_integer("top", 20, "Op types to print.")
flags.DEFINE_bool("counts", False, "Count op executions instead of timing "
                  "them.")
FLAGS = flags.FLAGS


def op_totals(directory: str, counts: bool = False):
  """({op type: ms (or executions)}, longest top-level event ms) over every
  trace file."""
  totals = collections.Counter()
  longest = 0.0
  for _, _, name, _, ms in xplane_summary.events(directory):
    if name in ("train_loop", "loop_fn"):  # engine / Orbit host call
      longest = max(longest, ms)
    if ":" in name and "::" not in name and not name.startswith(
        ("Eager", "Iterator")):
      totals[name.rsplit(":", 1)[1]] += 1 if counts else ms
  return totals, longest


def main(argv):
  a_dir, b_dir = argv[1:3]
  (a, a_wall), (b, b_wall) = (op_totals(d, FLAGS.counts)
                              for d in (a_dir, b_dir))
  n = FLAGS.steps
  unit = ("op executions per step" if FLAGS.counts else
          "ms per step, op time summed over threads")
  print(f"A = {a_dir}, B = {b_dir}; {unit}")
  print(f"host call wall: A {a_wall / n:.1f}  B {b_wall / n:.1f}")
  print(f"all ops:        A {sum(a.values()) / n:.1f}  "
        f"B {sum(b.values()) / n:.1f}")
  print("| op type | A | B | B - A |")
  print("|---|---|---|---|")
  if FLAGS.counts:
    differ = sorted(op for op in set(a) | set(b) if a[op] != b[op])
    print(f"op types executed a different number of times: "
          f"{', '.join(differ) or 'none'}")
  for op, _ in (a + b).most_common(FLAGS.top):
    print(f"| {op} | {a[op] / n:.1f} | {b[op] / n:.1f} | "
          f"{(b[op] - a[op]) / n:+.1f} |")


if __name__ == "__main__":
  app.run(main)
