"""`--dataset=folder:/path`: your own images, one sub-directory per class.

Class names are the sub-directory names, sorted; the label of a class is its
index in that order. Images are JPEG, PNG, GIF (first frame) or BMP, found by
extension (case-insensitive) anywhere under a class directory; other files are
ignored. The example list is deterministic: the files of each class sorted by
path, then interleaved round-robin across classes (file 0 of every class, then
file 1, ...), so a split slice such as `train[:80%]` keeps the class balance
(see data/splits.py).

Start-up only lists the files (data/listing.py caches the list); nothing is
decoded until a worker decodes its own rows of a batch (data/decode.py),
where an image that cannot be decoded is skipped and named, or, with
--strict_images, stops the run.

A folder whose top level is `train/` plus `val/`, `validation/` or `test/`
holds two data sets: `--train_split` reads `train/`, the evaluation reads the
other (`split_dirs`).
"""
import os
from typing import Optional, Tuple

from absl import logging
import numpy as np
import tensorflow as tf

from engine.data import listing as cache
from engine.data.listing import Listing
from engine.errors import flag_error

PREFIX = "folder:"
EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")
TRAIN_DIR = "train"
EVAL_DIRS = ("val", "validation", "test")  # the first one present is used


def is_folder(dataset: str) -> bool:
  return dataset.startswith(PREFIX)


def root_of(dataset: str) -> str:
  return dataset[len(PREFIX):]


def split_dirs(root: str) -> Optional[Tuple[str, str]]:
  """(train dir, eval dir) of a `train/` + `val/` folder, else None."""
  if not os.path.isdir(os.path.join(root, TRAIN_DIR)):
    return None
  for name in EVAL_DIRS:
    if os.path.isdir(os.path.join(root, name)):
      return os.path.join(root, TRAIN_DIR), os.path.join(root, name)
  return None


def _images_under(directory: str, dirs_seen: list):
  """Image paths under `directory`, sorted; appends (dir, mtime) per
  directory read, the time taken before its entries are, so a change made
  while listing shows as a changed time next run."""
  found, todo = [], [directory]
  while todo:
    parent = todo.pop()
    dirs_seen.append((parent, os.stat(parent).st_mtime_ns))
    with os.scandir(parent) as entries:
      for entry in entries:
        if entry.is_dir():
          todo.append(entry.path)
        elif entry.name.lower().endswith(EXTENSIONS):
          found.append(entry.path)
  return sorted(found)


def scan(root: str, flag: str, value: str):
  """(Listing, directories read): the files, not their contents.

  Raises:
    ConfigError: not a directory, fewer than two classes or a class
      without images.
  """
  if not os.path.isdir(root):
    raise flag_error(flag, value, "is not a directory; pass "
                     "folder:/path/to/images with one sub-directory per class.")
  root_time = os.stat(root).st_mtime_ns
  class_names = tuple(sorted(
      d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))))
  if len(class_names) < 2:
    found = ", ".join(class_names) or "none"
    raise flag_error(flag, value,
                     f"needs one sub-directory per class and at least 2 "
                     f"classes; found {len(class_names)} ({found}).")
  dirs_seen = [(root, root_time)]
  per_class = [_images_under(os.path.join(root, c), dirs_seen)
               for c in class_names]
  empty = [c for c, files in zip(class_names, per_class) if not files]
  if empty:
    raise flag_error(flag, value,
                     f"class directory {empty[0]!r} has no images "
                     f"({'/'.join(EXTENSIONS)}); add images or remove it.")
  paths, labels = [], []
  for k in range(max(len(files) for files in per_class)):
    for label, files in enumerate(per_class):
      if k < len(files):
        paths.append(files[k])
        labels.append(label)
  return Listing(class_names, tuple(paths), tuple(labels)), dirs_seen


def list_images(dataset: str, cache_dir: Optional[str] = None,
                write_cache: bool = True, root: Optional[str] = None,
                flag: str = "dataset") -> Listing:
  """The folder's classes and example list (listed, or from the cache).

  Args:
    dataset: folder:/path, named in errors.
    cache_dir: where the listing is cached (the run's model_dir); None: off.
    write_cache: whether this process may write the cache (the chief).
    root: the directory to list (default: the dataset's path).
    flag: the flag named in errors.

  Raises:
    ConfigError: see `scan`.
  """
  root = os.path.abspath(root or root_of(dataset))
  found = cache.load(cache_dir, root)
  if found is None:
    found, dirs = scan(root, flag, dataset)
    if cache_dir and write_cache:
      cache.save(cache_dir, root, found, dirs)
  logging.info("Folder %s: %d images in %d classes.", root, len(found.paths),
               len(found.class_names))
  return found


def decode(path):
  """An image file -> uint8 [H, W, 3], whatever its format."""
  return tf.io.decode_image(tf.io.read_file(path), channels=3,
                            expand_animations=False)


def examples(listing: Listing, positions: np.ndarray) -> tf.data.Dataset:
  """(path, int32 label) in list order: cheap to shuffle and batch; the
  task decodes each worker's rows of a batch (data/decode.py)."""
  paths = np.array(listing.paths)[positions]
  labels = np.array(listing.labels, np.int32)[positions]
  return tf.data.Dataset.from_tensor_slices((paths, labels))


def source(config, split: str, flag: str, *, seed: int, training: bool,
           num_workers: int = 1, cache_dir: Optional[str] = None,
           write_cache: bool = True):
  """(paths with labels, count, class names, auto-shard policy) of a split.

  A `train/` + `val/` folder: training reads `train/`, evaluation the
  other directory (whole), their class lists checked to agree.
  """
  del num_workers, seed  # the order is fixed; the engine shuffles
  from engine.data import splits  # pylint: disable=g-import-not-at-top
  root = root_of(config.dataset)
  both = split_dirs(os.path.abspath(root)) if os.path.isdir(root) else None
  if both is None:
    listing = list_images(config.dataset, cache_dir, write_cache)
    positions = splits.select(split, len(listing.paths), flag)
  else:
    train = list_images(config.dataset, cache_dir, write_cache, both[0])
    listing = train
    if not training:
      listing = list_images(config.dataset, cache_dir, write_cache, both[1])
      check_same_classes(train.class_names, listing.class_names,
                         "dataset", config.dataset, both)
    # The split expression selects within the chosen directory.
    positions = splits.select(split, len(listing.paths), flag)
  return (examples(listing, positions), len(positions), listing.class_names,
          tf.data.experimental.AutoShardPolicy.DATA)


def check_same_classes(train, other, flag, value, dirs):
  """Raises a one-line ConfigError naming the first class one side lacks."""
  if tuple(train) == tuple(other):
    return
  for name in train:
    if name not in other:
      raise flag_error(flag, value, f"class {name!r} is in {dirs[0]} but "
                       f"missing from {dirs[1]}; both need the same classes.")
  missing = next(n for n in other if n not in train)
  raise flag_error(flag, value, f"class {missing!r} is in {dirs[1]} but "
                   f"missing from {dirs[0]}; both need the same classes.")
