"""From a task's examples to the batches the strategy distributes.

Training: each epoch is a seeded shuffle of the task's examples (the seed
depends on --seed and the epoch number only), batched by the *global* batch
(epochs never share a batch, so with --drop_remainder unset the last batch
of an epoch is partial), then the task's `preprocess_batch` and
`augment_batch` (which gets the batch's step index). Epochs follow
one another without end. The order is therefore a pure function of
(seed, step): resuming at step s starts at epoch s // steps_per_epoch and
skips what is left, reading at most one epoch again, and gives exactly the
batches an uninterrupted run would have seen.

Evaluation: one pass in the task's order, batched the same way, with a
partial last batch so that every example counts once.

`strategy.experimental_distribute_dataset` then splits every global batch
across the replicas of all workers (each worker reads the same batches and
keeps its share), so the batches, and the results, do not depend on the
number of replicas or workers.
"""
from absl import logging
import tensorflow as tf

from engine.config import DataConfig
from engine.core.checks import check_examples
from engine.errors import ConfigError, flag_error
from engine.task import Task

_DATA = tf.data.experimental.AutoShardPolicy.DATA
# Per-epoch shuffle seeds: seed * _EPOCH_STRIDE + epoch never repeats.
_EPOCH_STRIDE = 1_000_003


def input_context(strategy: tf.distribute.Strategy
                  ) -> tf.distribute.InputContext:
  """This worker's place among the input pipelines (one per worker)."""
  workers = getattr(strategy.extended, "_num_workers", 1)
  resolver = getattr(strategy, "cluster_resolver", None)
  index = 0
  if workers > 1 and resolver is not None:
    index = resolver.task_id  # worker i is input pipeline i
  return tf.distribute.InputContext(
      num_input_pipelines=workers, input_pipeline_id=index,
      num_replicas_in_sync=strategy.num_replicas_in_sync)


def count_examples(task: Task, split: str, examples: tf.data.Dataset) -> int:
  """The split's size: the task's word for it, the data set's cardinality,
  or, when neither knows, one pass to count."""
  known = task.num_examples(split)
  if known is not None:
    return int(known)
  n = int(examples.cardinality())
  if n >= 0:
    return n
  logging.info("Task %s: counting the %s examples (the data set does not "
               "say how many it has; tf.data.experimental.assert_cardinality "
               "would save this pass).", task.name, split)
  return int(examples.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def steps_per_epoch(num_examples: int, global_batch: int,
                    drop_remainder: bool) -> int:
  """Batches in one epoch; a partial last batch counts unless dropped."""
  if drop_remainder:
    return num_examples // global_batch
  return -(-num_examples // global_batch)


class TrainData:
  """The task's training examples and how they become batches.

  Made once per run: it reads the task's examples (lazily) and counts them;
  `batches(start_step)` then builds the pipeline from any step.

  Raises:
    ConfigError: the task's examples are not (features, labels) pairs,
      never end, or are fewer than one global batch.
  """

  def __init__(self, task: Task, context: tf.distribute.InputContext,
               data: DataConfig, global_batch: int, seed: int):
    self._task = task
    self._examples = task.build_inputs("train", context)
    if self._examples is None:
      raise ConfigError(f"task {task.name}: build_inputs('train') returned "
                        "None; a task needs training data.")
    check_examples(task, "train", self._examples)
    self._data = data
    self._global_batch = global_batch
    self._seed = seed
    self.num_examples = count_examples(task, "train", self._examples)
    self.steps_per_epoch = steps_per_epoch(self.num_examples, global_batch,
                                           data.drop_remainder)
    if self.num_examples < global_batch:
      raise flag_error(
          "batch_size_per_replica", data.batch_size_per_replica,
          f"task {task.name} has {self.num_examples} training examples, "
          f"fewer than one global batch ({global_batch}); lower "
          "--batch_size_per_replica or use more data.")

  def batches(self, start_step: int = 0) -> tf.data.Dataset:
    """Endless global batches from `start_step` on (see the module doc)."""
    data, seed, examples = self._data, self._seed, self._examples
    per_epoch = self.steps_per_epoch
    first_epoch = start_step // per_epoch

    def epoch(e):
      ds = examples
      if data.shuffle_buffer:
        ds = ds.shuffle(data.shuffle_buffer,
                        seed=tf.constant(seed, tf.int64) * _EPOCH_STRIDE + e)
      return ds.batch(self._global_batch, drop_remainder=data.drop_remainder)

    # A shuffle's seed pair is (TensorFlow's global seed, its own): both are
    # set here, so the order depends on --seed and the epoch only.
    tf.random.set_seed(seed)
    ds = tf.data.Dataset.range(first_epoch, tf.int64.max).flat_map(epoch)
    ds = ds.skip(start_step - first_epoch * per_epoch)
    task = self._task

    def prepare(step, batch):
      features, labels = task.preprocess_batch(*batch, training=True)
      return task.augment_batch(features, labels, step)

    # Numbered after the skip: the number is the step that trains the batch.
    ds = ds.enumerate(start=start_step).map(
        prepare, num_parallel_calls=tf.data.AUTOTUNE)
    return _endless(_finish(ds, _DATA))

  @property
  def features_spec(self):
    """The model's input spec: the features of a preprocessed batch."""
    return self.batches().element_spec[0]


def eval_inputs(task: Task, context: tf.distribute.InputContext,
                global_batch: int):
  """(one pass of global batches, number of examples), or None.

  A data set the task gives an auto-shard policy (e.g. FILE, each worker
  reading its own files) keeps it: an evaluation sums over every example,
  however they are split.
  """
  examples = task.build_inputs("eval", context)
  if examples is None:
    return None
  check_examples(task, "eval", examples)
  n = count_examples(task, "eval", examples)
  policy = examples.options().experimental_distribute.auto_shard_policy
  ds = examples.batch(global_batch).map(
      lambda f, l: task.preprocess_batch(f, l, training=False),
      num_parallel_calls=tf.data.AUTOTUNE)
  return _finish(ds, policy if policy != tf.data.experimental
                 .AutoShardPolicy.AUTO else _DATA), n


def _finish(ds: tf.data.Dataset, policy) -> tf.data.Dataset:
  """tf.data options, set once here for training and evaluation.

  The auto-shard policy is explicit so MultiWorkerMirroredStrategy neither
  guesses nor warns. Parallel map calls and prefetching are AUTOTUNE.
  """
  options = tf.data.Options()
  options.deterministic = True
  options.experimental_distribute.auto_shard_policy = policy
  return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def _endless(ds: tf.data.Dataset) -> tf.data.Dataset:
  """States what the training pipeline is: endless.

  tf.distribute reads it from the cardinality. For a data set that might end,
  its distributed iterator asks every step whether each worker still has
  data, which on multi_worker is one more all-reduce per step
  (input_lib._enable_get_next_as_optional); an infinite one needs no such
  check.
  """
  return ds.apply(tf.data.experimental.assert_cardinality(
      tf.data.INFINITE_CARDINALITY))
