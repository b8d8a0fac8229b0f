"""The embedded default data set: seeded, learnable images made in memory.

Example i of class c is a smooth colour pattern fixed per class plus noise that
is a pure function of i, so the data are the same for any replica or worker
count and need no disk or network. Each epoch visits the examples in a seeded
permutation (`index_shuffle`), which also makes resuming at any step cheap:
only integers are skipped, no images are made for skipped batches.
`--train_split` / `--eval_split` select positions of the example list 0..N-1
with tfds split syntax (data/splits.py).
"""
import numpy as np
import tensorflow as tf

from data import DataInfo, check_size, finish, splits, steps_per_epoch
from engine.config import Config

_TEMPLATE_SIZE = 4    # class patterns are 4x4 colour grids, upsampled
_SIGNAL = 0.6         # image = _SIGNAL * pattern + (1 - _SIGNAL) * noise


def class_patterns(num_classes: int, image_size: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  grids = rng.uniform(size=(num_classes, _TEMPLATE_SIZE, _TEMPLATE_SIZE, 3))
  return tf.image.resize(grids.astype(np.float32), [image_size, image_size],
                         method="bilinear").numpy()


def images_for(indices, patterns, num_classes: int):
  """Vectorised: int64 indices [B] -> (images [B, S, S, 3], labels [B])."""
  labels = tf.cast(indices % num_classes, tf.int32)
  size = patterns.shape[1]
  grid = tf.range(size, dtype=tf.float32)
  # A cheap stateless hash of (index, y, x, channel) in [0, 1).
  i = tf.cast(indices % 100003, tf.float32)[:, None, None, None]
  y = grid[None, :, None, None]
  x = grid[None, None, :, None]
  c = tf.range(3, dtype=tf.float32)[None, None, None, :]
  h = tf.sin(i * 12.9898 + y * 78.233 + x * 37.719 + c * 4.581) * 43758.5453
  noise = h - tf.floor(h)
  images = _SIGNAL * tf.gather(patterns, labels) + (1.0 - _SIGNAL) * noise
  return images, labels


def index_batches(indices: np.ndarray, global_batch: int, drop_remainder: bool,
                  seed: int) -> tf.data.Dataset:
  """Endless batches of `indices`, one seeded permutation per epoch."""
  num_examples = len(indices)
  table = tf.constant(indices, tf.int64)

  def epoch(e):
    key = tf.stack([tf.constant(seed, tf.int64), e])
    return tf.data.Dataset.range(num_examples).map(
        lambda p: tf.gather(table, tf.random.experimental.index_shuffle(
            p, key, num_examples - 1))).batch(global_batch, drop_remainder)
  return tf.data.Dataset.counter().flat_map(epoch)


def _patterns(config: Config):
  return tf.constant(class_patterns(config.num_classes, config.image_size,
                                    config.seed))


def build(config: Config, global_batch: int, start_step: int = 0):
  # Example i has label i % num_classes, so a slice keeps the class balance.
  indices = splits.select(config.train_split, config.synthetic_examples,
                          "train_split")
  n = len(indices)
  check_size("synthetic", n, global_batch)
  patterns = _patterns(config)
  ds = index_batches(indices, global_batch, config.drop_remainder, config.seed)
  ds = ds.skip(start_step).map(
      lambda idx: images_for(idx, patterns, config.num_classes),
      num_parallel_calls=tf.data.AUTOTUNE)
  info = DataInfo(
      name="synthetic", num_examples=n, num_classes=config.num_classes,
      class_names=tuple(f"class_{k}" for k in range(config.num_classes)),
      steps_per_epoch=steps_per_epoch(n, global_batch, config.drop_remainder))
  return finish(ds, tf.data.experimental.AutoShardPolicy.DATA), info


def build_eval(config: Config, global_batch: int):
  """The --eval_split slice of the example list, in order: (dataset, count)."""
  indices = splits.select(config.eval_split, config.synthetic_examples,
                          "eval_split")
  patterns = _patterns(config)
  ds = tf.data.Dataset.from_tensor_slices(indices).batch(global_batch).map(
      lambda idx: images_for(idx, patterns, config.num_classes),
      num_parallel_calls=tf.data.AUTOTUNE)
  return finish(ds, tf.data.experimental.AutoShardPolicy.DATA), len(indices)
