"""Data set registry: `--dataset` name -> a batched, endlessly repeating tf.data pipeline.

Every source yields (images float32 [B, S, S, 3] in [0, 1], labels int32 [B])
batched by the *global* batch; `strategy.experimental_distribute_dataset`
splits each batch across replicas and workers. Epochs never share a batch, so
with --drop_remainder unset the last batch of each epoch is partial.

Sources: `synthetic` (data/synthetic.py), `folder:/path` (data/folder.py) and
any TensorFlow Datasets name (data/tfds_data.py). The file-backed ones give a
`source(config, split, flag, training)` of decoded examples in a fixed order;
`build_train` / `build_eval` below turn it into batches the same way for both.
"""
import dataclasses
import hashlib
from typing import Tuple

import tensorflow as tf

from engine.config import Config
from engine.errors import flag_error


@dataclasses.dataclass(frozen=True)
class DataInfo:
  """What the loop needs to know about a training set."""
  name: str
  num_examples: int
  num_classes: int
  class_names: Tuple[str, ...]
  steps_per_epoch: int


def steps_per_epoch(num_examples: int, global_batch: int,
                    drop_remainder: bool) -> int:
  """Batches in one epoch; a partial last batch counts unless dropped."""
  if drop_remainder:
    return num_examples // global_batch
  return -(-num_examples // global_batch)


def check_size(dataset: str, num_examples: int, global_batch: int) -> None:
  if num_examples < global_batch:
    raise flag_error("dataset", dataset,
                     f"has {num_examples} training examples, fewer than one "
                     f"global batch ({global_batch}); lower "
                     "--batch_size_per_replica or use more data.")


def finish(ds: tf.data.Dataset, policy) -> tf.data.Dataset:
  """tf.data options, set once here for every source.

  The auto-shard policy is explicit so MultiWorkerMirroredStrategy neither
  guesses nor warns: DATA for generated sources, folders and data sets with
  fewer files than workers, where every worker builds the same batches and
  keeps its own slice of each; FILE for tfds files that go round the workers.
  Parallel map calls and prefetching are AUTOTUNE throughout.
  """
  options = tf.data.Options()
  options.deterministic = True
  options.experimental_distribute.auto_shard_policy = policy
  return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def _module(config: Config):
  # Imported here so that importing `data` stays free of tfds start-up cost.
  from data import folder, synthetic, tfds_data  # pylint: disable=g-import-not-at-top
  if config.dataset == "synthetic":
    return synthetic
  return folder if folder.is_folder(config.dataset) else tfds_data


def _cache(ds: tf.data.Dataset, config: Config, split: str) -> tf.data.Dataset:
  """--cache: decoded, resized examples kept in memory or in files.

  A cache file is named after what it holds (data set, split, image size), so
  another split or size never reads a stale cache.
  """
  if not config.cache:
    return ds
  if config.cache == "memory":
    return ds.cache()
  key = hashlib.sha1(f"{config.dataset}|{split}|{config.image_size}".encode())
  return ds.cache(f"{config.cache}-{key.hexdigest()[:12]}")


def build_train(config: Config, global_batch: int, start_step: int = 0,
                num_workers: int = 1):
  """The training pipeline and its DataInfo, positioned at `start_step`.

  `num_workers` only chooses the auto-shard policy (see tfds_data._policy).

  Raises:
    ConfigError: unknown data set or split, bad images, or too few examples
      for one batch.
  """
  module = _module(config)
  if config.dataset == "synthetic":
    ds, info = module.build(config, global_batch, start_step)
    return _endless(ds), info
  ds, num_examples, class_names, policy = module.source(
      config, config.train_split, "train_split", training=True,
      num_workers=num_workers)
  check_size(config.dataset, num_examples, global_batch)
  # Shuffled after the cache, so each epoch has its own seeded order; the
  # order is a pure function of --seed, so resuming skips `start_step` batches.
  ds = _cache(ds, config, config.train_split).shuffle(
      config.shuffle_buffer, seed=config.seed, reshuffle_each_iteration=True)
  ds = ds.batch(global_batch, drop_remainder=config.drop_remainder).repeat()
  info = DataInfo(
      name=config.dataset, num_examples=num_examples,
      num_classes=len(class_names), class_names=tuple(class_names),
      steps_per_epoch=steps_per_epoch(num_examples, global_batch,
                                      config.drop_remainder))
  return _endless(finish(ds.skip(start_step), policy)), info


def _endless(ds: tf.data.Dataset) -> tf.data.Dataset:
  """States what every training pipeline is: endless (each repeats forever).

  tf.distribute reads it from the cardinality. For a data set that might end,
  its distributed iterator asks every step whether each worker still has
  data, which on multi_worker is one more all-reduce per step
  (input_lib._enable_get_next_as_optional); an infinite one needs no such
  check. A pipeline that ended anyway would raise instead of stopping early.
  """
  return ds.apply(tf.data.experimental.assert_cardinality(
      tf.data.INFINITE_CARDINALITY))


def build_eval(config: Config, global_batch: int, num_workers: int = 1):
  """One finite pass over `--eval_split`, in a fixed order, as (dataset, count).

  The last batch is partial unless the count divides by the global batch;
  --drop_remainder applies to training only, so every example is evaluated.
  Returns None when --eval_split is empty.

  Raises:
    ConfigError: unknown split or bad images.
  """
  if not config.eval_split:
    return None
  module = _module(config)
  if config.dataset == "synthetic":
    return module.build_eval(config, global_batch)
  ds, num_examples, _, policy = module.source(
      config, config.eval_split, "eval_split", training=False,
      num_workers=num_workers)
  ds = _cache(ds, config, config.eval_split).batch(global_batch)
  return finish(ds, policy), num_examples
