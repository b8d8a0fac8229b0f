"""From a task's examples to the batches the strategy distributes.

Training: each epoch is a seeded shuffle of the task's examples (the seed
depends on --seed and the epoch number only), batched by the *global* batch
(epochs never share a batch, so with --drop_remainder unset the last batch
of an epoch is partial), then the task's `preprocess_batch` and
`augment_batch` (which gets each row's step and position in the global
batch; `prepare_rows`). Epochs follow
one another without end. The order is therefore a pure function of
(seed, step): resuming at step s starts at epoch s // steps_per_epoch and
skips what is left, reading at most one epoch again, and gives exactly the
batches an uninterrupted run would have seen.

Evaluation (`EvalData`): one pass in the task's order, batched the same
way, with a partial last batch so that every example counts once.

Both are split across the replicas of all workers exactly as
`strategy.experimental_distribute_dataset` splits them (`_worker_pieces`;
DATA sharding: every worker reads the same global batches and keeps its
rows), but the task's `preprocess_batch` runs after the split, on each
replica's rows only (`worker_batches`): the examples stay cheap (indices,
paths, encoded bytes) until then, so a worker decodes 1/N of the images, not
all of them, in training and in evaluation alike. The batches, and the
results, do not depend on the number of replicas or workers. An evaluation
set the task marks FILE (each worker reads its own files) goes through the
same split; the worker then keeps every row of its own files.

`--shard_files` (opt-in, engine/core/sharded_inputs.py) trades the exact
order for reading: each worker reads only its own files of a training set
the task marks FILE, in whole batches of global_batch / N rows, so the
batches depend on the number of workers (resume stays exact for the same
number).
"""
import functools
import re
from typing import Optional

from absl import logging
import numpy as np
import tensorflow as tf
# What tf.distribute runs to split a global batch among replicas and workers;
# called here, in the same order, so the split stays exactly TensorFlow's.
from tensorflow.python.data.experimental.ops import distribute as tf_split  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.distribute import input_ops  # pylint: disable=g-direct-tensorflow-import

from engine.config import DataConfig
from engine.core import randomness, sharded_inputs
from engine.core.checks import check_examples
from engine.errors import ConfigError, flag_error
from engine.task import Task

_DATA = tf.data.experimental.AutoShardPolicy.DATA
# Batches each pipeline prepares ahead of the step (see `_finish`).
_PREFETCH = 2
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


def _build_inputs(task: Task, split: str,
                  context: tf.distribute.InputContext):
  """The task's examples of `split`, built as the task asks (`_as_written`)."""
  return _as_written(task, task.build_inputs)(split, context)


def _as_written(task: Task, fn):
  """`fn`, which builds data sets, run with AutoGraph off when the task
  opts out (`Task.autograph` False): the map functions of every data set
  built inside (the task's own, the engine's, tf.distribute's) are traced
  as written, and the process never pays AutoGraph's first use."""
  if task.autograph:
    return fn
  return tf.autograph.experimental.do_not_convert(fn)


def _task_as_written(method):
  """A TrainData or EvalData method that builds data sets, `_as_written`."""
  @functools.wraps(method)
  def run(self, *args, **kwargs):
    return _as_written(self._task, method)(self, *args, **kwargs)  # pylint: disable=protected-access
  return run


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
    self._examples = _build_inputs(task, "train", context)
    if self._examples is None:
      raise ConfigError(f"task {task.name}: build_inputs('train') returned "
                        "None; a task needs training data.")
    check_examples(task, "train", self._examples)
    self._data = data
    self._global_batch = global_batch
    self._seed = seed
    self.num_examples = count_examples(task, "train", self._examples)
    if data.shard_files:
      sharded_inputs.check_marked(task.name, self._examples,
                                  context.num_input_pipelines)
    # --shard_files: whole batches only (engine/core/sharded_inputs.py).
    self.steps_per_epoch = steps_per_epoch(
        self.num_examples, global_batch,
        data.drop_remainder or data.shard_files)
    self._worker_counts = {}  # --shard_files: examples per worker
    if self.num_examples < global_batch:
      raise flag_error(
          "batch_size_per_replica", data.batch_size_per_replica,
          f"task {task.name} has {self.num_examples} training examples, "
          f"fewer than one global batch ({global_batch}); lower "
          "--batch_size_per_replica or use more data.")

  def global_items(self, start_step: int = 0) -> tf.data.Dataset:
    """Endless global batches of the task's (cheap) examples from
    `start_step` on, before `preprocess_batch` (see the module doc)."""
    data, seed, examples = self._data, self._seed, self._examples
    per_epoch = self.steps_per_epoch
    first_epoch = start_step // per_epoch

    global_seed, offset = randomness.shuffle_seeds(seed)

    def epoch(e):
      ds = examples
      if data.shuffle_buffer:
        ds = ds.shuffle(data.shuffle_buffer, seed=tf.constant(
            seed * _EPOCH_STRIDE + offset, tf.int64) + e)
      return ds.batch(self._global_batch, drop_remainder=data.drop_remainder)

    # A shuffle's seed pair is (TensorFlow's global seed, its own): both are
    # set here, so the order depends on --seed and the epoch only.
    tf.random.set_seed(global_seed)
    ds = tf.data.Dataset.range(first_epoch, tf.int64.max).flat_map(
        _unconverted(epoch))
    return ds.skip(start_step - first_epoch * per_epoch)

  @_task_as_written
  def worker_batches(self, context: tf.distribute.InputContext,
                     start_step: int = 0,
                     with_rows: bool = False) -> tf.data.Dataset:
    """This worker's per-replica batches, in replica order, preprocessed:
    (features, labels), or with `with_rows` (features, labels, (steps,
    positions)), the step that trains each row and its position in the
    global batch (what the model's randomness is keyed by,
    engine/core/randomness.py).

    What each worker runs (`distribute`): the global batches, split by
    tf.distribute's own rebatch and DATA shard (the rows
    `experimental_distribute_dataset` would give this worker's replicas,
    partial batches included), then `preprocess_batch` on those rows only.
    With --shard_files: the worker's batches of its own files instead
    (`worker_items`), split among its replicas.
    """
    if self._data.shard_files:
      pieces = self._sharded_pieces(context, start_step)
    else:
      pieces = self._global_pieces(context, start_step)
    return self._prepared(pieces, with_rows)

  def _global_pieces(self, context, start_step):
    # Numbered before the split: each row carries the step that trains it
    # and its position in the global batch, for `augment_batch`.
    ds = self.global_items(start_step).enumerate(start=start_step).map(
        _unconverted(_numbered))
    return _worker_pieces(
        _with_options(ds, _DATA), context,
        self._global_batch if self._data.drop_remainder else None)

  def _prepared(self, pieces, with_rows: bool = False):
    """`prepare_rows` on each numbered piece; the tf.data options."""
    task = self._task

    def prepare(batch, rows):
      prepared = prepare_rows(task, *batch, training=True, rows=rows)
      return prepared if with_rows else prepared[:2]

    ds = pieces.map(_unconverted(prepare, task),
                    num_parallel_calls=tf.data.AUTOTUNE)
    return _endless(_finish(ds, _DATA))

  def worker_items(self, context: tf.distribute.InputContext,
                   start_step: int = 0) -> tf.data.Dataset:
    """--shard_files: this worker's numbered batches of its own files."""
    key = (context.num_input_pipelines, context.input_pipeline_id)
    own = sharded_inputs.own_examples(self._examples, context)
    if key not in self._worker_counts:
      self._worker_counts[key] = sharded_inputs.count(own)
    return sharded_inputs.worker_items(
        own, self._worker_counts[key], context=context,
        global_batch=self._global_batch, seed=self._seed,
        shuffle_buffer=self._data.shuffle_buffer, start_step=start_step)

  def _sharded_pieces(self, context, start_step):
    """--shard_files: the worker's batch split among its own replicas, as
    `_worker_pieces` splits static batches."""
    workers = context.num_input_pipelines
    own = tf.distribute.InputContext(
        1, 0, context.num_replicas_in_sync // workers)
    return _worker_pieces(
        _with_options(self.worker_items(context, start_step), _DATA), own,
        self._global_batch // workers)

  def batches(self, start_step: int = 0,
              with_rows: bool = False) -> tf.data.Dataset:
    """Whole global batches, preprocessed: what one replica trains on."""
    return self.worker_batches(tf.distribute.InputContext(), start_step,
                               with_rows)

  def distribute(self, strategy: tf.distribute.Strategy, start_step: int = 0):
    """The distributed training iterator: each worker builds its own rows."""
    return iter(strategy.distribute_datasets_from_function(
        lambda context: self.worker_batches(context, start_step,
                                            with_rows=True)))

  def expected_examples(self, first_step: int, steps: int) -> np.ndarray:
    """Examples the global batches of steps first_step+1.. hold, as made."""
    if self._data.shard_files:  # whole batches only
      return np.full(steps, self._global_batch)
    position = (first_step + np.arange(steps)) % self.steps_per_epoch
    left = self.num_examples - position * self._global_batch
    return np.minimum(left, self._global_batch)

  @property
  @_task_as_written
  def features_spec(self):
    """The model's input spec: the features of a preprocessed batch.

    Built from the global batches, lazily, in both modes: --shard_files
    would count its records first, for the same features.
    """
    pieces = self._global_pieces(tf.distribute.InputContext(), 0)
    return self._prepared(pieces).element_spec[0]


class EvalData:
  """The task's evaluation examples: one pass, split per worker as training's.

  `worker_batches` is what each worker runs: the global batches of the cheap
  examples, split by `_worker_pieces`, then `preprocess_batch` on this
  worker's pieces only. A data set the task gives an auto-shard policy (e.g.
  FILE, each worker reading its own files) keeps it: an evaluation sums
  over every example, however they are split.

  Raises:
    ConfigError: the task's examples are not (features, labels) pairs.
  """

  def __init__(self, task: Task, examples: tf.data.Dataset,
               global_batch: int):
    check_examples(task, "eval", examples)
    self._task = task
    self._examples = examples
    self._global_batch = global_batch
    self.num_examples = count_examples(task, "eval", examples)
    policy = examples.options().experimental_distribute.auto_shard_policy
    auto = tf.data.experimental.AutoShardPolicy.AUTO
    self.policy = _DATA if policy == auto else policy
    # FILE: the workers' shares differ in size, so a pass reads to the end
    # (engine/core/evaluate.py); DATA: every worker takes this many steps.
    self.until_end = self.policy == tf.data.experimental.AutoShardPolicy.FILE
    self.steps_per_pass = -(-self.num_examples // global_batch)

  @_task_as_written
  def worker_batches(self, context: tf.distribute.InputContext,
                     repeat: bool = False) -> tf.data.Dataset:
    """This worker's per-replica batches of one pass (`repeat`: of passes
    without end), in replica order, preprocessed."""
    ds = self._examples.batch(self._global_batch)
    if repeat:
      ds = ds.repeat()
    # Partial batches (the last one): never a static batch size.
    ds = _worker_pieces(_with_options(ds, self.policy), context, None)
    task = self._task
    ds = ds.map(_unconverted(
        lambda f, l: prepare_rows(task, f, l, training=False), task),
                num_parallel_calls=tf.data.AUTOTUNE)
    ds = _finish(ds, self.policy)
    return _endless(ds) if repeat else ds

  def batches(self) -> tf.data.Dataset:
    """Whole global batches of one pass, preprocessed: one replica's."""
    return self.worker_batches(tf.distribute.InputContext())

  def distribute(self, strategy: tf.distribute.Strategy, repeat: bool):
    """The distributed data set: each worker builds its own rows."""
    return strategy.distribute_datasets_from_function(
        lambda context: self.worker_batches(context, repeat))

  @property
  def element_spec(self):
    """(features, labels) of a preprocessed batch."""
    return self.batches().element_spec


def eval_inputs(task: Task, context: tf.distribute.InputContext,
                global_batch: int) -> Optional[EvalData]:
  """The task's evaluation data (`EvalData`), or None when it has none."""
  examples = _build_inputs(task, "eval", context)
  if examples is None:
    return None
  return EvalData(task, examples, global_batch)


def _worker_pieces(ds: tf.data.Dataset, context: tf.distribute.InputContext,
                   static_batch: Optional[int]) -> tf.data.Dataset:
  """This worker's per-replica pieces of global batches, in replica order.

  What `strategy.experimental_distribute_dataset` runs to split a data set
  among replicas and workers, called the same way (training and evaluation
  both), so the split stays exactly TensorFlow's; `ds` carries its
  auto-shard policy in its options.

  Args:
    static_batch: the global batch size when every batch has it (training
      with --drop_remainder), else None (partial batches).
  """
  workers = context.num_input_pipelines
  replicas = context.num_replicas_in_sync
  if replicas > 1:
    per_worker = replicas // workers
    if static_batch:
      # Static batches: tf.distribute rebatches by sizes for this worker.
      sizes = tf_split.batch_sizes_for_worker(
          static_batch, workers, per_worker, context.input_pipeline_id)
      ds = ds.rebatch(sizes)
    else:
      # A batch size tf.distribute cannot read off the graph (partial
      # batches): it splits each batch in `replicas` near-equal pieces.
      ds = tf_split._LegacyRebatchDataset(ds, replicas)  # pylint: disable=protected-access
    ds = ds.prefetch(per_worker)
  if workers > 1:
    ds = input_ops.auto_shard_dataset(ds, workers, context.input_pipeline_id,
                                      replicas)
  return ds


def _unconverted(fn, task: Optional[Task] = None):
  """`fn` for tf.data, marked for AutoGraph to leave alone, unless it calls a
  task's own `preprocess_batch` or `augment_batch`, which tf.data converts
  as it converts every map function (a task that opts out builds its data
  sets without AutoGraph: `_as_written`). The engine's functions need no
  conversion (no Python branch on a tensor), and AutoGraph's first use in a
  process costs about half a second of a run's start (benchmarks/
  RESULTS.md, "Exit at `Done:` and start-up")."""
  if task is not None and (
      type(task).preprocess_batch is not Task.preprocess_batch or
      type(task).augment_batch is not Task.augment_batch):
    return fn
  return tf.autograph.experimental.do_not_convert(fn)


def _numbered(step, batch):
  """(batch, (step per row, position per row in the global batch))."""
  first = tf.nest.flatten(batch)[0]
  n = tf.shape(first, out_type=tf.int64)[0]
  steps, positions = tf.fill([n], step), tf.range(n)
  for t in (steps, positions):  # static with --drop_remainder (rebatch)
    t.set_shape(first.shape[:1])
  return batch, (steps, positions)


def prepare_rows(task: Task, features, labels, *, training: bool, rows=None):
  """The task's `preprocess_batch`, then (training) its `augment_batch`,
  then the rows it could not read dropped.

  Args:
    rows: (steps, positions), int64 [rows] each: the step that trains each
      row and its index in the global batch (training only).

  Returns:
    (features, labels), and in training the rows kept: (features, labels,
    (steps, positions)).
  """
  out = task.preprocess_batch(features, labels, training=training)
  features, labels = out[:2]
  if training:
    steps, positions = rows
    # Every row of a piece belongs to one step (0 rows: any step will do).
    step = tf.reduce_max(tf.concat([steps, [0]], axis=0))
    features, labels = task.augment_batch(features, labels, step, positions)
  if len(out) == 3:  # `keep`: False for rows the task could not read
    keep = out[2]
    features, labels = tf.nest.map_structure(
        lambda t: tf.boolean_mask(t, keep), (features, labels))
    if rows is not None:
      rows = tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep), rows)
  return (features, labels) if rows is None else (features, labels, rows)


def input_error(e: tf.errors.OpError):
  """The one-line ConfigError for a data error a task raised on purpose.

  A task's pipeline refuses an example mid-training with
  `tf.debugging.Assert(ok, ["--flag: problem", what])` (data/decode.py does
  for --strict_images); the step's error then carries
  `assertion failed: [--flag: problem] [what]`. Returns None for any other
  error.
  """
  match = re.search(r"assertion failed: \[(--[^\]]+)\] \[+(.*?)\]",
                    str(e.message))
  if match is None:
    return None
  what = match.group(2).strip("\"'")
  return ConfigError(f"{match.group(1)} {what}; fix or remove it (the "
                     "latest checkpoint is intact).")


def _finish(ds: tf.data.Dataset, policy) -> tf.data.Dataset:
  """tf.data options, set once here for training and evaluation.

  The auto-shard policy is explicit so MultiWorkerMirroredStrategy neither
  guesses nor warns. The prefetch buffer holds _PREFETCH batches: with
  AUTOTUNE, tf.data's autotuner grew it on a busy host until the process
  held about 100 MiB more, once, some 10 minutes into a run, and never gave
  it back (benchmarks/RESULTS.md, the issue-30 soak); two batches let the
  next step's rows be made while a step runs. `_with_options` says why the
  autotuner is off.
  """
  return _with_options(ds, policy).prefetch(_PREFETCH)


def _with_options(ds: tf.data.Dataset, policy) -> tf.data.Dataset:
  """The engine's tf.data options, on every pipeline it builds (training
  and evaluation, the task's own stages included: options are per
  pipeline).

  tf.data's autotuner is off. With it, the soak's job (small_cnn 32x32 on 2
  replicas) took more and more of the BFC pool over its first minutes (the
  pool's peak 64 MiB at 5 s, 90-95 MiB at 2-3.5 minutes; one run with the
  engine's map calls at a fixed parallelism did the same), memory a process
  keeps: without it the peak stayed at 64 MiB from second 37 and RSS was
  25-30 MiB lower, at the same speed (benchmarks/RESULTS.md, "Soak").
  Without the autotuner an AUTOTUNE map runs one call per core, as tf.data
  pipelines tuned by hand do.
  """
  options = tf.data.Options()
  options.deterministic = True
  options.autotune.enabled = False
  options.experimental_distribute.auto_shard_policy = policy
  return ds.with_options(options)


def _endless(ds: tf.data.Dataset) -> tf.data.Dataset:
  """States what the pipeline is (training, or evaluation's passes): endless.

  tf.distribute reads it from the cardinality. For a data set that might end,
  its distributed iterator asks every step whether each worker still has
  data, which on multi_worker is one more all-reduce per step
  (input_lib._enable_get_next_as_optional); an infinite one needs no such
  check.
  """
  return ds.apply(tf.data.experimental.assert_cardinality(
      tf.data.INFINITE_CARDINALITY))
