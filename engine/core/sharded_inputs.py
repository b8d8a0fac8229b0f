"""--shard_files: each worker reads only its own files of the training set.

By default every worker reads every record of every global batch and keeps
its rows (engine/core/inputs.py): the batches are a pure function of
(seed, step), the same on 1 replica and N workers. With files sharded, a
worker's rows come from its own files, so that cannot hold: the global batch
is the N workers' batches side by side and depends on N. Hence opt-in, for
a data set the task marks FILE (a tfds split with at least one file per
worker, data/tfds_data.py).

Worker w of N: tf.data's FILE sharding of the task's examples, then, per
epoch, a shuffle seeded by (seed, epoch, w) and whole batches of
global_batch / N rows (a partial batch is dropped), epochs without end. Its
rows are positions [w B/N, (w+1) B/N) of the global batch. Resume is exact
for the same N: the worker counts its examples once (one pass over its
records), so step s starts at its epoch s // batches-per-epoch and skips the
batches before s in it, as the default path does.
"""
import tensorflow as tf
from tensorflow.python.distribute import input_ops  # pylint: disable=g-direct-tensorflow-import

from data import decode
from engine.core import randomness
from engine.errors import flag_error

_FILE = tf.data.experimental.AutoShardPolicy.FILE
# Per-epoch shuffle op seeds: epoch * _EPOCH_STRIDE + worker never repeats
# (the global seed is --seed).
_EPOCH_STRIDE = 1_000_003


def check_marked(task_name: str, examples: tf.data.Dataset,
                 num_workers: int) -> None:
  """Raises a one-line ConfigError unless the task marked its data FILE."""
  policy = examples.options().experimental_distribute.auto_shard_policy
  if policy != _FILE:
    raise flag_error(
        "shard_files", True,
        f"task {task_name}'s training data cannot be split by files among "
        f"{num_workers} worker(s) (it needs a tfds data set with at least one "
        "file per worker); synthetic and folder sources already read only "
        "indices or paths per global batch, so drop --shard_files.")


def own_examples(examples: tf.data.Dataset,
                 context: tf.distribute.InputContext) -> tf.data.Dataset:
  """The examples of this worker's files only (tf.data FILE sharding)."""
  if context.num_input_pipelines == 1:
    return examples
  return input_ops.auto_shard_dataset(
      examples, context.num_input_pipelines, context.input_pipeline_id,
      context.num_replicas_in_sync)


def count(examples: tf.data.Dataset) -> int:
  """One pass over a worker's records (encoded, so cheap): how many."""
  return int(examples.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def worker_items(examples: tf.data.Dataset, num_examples: int, *,
                 context: tf.distribute.InputContext, global_batch: int,
                 seed: int, shuffle_buffer: int, start_step: int = 0
                 ) -> tf.data.Dataset:
  """This worker's endless numbered batches from `start_step` on.

  Args:
    examples: this worker's examples (`own_examples`), `num_examples` of them.

  Returns:
    ((features, labels), (steps, positions)) of global_batch / N rows each:
    the step that trains each row and its position in the global batch.

  Raises:
    ConfigError: the worker's files hold fewer examples than its batch.
  """
  workers, worker = context.num_input_pipelines, context.input_pipeline_id
  batch = global_batch // workers
  per_epoch = num_examples // batch
  if per_epoch == 0:
    raise flag_error(
        "shard_files", True,
        f"worker {worker}'s files hold {num_examples} examples, fewer than "
        f"its share of the global batch ({batch}); lower "
        "--batch_size_per_replica or drop --shard_files.")
  first_epoch = start_step // per_epoch
  if decode.counter.enabled:  # records read from the source, for tests
    examples = examples.map(_counted)

  global_seed, offset = randomness.shuffle_seeds(seed)

  def epoch(e):
    ds = examples
    if shuffle_buffer:
      ds = ds.shuffle(shuffle_buffer, seed=e * _EPOCH_STRIDE + worker + offset)
    return ds.batch(batch, drop_remainder=True)

  # The shuffle's seed pair is (--seed, its own): a function of (seed,
  # epoch, worker) only.
  tf.random.set_seed(global_seed)
  ds = tf.data.Dataset.range(first_epoch, tf.int64.max).flat_map(epoch)
  ds = ds.skip(start_step - first_epoch * per_epoch)
  positions = tf.range(worker * batch, (worker + 1) * batch, dtype=tf.int64)
  return ds.enumerate(start=start_step).map(
      lambda step, b: (b, (tf.fill([batch], step), positions)))


def _counted(*example):
  decode.counter.count("records", tf.constant(1))
  return example
