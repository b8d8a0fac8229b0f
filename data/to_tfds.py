"""Write an image folder as a TensorFlow Datasets data set (TFRecord files).

    python -m engine.data.to_tfds --dataset=folder:/path --name=my_images \
        --data_dir=/data/tfds [--num_shards=8] [--eval_fraction=0.2]

Then train with `--dataset=my_images --data_dir=/data/tfds`: tfds reads the
files without any builder code (`tfds.builder` falls back to the files).
`--eval_fraction` > 0 writes the last fraction of data/folder.py's example list
as a `test` split (tfds orders the examples of a split by a hash of their
key). `write_sample_folder` makes a folder of generated JPEG, PNG and BMP
images. Both serve benchmarks/input_pipeline.py and the tests.
"""
import os
import struct
import sys

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from engine.data import folder


def write(dataset: str, name: str, data_dir: str, num_shards: int = 1,
          eval_fraction: float = 0.0):
  """Writes folder `dataset` (folder:/path) as tfds data set `name`.

  Returns:
    The split sizes, e.g. {"train": 30, "test": 7}.

  Raises:
    ConfigError: from data/folder.py, for a bad folder.
  """
  listing = folder.list_images(dataset)
  n = len(listing.paths)
  cut = n - int(round(eval_fraction * n))
  splits = {"train": range(cut)}
  if cut < n:
    splits["test"] = range(cut, n)

  with tfds.core.registered.skip_registration():
    builder_cls = _builder_class(listing, splits)
  builder_cls.name = name
  builder = builder_cls(data_dir=data_dir)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
      num_shards=num_shards))
  return {s: len(r) for s, r in splits.items()}


def _builder_class(listing, splits):
  """A builder for one export; not registered, so names never collide."""

  class _Builder(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")
    # No source file or checksums belong to this builder; without this tfds
    # looks for them through importlib_resources, which it does not install.
    code_path = None

    def _info(self):
      return tfds.core.DatasetInfo(
          builder=self, supervised_keys=("image", "label"),
          features=tfds.features.FeaturesDict({
              "image": tfds.features.Image(shape=(None, None, 3)),
              "label": tfds.features.ClassLabel(
                  names=list(listing.class_names))}))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {s: self._generate_examples(r) for s, r in splits.items()}

    def _generate_examples(self, positions):
      for i in positions:
        path = listing.paths[i]
        # JPEG and PNG files are stored byte for byte; GIF and BMP as PNG.
        image = path if path.lower().endswith((".jpg", ".jpeg", ".png")) else (
            folder.decode(path).numpy())
        yield i, {"image": image, "label": listing.labels[i]}

  return _Builder


def _bmp(image: np.ndarray) -> bytes:
  """uint8 [H, W, 3] -> a 24-bit BMP file (TensorFlow only encodes JPEG/PNG)."""
  h, w, _ = image.shape
  row = (w * 3 + 3) // 4 * 4
  pixels = np.zeros((h, row), np.uint8)
  pixels[:, :w * 3] = image[::-1, :, ::-1].reshape(h, w * 3)  # BGR, bottom-up
  size = 54 + pixels.size
  header = (b"BM" + struct.pack("<IHHI", size, 0, 0, 54) +
            struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, pixels.size,
                        2835, 2835, 0, 0))
  return header + pixels.tobytes()


def write_sample_folder(root: str, class_names, per_class: int,
                        formats=("jpg", "png", "bmp"), size=(40, 48),
                        seed: int = 0) -> str:
  """Writes learnable images (a colour per class plus noise); returns root.

  Image j of a class is written in formats[j % len(formats)].
  """
  rng = np.random.default_rng(seed)
  colours = rng.uniform(40, 215, (len(class_names), 3))
  for k, name in enumerate(class_names):
    os.makedirs(os.path.join(root, name), exist_ok=True)
    for j in range(per_class):
      noise = rng.normal(0, 25, size + (3,))
      image = np.clip(colours[k] + noise, 0, 255).astype(np.uint8)
      fmt = formats[j % len(formats)]
      if fmt == "jpg":
        encoded = tf.io.encode_jpeg(image, quality=95).numpy()
      elif fmt == "png":
        encoded = tf.io.encode_png(image).numpy()
      else:
        encoded = _bmp(image)
      with open(os.path.join(root, name, f"{j:04d}.{fmt}"), "wb") as f:
        f.write(encoded)
  return root


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  from engine.errors import ConfigError  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  try:
    print(write(f.dataset, f.name, f.data_dir, f.num_shards, f.eval_fraction))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  from absl import app, flags  # pylint: disable=g-multiple-import
  flags.DEFINE_string("dataset", None, "folder:/path to export.")
  flags.DEFINE_string("name", None, "tfds name to write.")
  flags.DEFINE_string("data_dir", None, "tfds data directory.")
  flags.DEFINE_integer("num_shards", 1, "TFRecord files per split.")
  flags.DEFINE_float("eval_fraction", 0.0, "Last fraction as a test split.")
  flags.mark_flags_as_required(["dataset", "name", "data_dir"])
  app.run(main)
