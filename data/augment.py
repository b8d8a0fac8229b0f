"""`--augment=flip,crop`: random image changes on the host, per global batch.

`augment(images, step, positions, seed, ops)` changes rows of float images
[n, S, S, C] with stateless random ops whose seed is made from (seed, step),
so each example's change is a pure function of (seed, step, its position in
the global batch). The engine runs it on each replica's rows, on the worker
that trains them (engine/core/inputs.py), and gives each row's position in
the global batch: every draw is made for positions 0..max(positions) and
gathered at the rows' positions. TensorFlow's stateless random ops are
prefix-consistent (a draw of shape [m] begins with the draw of shape [k] for
k < m; tests/test_augment.py checks it), so a row's values do not depend on
how the batch was split: the result is the same for any number of replicas
and workers, and a resumed run sees exactly the batches an uninterrupted run
would.

  flip  random horizontal flip, probability 1/2.
  crop  images of side <= PAD_CROP_MAX_SIZE (CIFAR-sized, like 32x32):
        pad by side/8 pixels on each side (4 px at 32) with zeros and crop a
        random window of the original size back, every pixel copied exactly;
        larger ones: a random resized crop (Inception style: 8%-100% of the
        area, aspect ratio 3/4-4/3), resized back bilinearly.
"""
import math
from typing import Sequence

import tensorflow as tf

# At or below this side, a resized crop of 8% of the area would keep a few
# pixels only: pad-and-crop instead (the CIFAR recipe).
PAD_CROP_MAX_SIZE = 64
_MIN_AREA, _MAX_AREA = 0.08, 1.0
_MIN_RATIO, _MAX_RATIO = 3 / 4, 4 / 3
# Salts that give each op its own stream from one (seed, step) seed.
_SALT = {"flip": 1, "crop": 2}


def augment(images: tf.Tensor, step: tf.Tensor, positions: tf.Tensor,
            seed: int, ops: Sequence[str]) -> tf.Tensor:
  """The rows with `ops` ("flip", "crop"; engine/tasks/image_classification
  checks the names) applied to each image, in that order.

  Args:
    images: float [n, S, S, C].
    step: the int64 step the rows train.
    positions: int64 [n], each row's index in its global batch.
    seed: the run's --seed.
    ops: the op names.
  """
  base = tf.stack([tf.constant(seed, tf.int64), tf.cast(step, tf.int64)])
  positions = tf.cast(positions, tf.int32)
  # Draws for positions 0..max (none for no rows).
  draws = tf.maximum(tf.reduce_max(positions), -1) + 1
  for op in ops:
    op_seed = tf.random.experimental.stateless_fold_in(base, _SALT[op])
    images = (_flip if op == "flip" else _crop)(images, op_seed, positions,
                                                draws)
  return images


def _uniform(seed, k, positions, draws, *args, **kwargs):
  """[k, n]: draw k of each row, a function of (seed, k, its position)."""
  return tf.stack([tf.gather(tf.random.stateless_uniform(
      [draws], tf.random.experimental.stateless_fold_in(seed, i), *args,
      **kwargs), positions) for i in range(k)])


def _flip(images, seed, positions, draws):
  flip = _uniform(seed, 1, positions, draws)[0] < 0.5
  return tf.where(flip[:, None, None, None], tf.reverse(images, axis=[2]),
                  images)


def _crop(images, seed, positions, draws):
  size = images.shape[1]
  if size <= PAD_CROP_MAX_SIZE:
    return _pad_and_crop(images, seed, positions, draws, max(1, size // 8))
  return _resized_crop(images, seed, positions, draws)


def _pad_and_crop(images, seed, positions, draws, pad):
  """Zero-pad by `pad`, then a random window of the original size."""
  size = images.shape[1]
  padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
  offsets = _uniform(seed, 2, positions, draws, 0, 2 * pad + 1,
                     dtype=tf.int32)
  window = tf.range(size)
  rows = offsets[0][:, None] + window[None, :]  # [B, S]
  cols = offsets[1][:, None] + window[None, :]
  images = tf.gather(padded, rows, axis=1, batch_dims=1)
  return tf.gather(images, cols, axis=2, batch_dims=1)


def _resized_crop(images, seed, positions, draws):
  """A random box per image (area and aspect ratio), resized to the side."""
  batch, size = tf.shape(images)[0], images.shape[1]
  u = _uniform(seed, 4, positions, draws)
  area = _MIN_AREA + (_MAX_AREA - _MIN_AREA) * u[0]
  log_ratio = math.log(_MIN_RATIO) + (
      math.log(_MAX_RATIO) - math.log(_MIN_RATIO)) * u[1]
  ratio = tf.exp(log_ratio)
  # Box sides as fractions of the image's; clipped where the ratio would
  # take a side past the image.
  height = tf.minimum(tf.sqrt(area / ratio), 1.0)
  width = tf.minimum(tf.sqrt(area * ratio), 1.0)
  top = (1.0 - height) * u[2]
  left = (1.0 - width) * u[3]
  boxes = tf.stack([top, left, top + height, left + width], axis=1)
  return tf.image.crop_and_resize(images, boxes, tf.range(batch),
                                  [size, size])
