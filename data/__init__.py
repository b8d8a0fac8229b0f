"""Data set registry: `--dataset` name -> a batched, endlessly repeating tf.data pipeline.

Every source yields (images float32 [B, S, S, 3] in [0, 1], labels int32 [B])
batched by the *global* batch; `strategy.experimental_distribute_dataset`
splits each batch across replicas and workers. Epochs never share a batch, so
with --drop_remainder unset the last batch of each epoch is partial.
"""
import dataclasses
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
  guesses nor warns: DATA for generated or single-file sources, where every
  worker builds the same batches and keeps its own slice of each.
  """
  options = tf.data.Options()
  options.deterministic = True
  options.experimental_distribute.auto_shard_policy = policy
  return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def build_train(config: Config, global_batch: int, start_step: int = 0):
  """The training pipeline and its DataInfo, positioned at `start_step`.

  Raises:
    ConfigError: unknown data set, or too few examples for one batch.
  """
  # Imported here so that importing `data` stays free of tfds start-up cost.
  from data import synthetic, tfds_data  # pylint: disable=g-import-not-at-top
  if config.dataset == "synthetic":
    return synthetic.build(config, global_batch, start_step)
  return tfds_data.build(config, global_batch, start_step)
