"""What TensorBoard summaries cost: the engine with and without them, side by side.

    python -m benchmarks.tensorboard_cost [--summary_every=10] [--steps=30 --rounds=3]

Same set-up and flags as benchmarks/in_process.py (MirroredStrategy on 2
logical CPU devices, MobileNetV2 at 64x64, 64 per replica), whose engine
runner it reuses: the timed window includes the host-side hook work, so
summary writing shows in the rate. Rounds alternate the order; prints the
best rate of each and the ratio (target: summaries cost < 2%). On a shared
machine that ratio is noisy, so it also prints the share of the timed
window spent inside the summary hook itself, which noise barely moves.
"""
import tempfile
import time

from absl import app
from absl import flags

from benchmarks import in_process

flags.DEFINE_integer("rounds", 2, "Rounds, alternating the order.")
flags.DEFINE_integer("summary_every", 10,
                     "Steps between summaries in the 'with' runs.")
FLAGS = flags.FLAGS


def _timed_hook():
  """Counts the seconds spent in SummaryHook.after_loop in this process."""
  from engine.report import tensorboard  # pylint: disable=g-import-not-at-top
  spent = [0.0]
  inner = tensorboard.SummaryHook.after_loop

  def after_loop(self, step, rows, seconds):
    start = time.perf_counter()
    inner(self, step, rows, seconds)
    spent[0] += time.perf_counter() - start
  tensorboard.SummaryHook.after_loop = after_loop
  return spent


def main(argv):
  del argv
  spent = _timed_hook()
  shares = []
  from engine.host import cpus  # pylint: disable=g-import-not-at-top
  cpus.split_cpu(FLAGS.cpu_devices)
  variants = {"without": 0, "with": FLAGS.summary_every}
  best = {v: 0.0 for v in variants}
  for r in range(FLAGS.rounds):
    order = list(variants) if r % 2 == 0 else list(variants)[::-1]
    for v in order:
      with tempfile.TemporaryDirectory(
          prefix="tfengine_bench_summaries_") as model_dir:
        fields = dict(in_process.fields(model_dir),
                      summary_every=variants[v], export=False)
        before = spent[0]
        rate = in_process.run_engine(fields)
      # Approximate window: the timed steps at the measured rate.
      window = FLAGS.steps * fields["batch_size_per_replica"] * (
          FLAGS.cpu_devices) / rate
      share = (spent[0] - before) / window
      if variants[v]:
        shares.append(share)
      print(f"round {r + 1}: {v:8s} summaries {rate:8.1f} examples/s, "
            f"{100 * share:.2f}% of the time in the summary hook", flush=True)
      best[v] = max(best[v], rate)
  ratio = best["with"] / best["without"]
  print(f"\n{FLAGS.model} {FLAGS.image_size}x{FLAGS.image_size}, "
        f"{FLAGS.cpu_devices} replicas, {FLAGS.steps} timed steps, "
        f"--steps_per_loop={FLAGS.steps_per_loop}, best of {FLAGS.rounds}")
  print("| run | examples/s |\n|---|---|")
  print(f"| --summary_every=0 | {best['without']:.1f} |")
  print(f"| --summary_every={FLAGS.summary_every} | {best['with']:.1f} |")
  print(f"with/without = {ratio:.4f}; summary cost {100 * (1 - ratio):.2f}% "
        "(target < 2%)")
  print(f"time in the summary hook: {100 * max(shares):.2f}% of the timed "
        "window at most (includes its first, tracing call)")


if __name__ == "__main__":
  app.run(main)
