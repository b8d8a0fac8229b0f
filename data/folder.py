"""`--dataset=folder:/path`: your own images, one sub-directory per class.

Class names are the sub-directory names, sorted; the label of a class is its
index in that order. Images are JPEG, PNG, GIF (first frame) or BMP, found by
extension (case-insensitive) anywhere under a class directory; other files are
ignored. The example list is deterministic: the files of each class sorted by
path, then interleaved round-robin across classes (file 0 of every class, then
file 1, ...), so a split slice such as `train[:80%]` keeps the class balance
(see data/splits.py).

At start-up every image is decoded once, in parallel, so a corrupt or truncated
file stops the run with its name before training, instead of mid-epoch.
"""
import dataclasses
import functools
import os
from typing import Tuple

from absl import logging
import numpy as np
import tensorflow as tf

from engine.errors import flag_error

PREFIX = "folder:"
EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


@dataclasses.dataclass(frozen=True)
class Listing:
  """The example list of a folder: paths[i] has label labels[i]."""
  class_names: Tuple[str, ...]
  paths: Tuple[str, ...]
  labels: Tuple[int, ...]


def is_folder(dataset: str) -> bool:
  return dataset.startswith(PREFIX)


def root_of(dataset: str) -> str:
  return dataset[len(PREFIX):]


def _images_under(directory: str):
  found = []
  for parent, dirs, files in os.walk(directory):
    dirs.sort()
    found += [os.path.join(parent, f) for f in files
              if f.lower().endswith(EXTENSIONS)]
  return sorted(found)


def list_images(dataset: str) -> Listing:
  """The folder's classes and example list, checked and scanned.

  Raises:
    ConfigError: not a directory, fewer than two classes, a class without
      images, or an image that cannot be decoded.
  """
  root = root_of(dataset)
  if not os.path.isdir(root):
    raise flag_error("dataset", dataset, "is not a directory; pass "
                     "folder:/path/to/images with one sub-directory per class.")
  class_names = tuple(sorted(
      d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))))
  if len(class_names) < 2:
    found = ", ".join(class_names) or "none"
    raise flag_error("dataset", dataset,
                     f"needs one sub-directory per class and at least 2 "
                     f"classes; found {len(class_names)} ({found}).")
  per_class = [_images_under(os.path.join(root, c)) for c in class_names]
  empty = [c for c, files in zip(class_names, per_class) if not files]
  if empty:
    raise flag_error("dataset", dataset,
                     f"class directory {empty[0]!r} has no images "
                     f"({'/'.join(EXTENSIONS)}); add images or remove it.")
  paths, labels = [], []
  for k in range(max(len(files) for files in per_class)):
    for label, files in enumerate(per_class):
      if k < len(files):
        paths.append(files[k])
        labels.append(label)
  listing = Listing(class_names, tuple(paths), tuple(labels))
  stamp = tuple((os.path.getsize(p), os.path.getmtime(p)) for p in paths)
  bad = _undecodable(listing.paths, stamp)
  if bad:
    raise flag_error("dataset", dataset,
                     f"cannot decode {len(bad)} of {len(paths)} images, e.g. "
                     f"{bad[0]} (corrupt, truncated or not an image); fix or "
                     "remove them.")
  logging.info("Folder %s: %d images in %d classes.", root, len(paths),
               len(class_names))
  return listing


@functools.lru_cache(maxsize=4)
def _undecodable(paths: Tuple[str, ...], stamp) -> Tuple[str, ...]:
  """Files that fail to decode; cached per file list, sizes and times.

  Failing elements are dropped by `ignore_errors`; the paths that do not come
  out are the bad ones (tf.data cannot report which element failed).
  """
  del stamp  # part of the cache key only: a changed file is scanned again
  ok = tf.data.Dataset.from_tensor_slices(list(paths)).map(
      lambda p: (p, tf.shape(decode(p))[0]),
      num_parallel_calls=tf.data.AUTOTUNE).ignore_errors()
  good = {p.decode() for p, _ in ok.as_numpy_iterator()}
  return tuple(p for p in paths if p not in good)


def decode(path):
  """An image file -> uint8 [H, W, 3], whatever its format."""
  return tf.io.decode_image(tf.io.read_file(path), channels=3,
                            expand_animations=False)


def examples(listing: Listing, positions: np.ndarray,
             image_size: int) -> tf.data.Dataset:
  """Decoded, resized images in [0, 1] with int32 labels, in list order."""
  paths = np.array(listing.paths)[positions]
  labels = np.array(listing.labels, np.int32)[positions]

  def load(path, label):
    image = tf.image.resize(decode(path), [image_size, image_size])
    return image / 255.0, label

  return tf.data.Dataset.from_tensor_slices((paths, labels)).map(
      load, num_parallel_calls=tf.data.AUTOTUNE)


def source(config, split: str, flag: str, *, seed: int, training: bool,
           num_workers: int = 1):
  """(examples, count, class names, auto-shard policy) of one split.

  DATA sharding: the images are not a file-reader source tf.data could shard
  by file, so every worker reads the list and keeps its slice of each batch.
  """
  del training, num_workers, seed  # the order is fixed; the engine shuffles
  from data import splits  # pylint: disable=g-import-not-at-top
  listing = list_images(config.dataset)
  positions = splits.select(split, len(listing.paths), flag)
  return (examples(listing, positions, config.image_size), len(positions),
          listing.class_names, tf.data.experimental.AutoShardPolicy.DATA)
