"""Decoding one replica's rows of a batch, skipping images that cannot be.

The engine hands a task's `preprocess_batch` each worker's own rows of every
global batch (engine/core/inputs.py), so the images of a batch are decoded
here, by the worker that trains on them, and nowhere else. A row whose image
cannot be decoded (corrupt, truncated, not an image) comes back as zeros
with `keep` False, for the engine to drop after any augmentation (so every
other row keeps its place in the batch), named on stderr (`warning: skipped
image(s) that cannot be decoded: [...]`) the first time its pipeline meets
it (every epoch and every evaluation pass meets it again, and prefetching
meets it ahead; summary.json's `skipped_images` counts every skip), and
the step's loss is the mean over the rows left: the engine counts the
examples really in a batch, so the drop weighs the same on any number of
replicas or workers. With `strict`, the first such row is an error instead
(`STRICT_MARKER` + its name; the engine turns it into one `error:` line).

`counter` counts decoded rows per source, when a test or benchmark turns it
on: it shows that N workers each decode 1/N of the images.
"""
import collections
import sys
import threading

import tensorflow as tf

STRICT_MARKER = "--strict_images: cannot decode"


class _Counter:
  """Rows decoded per source in this process; off unless `enabled`."""

  def __init__(self):
    self.enabled = False
    self.counts = collections.Counter()

  def reset(self):
    self.counts.clear()

  def _add(self, source, n):
    self.counts[source] += int(n)
    return n

  def count(self, source: str, n: tf.Tensor) -> None:
    """Adds `n` rows to `source` when the graph runs (if enabled at trace)."""
    if self.enabled:
      tf.py_function(lambda v: self._add(source, v.numpy()), [n], tf.int32)


counter = _Counter()


class _Named:
  """The skipped images one pipeline has named: each is named once."""

  def __init__(self):
    self._lock = threading.Lock()  # tf.data's map calls run in parallel
    self.seen = set()

  def name_new(self, names: tf.Tensor) -> None:
    """Prints the names not printed before (a py_function's body)."""
    with self._lock:
      new = [n for n in (v.decode("utf-8", "replace") for v in names.numpy())
             if n not in self.seen]
      self.seen.update(new)
    if new:
      # stderr, not TensorFlow's log, which TF_CPP_MIN_LOG_LEVEL silences.
      print("warning: skipped image(s) that cannot be decoded: "
            f"[{', '.join(repr(n) for n in new)}]", file=sys.stderr,
            flush=True)


def decode_rows(items, labels, image_size: int, *, from_files: bool,
                strict: bool, source: str):
  """(images float32 [n, S, S, 3] in [0, 1], labels [n], keep bool [n]).

  A row that cannot be decoded has zeros and `keep` False.

  Args:
    items: string [n]: file paths (`from_files`) or encoded image bytes.
    labels: int32 [n].
    image_size: side S the images are resized to.
    from_files: `items` are paths, read here (and named when skipped).
    strict: an undecodable row raises instead of being skipped.
    source: the counter's name for these rows.
  """
  n = tf.shape(labels)[0]
  counter.count(source, n)

  def load(i, item):
    encoded = tf.io.read_file(item) if from_files else item
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    image = tf.image.resize(image, [image_size, image_size]) / 255.0
    return i, image

  # A decode error ends only its own row: `ignore_errors` drops it. The
  # rows that came out say which went missing.
  # Sequential: the engine's map runs batches in parallel; a parallel map
  # here would start threads for every batch (measured: about 6% more CPU
  # per image, benchmarks/RESULTS.md).
  rows = tf.data.Dataset.from_tensor_slices((tf.range(n), items)).map(
      load).ignore_errors()
  empty = tf.data.Dataset.from_tensors(
      (tf.zeros([0], tf.int32), tf.zeros([0, image_size, image_size, 3])))
  # One element always: the decoded rows, or none at all.
  kept, images = rows.batch(tf.maximum(tf.cast(n, tf.int64), 1)).concatenate(
      empty).take(1).get_single_element()
  lost = tf.sparse.to_dense(tf.sets.difference(
      tf.range(n)[None], kept[None]))[0]
  names = tf.gather(items, lost) if from_files else tf.strings.as_string(lost)
  if strict:
    check = tf.debugging.Assert(tf.size(lost) == 0, [STRICT_MARKER, names[:1]],
                                summarize=1)
  else:
    named = _Named()  # made once per pipeline, when tf.data traces this
    check = tf.cond(
        tf.size(lost) > 0,
        lambda: tf.py_function(named.name_new, [names], []),
        tf.no_op)
  where = kept[:, None]
  with tf.control_dependencies([check]):
    return (tf.scatter_nd(where, images, [n, image_size, image_size, 3]),
            tf.identity(labels),
            tf.scatter_nd(where, tf.ones_like(kept, tf.bool), [n]))
