"""The built-in image sources: `--dataset` name -> single (image, label) examples.

Every source gives the examples of a split in a fixed order; the engine
(engine/core/inputs.py) shuffles, batches and distributes them. Images are
float32 [S, S, 3] in [0, 1], labels int32.

Sources: `synthetic` (data/synthetic.py: example indices here, images made
per batch), `folder:/path` (data/folder.py: file paths here) and any
TensorFlow Datasets name (data/tfds_data.py: encoded bytes here). Images are
made or decoded from those cheap items per worker, for that worker's rows of
each batch only (data/decode.py), by the task's `preprocess_batch`
(`engine/tasks/image_classification.py`).
"""
import dataclasses
import hashlib
from typing import Tuple

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Source:
  """One split of a data set: its examples and what the task needs to know."""
  examples: tf.data.Dataset  # (index, path, bytes or image; label)
  num_examples: int
  class_names: Tuple[str, ...]
  # FILE: the split's files can go round the workers (for evaluation, and
  # training under --shard_files).
  policy: tf.data.experimental.AutoShardPolicy
  # What `examples` hold before decoding: "synthetic" (indices), "files"
  # (paths), "bytes" (encoded images) or "images" (decoded: --cache).
  kind: str


def source(config, split: str, flag: str, *, seed: int, training: bool,
           num_workers: int = 1, listing_dir=None, chief: bool = True,
           strict: bool = False) -> Source:
  """The examples of the split expression `split` (from flag `flag`).

  Args:
    config: the image task's ImageClassificationConfig.
    split: a split expression, e.g. train[:80%].
    flag: the flag it came from, named in errors.
    seed: the run's --seed (file order of tfds training reads; synthetic).
    training: reading for training (tfds shuffles its files then).
    num_workers: the auto-shard policy's choice (see tfds_data._policy).
    listing_dir: where a folder's file listing is cached (model_dir).
    chief: whether this process writes that cache.
    strict: --strict_images (only for --cache, which decodes here).

  Raises:
    ConfigError: unknown data set or split, or bad images.
  """
  # Imported here so that importing `data` stays free of tfds start-up cost.
  from engine.data import folder, synthetic, tfds_data  # pylint: disable=g-import-not-at-top
  kw = dict(training=training, num_workers=num_workers, seed=seed)
  if config.dataset == "synthetic":
    found, kind = synthetic.source(config, split, flag, **kw), "synthetic"
  elif folder.is_folder(config.dataset):
    found, kind = folder.source(config, split, flag, cache_dir=listing_dir,
                                write_cache=chief, **kw), "files"
  else:
    found, kind = tfds_data.source(config, split, flag, **kw), "bytes"
  ds, count, names, policy = found
  if config.cache:
    ds, kind = _cache(ds, config, split, kind, strict), "images"
  return Source(ds, count, tuple(names), policy, kind)


def _cache(ds: tf.data.Dataset, config, split: str, kind: str,
           strict: bool) -> tf.data.Dataset:
  """--cache: decoded, resized examples kept in memory or in files.

  The images are decoded before batching here, by every worker (the cache
  then serves every later epoch). A cache file is named after what it holds
  (data set, split, image size), so another split or size never reads a
  stale cache.
  """
  from engine.data import decode  # pylint: disable=g-import-not-at-top
  ds = ds.batch(1).map(lambda items, labels: decode.decode_rows(
      items, labels, config.image_size, from_files=kind == "files",
      strict=strict, source=kind)).unbatch()
  ds = ds.filter(lambda image, label, keep: keep).map(
      lambda image, label, keep: (image, label))
  if config.cache == "memory":
    return ds.cache()
  key = hashlib.sha1(f"{config.dataset}|{split}|{config.image_size}".encode())
  return ds.cache(f"{config.cache}-{key.hexdigest()[:12]}")
