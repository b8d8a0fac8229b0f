"""Any TensorFlow Datasets data set by name, with the seed's preprocessing."""
import tensorflow as tf
import tensorflow_datasets as tfds

from data import DataInfo, check_size, finish, steps_per_epoch
from engine.config import Config
from engine.errors import flag_error


def _builder(config: Config):
  try:
    return tfds.builder(config.dataset, data_dir=config.data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise flag_error(
        "dataset", config.dataset,
        "is neither 'synthetic' nor a TensorFlow Datasets name (see "
        "`tfds.list_builders()`, e.g. cats_vs_dogs, tf_flowers, mnist)."
    ) from e


def _read(builder, config: Config) -> tf.data.Dataset:
  try:
    return builder.as_dataset(
        split=config.train_split, as_supervised=True, shuffle_files=True,
        read_config=tfds.ReadConfig(shuffle_seed=config.seed))
  except (KeyError, ValueError, AssertionError) as e:
    raise flag_error("train_split", config.train_split,
                     f"is not a split of {config.dataset} "
                     f"({type(e).__name__}: {str(e).splitlines()[0][:160]})."
                     ) from e


def _count(builder, config: Config) -> int:
  """Examples in the split: from the reader if it knows, else from metadata."""
  cardinality = int(_read(builder, config).cardinality())
  if cardinality >= 0:
    return cardinality
  return builder.info.splits[config.train_split].num_examples


def build(config: Config, global_batch: int, start_step: int = 0):
  builder = _builder(config)
  if not builder.is_prepared():
    if not config.download:
      raise flag_error("dataset", config.dataset,
                       f"is not prepared in {builder.data_dir} and --nodownload"
                       " was given; run `tfds build` or allow the download.")
    try:
      builder.download_and_prepare()
    except Exception as e:  # network errors come in many types; all are fatal
      raise flag_error("dataset", config.dataset,
                       f"download failed ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}); prepare it with "
                       "`tfds build` and pass --data_dir.") from e
  info = builder.info
  if "label" not in info.features or "image" not in info.features:
    raise flag_error("dataset", config.dataset,
                     "has no 'image' and 'label' features; only image "
                     "classification data sets are supported.")
  num_examples = _count(builder, config)
  check_size(config.dataset, num_examples, global_batch)
  label = info.features["label"]
  size = config.image_size

  def preprocess(image, label_value):
    # The seed's preprocessing: resize, then scale to [0, 1].
    if image.shape[-1] == 1:
      image = tf.image.grayscale_to_rgb(image)
    image = tf.image.resize(image, [size, size]) / 255.0
    return image, tf.cast(label_value, tf.int32)

  ds = _read(builder, config)
  ds = ds.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.shuffle(config.shuffle_buffer, seed=config.seed,
                  reshuffle_each_iteration=True)
  ds = ds.batch(global_batch, drop_remainder=config.drop_remainder).repeat()
  ds = ds.skip(start_step)
  data_info = DataInfo(
      name=config.dataset, num_examples=num_examples,
      num_classes=label.num_classes, class_names=tuple(label.names),
      steps_per_epoch=steps_per_epoch(num_examples, global_batch,
                                      config.drop_remainder))
  # DATA sharding: every worker reads the same seeded order and keeps its own
  # slice of each global batch, so results do not depend on the file count.
  return finish(ds, tf.data.experimental.AutoShardPolicy.DATA), data_info
