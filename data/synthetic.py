"""The embedded default data set: seeded, learnable images made in memory.

Example i of class c is a smooth colour pattern fixed per class plus noise that
is a pure function of i, so the data are the same for any replica or worker
count and need no disk or network. The examples are their indices: the
engine shuffles and batches those, and the task makes the images of a whole
batch at once (`images_for`), so resuming at any step skips integers only.
`--train_split` / `--eval_split` select positions of the example list 0..N-1
with tfds split syntax (data/splits.py).
"""
import numpy as np
import tensorflow as tf

from engine.data import splits

_TEMPLATE_SIZE = 4    # class patterns are 4x4 colour grids, upsampled
_SIGNAL = 0.6         # image = _SIGNAL * pattern + (1 - _SIGNAL) * noise


def class_patterns(num_classes: int, image_size: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  grids = rng.uniform(size=(num_classes, _TEMPLATE_SIZE, _TEMPLATE_SIZE, 3))
  return tf.image.resize(grids.astype(np.float32), [image_size, image_size],
                         method="bilinear").numpy()


def images_for(indices, patterns, num_classes: int):
  """Vectorised: int64 indices [B] -> (images [B, S, S, 3], labels [B]).

  The engine calls it on each worker's own rows of a batch only, so a
  worker makes 1/N of the images (data/decode.py's counter shows it).
  """
  from engine.data.decode import counter  # pylint: disable=g-import-not-at-top
  counter.count("synthetic", tf.shape(indices)[0])
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


def source(config, split: str, flag: str, *, seed: int, training: bool,
           num_workers: int = 1):
  """(example indices with their labels, count, class names, DATA).

  The images are made per batch by `images_for` (vectorised), from the
  indices and `class_patterns`.
  Example i has label i % num_classes, so a slice keeps the class balance.
  """
  del training, num_workers, seed
  indices = splits.select(split, config.synthetic_examples, flag)
  ds = tf.data.Dataset.from_tensor_slices(indices).map(
      lambda i: (i, tf.cast(i % config.num_classes, tf.int32)))
  names = tuple(f"class_{k}" for k in range(config.num_classes))
  return ds, len(indices), names, tf.data.experimental.AutoShardPolicy.DATA
