"""The built-in image sources: `--dataset` name -> single (image, label) examples.

Every source gives the examples of a split in a fixed order; the engine
(engine/core/inputs.py) shuffles, batches and distributes them. Images are
float32 [S, S, 3] in [0, 1], labels int32.

Sources: `synthetic` (data/synthetic.py: example indices here, images made
per batch), `folder:/path` (data/folder.py) and any TensorFlow Datasets name
(data/tfds_data.py). `engine/tasks/image_classification.py` is the task that
uses them.
"""
import dataclasses
import hashlib
from typing import Tuple

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Source:
  """One split of a data set: its examples and what the task needs to know."""
  examples: tf.data.Dataset  # (image or index, label) per element
  num_examples: int
  class_names: Tuple[str, ...]
  # FILE: the split's files can go round the workers (for evaluation).
  policy: tf.data.experimental.AutoShardPolicy


def source(config, split: str, flag: str, *, seed: int, training: bool,
           num_workers: int = 1) -> Source:
  """The examples of the split expression `split` (from flag `flag`).

  Args:
    config: the image task's ImageClassificationConfig.
    split: a split expression, e.g. train[:80%].
    flag: the flag it came from, named in errors.
    seed: the run's --seed (file order of tfds training reads; synthetic).
    training: reading for training (tfds shuffles its files then).
    num_workers: the auto-shard policy's choice (see tfds_data._policy).

  Raises:
    ConfigError: unknown data set or split, or bad images.
  """
  # Imported here so that importing `data` stays free of tfds start-up cost.
  from data import folder, synthetic, tfds_data  # pylint: disable=g-import-not-at-top
  if config.dataset == "synthetic":
    module = synthetic
  else:
    module = folder if folder.is_folder(config.dataset) else tfds_data
  ds, count, names, policy = module.source(
      config, split, flag, training=training, num_workers=num_workers,
      seed=seed)
  return Source(_cache(ds, config, split), count, tuple(names), policy)


def _cache(ds: tf.data.Dataset, config, split: str) -> tf.data.Dataset:
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
