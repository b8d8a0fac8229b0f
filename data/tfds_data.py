"""Any TensorFlow Datasets data set by name, with the seed's preprocessing."""
import tensorflow as tf
import tensorflow_datasets as tfds

from engine.errors import flag_error


def _builder(config):
  try:
    return tfds.builder(config.dataset, data_dir=config.data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise flag_error(
        "dataset", config.dataset,
        "is neither 'synthetic' nor folder:/path nor a TensorFlow Datasets "
        "name (see `tfds.list_builders()`, e.g. cats_vs_dogs, tf_flowers)."
    ) from e


def _read(builder, config, split: str, flag: str, training: bool,
          seed: int) -> tf.data.Dataset:
  try:
    return builder.as_dataset(
        split=split, as_supervised=True, shuffle_files=training,
        # Encoded bytes: each worker decodes only its own rows of a batch
        # (data/decode.py), not every image of every batch.
        decoders={"image": tfds.decode.SkipDecoding()},
        # No assert_cardinality: the auto-shard rewrite cannot handle it and
        # warns; the count comes from the metadata instead. The file order
        # is a function of the seed only, the same in every pass: a resumed
        # run (whose first pass is a later epoch) reads the files as the
        # uninterrupted one did; the engine shuffles per epoch.
        read_config=tfds.ReadConfig(shuffle_seed=seed,
                                    shuffle_reshuffle_each_iteration=False,
                                    assert_cardinality=False))
  except (KeyError, ValueError, AssertionError) as e:
    raise flag_error(flag, split,
                     f"is not a split of {config.dataset} "
                     f"({type(e).__name__}: {str(e).splitlines()[0][:160]})."
                     ) from e


def _prepared(config):
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
  return builder


def _policy(builder, split: str, num_workers: int, training: bool = False):
  """FILE when every worker can get its own files, else DATA.

  FILE: each worker reads only its files, so no worker decodes images it then
  throws away; workers may then see different numbers of batches per epoch
  (training repeats endlessly, and the eval pass is built for it). DATA: every
  worker reads everything and keeps its slice of each global batch. Choosing
  explicitly means tf.data never falls back with an AutoShardPolicy warning.
  A training split is FILE on one worker too: the engine reads it by files
  only under --shard_files (engine/core/sharded_inputs.py), where one worker
  reads them all; otherwise it sets DATA on its own global batches.
  """
  policy = tf.data.experimental.AutoShardPolicy
  try:
    files = len(builder.info.splits[split].file_instructions)
  except KeyError:  # no split metadata (e.g. under tfds.testing.mock_data)
    files = 0
  fewest = 1 if training else 2
  return policy.FILE if fewest <= num_workers <= files else policy.DATA


def source(config, split: str, flag: str, *, seed: int, training: bool,
           num_workers: int = 1):
  """(encoded images, count, class names, auto-shard policy) of a split.

  The task decodes and resizes each worker's rows (data/decode.py), as the
  seed did per example: decode, resize, scale to [0, 1].

  Raises:
    ConfigError: unknown data set or split, or one that cannot be prepared.
  """
  builder = _prepared(config)
  ds = _read(builder, config, split, flag, training, seed)
  count = int(ds.cardinality())
  if count < 0:  # the reader does not know: take the metadata's count
    count = builder.info.splits[split].num_examples
  ds = ds.map(lambda image, label: (image, tf.cast(label, tf.int32)))
  names = builder.info.features["label"].names
  return ds, count, names, _policy(builder, split, num_workers, training)
