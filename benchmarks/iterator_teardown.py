"""How long dropping a tf.data iterator takes, in plain TensorFlow.

    taskset -c 0 python -m benchmarks.iterator_teardown --devices=4 --seconds=25
    taskset -c 0 python -m benchmarks.iterator_teardown --devices=1 --noautotune
    taskset -c 0 python -m benchmarks.iterator_teardown --devices=4 --on_thread

Iterates a small pipeline for --seconds (one tf.function step per element;
with --devices > 1 through MirroredStrategy's distributed iterator on that
many logical CPUs), then drops the iterator and prints how long the calling
thread waited. With --on_thread a daemon thread drops it (what the engine
does, engine/core/iterators.py) and the figure is the caller's wait. Run it
pinned to one core (taskset) to see TensorFlow 2.21's wait for tf.data's
autotuning thread, whose sleep doubles over the iterator's life up to 60 s.
No engine code.
"""
import threading
import time

from absl import app
from absl import flags

flags.DEFINE_integer("devices", 1, "Logical CPUs; > 1: MirroredStrategy.")
flags.DEFINE_float("seconds", 25.0, "How long to iterate first.")
flags.DEFINE_boolean("autotune", True, "tf.data autotuning of the pipeline.")
flags.DEFINE_boolean("on_thread", False, "Drop the iterator on a daemon "
                     "thread.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.devices > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.devices)
  ds = tf.data.Dataset.range(10**9).map(
      lambda i: tf.cast(i, tf.float32) * tf.ones([8, 8])).batch(16).prefetch(2)
  if not FLAGS.autotune:
    options = tf.data.Options()
    options.autotune.enabled = False
    ds = ds.with_options(options)
  if FLAGS.devices > 1:
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(FLAGS.devices)])
    ds = strategy.experimental_distribute_dataset(ds)
    run = strategy.run
  else:
    run = lambda fn, args: fn(*args)
  box = [iter(ds)]

  @tf.function
  def step(iterator):
    return run(tf.reduce_sum, (next(iterator),))

  start, steps = time.time(), 0
  while time.time() - start < FLAGS.seconds:
    step(box[0])
    steps += 1
  start = time.time()
  if FLAGS.on_thread:
    threading.Thread(target=box.clear, daemon=True).start()
  else:
    box.clear()
  print(f"devices {FLAGS.devices}, autotune {FLAGS.autotune}, on_thread "
        f"{FLAGS.on_thread}: {steps} steps in {FLAGS.seconds:.0f} s; the "
        f"caller waited {time.time() - start:.2f} s for the iterator to go",
        flush=True)


if __name__ == "__main__":
  app.run(main)
