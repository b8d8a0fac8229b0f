"""Test set-up: four logical CPU devices, configured once before TensorFlow runs.

`tiny_config` is the built-in job (engine.main's image task) at test size;
`run_job` trains it through the public API, as `python -m engine.main` does.
"""
import dataclasses
import os
import sys

import pytest

# Before any test module imports TensorFlow: the engine's TF defaults.
import engine  # noqa: F401  pylint: disable=unused-import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_CPUS = 4

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# The modules that take longest (`make test`'s --durations, 2026-12-05),
# heaviest first, then the rest in file order. pytest-xdist hands the
# collection out in this order, so both of its processes are busy with the
# long tests early instead of one waiting, at the end, for the other's last
# 40-second test. A module's tests stay together and in their order (its
# module-scoped fixtures are made once per process).
HEAVY_FIRST = (
    "test_model_matrix", "test_docs", "test_recipe", "test_input_scale",
    "test_multi_worker", "test_exits", "test_comm", "test_metric_objects",
    "test_hang", "test_checkpoint", "test_partial_batch", "test_cli",
    "test_task_contract", "test_text_classifier", "test_ema_best",
    "test_reporting", "test_examples", "test_shard_files", "test_preemption",
    "test_onednn", "test_recipe_optimizers", "test_seed_table",
    "test_packaging")


def pytest_collection_modifyitems(items):
  rank = {name: k for k, name in enumerate(HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def logical_cpus():
  """Splits the host CPU once per test process, before any test runs an op."""
  engine.configure_host(engine.Config.create(cpu_devices=NUM_CPUS))
  return NUM_CPUS


@dataclasses.dataclass(frozen=True)
class Job:
  """The engine's Config and the image task's config of one built-in job.

  Fields read by flag name from either (`job.model_dir`, `job.model`).
  """
  config: "engine.Config"
  image: object  # ImageClassificationConfig

  def __getattr__(self, name):
    flat = self.config.flat()
    if name in flat:
      return flat[name]
    return getattr(self.image, name)

  def task(self):
    from engine.tasks import image_classification  # pylint: disable=g-import-not-at-top
    return image_classification.ImageClassification(
        self.image, seed=self.config.randomness.seed)


def job(**fields) -> Job:
  """A Job from flat flag names, split between the engine and the task."""
  from engine.tasks import image_classification  # pylint: disable=g-import-not-at-top
  return Job(*image_classification.configs(**fields))


def tiny_config(**overrides) -> Job:
  """small_cnn on 32x32 synthetic images: the configuration tests start from."""
  base = dict(model="small_cnn", dataset="synthetic", image_size=32,
              synthetic_examples=256, batch_size_per_replica=8, epochs=1,
              train_steps=6, steps_per_loop=3, log_every=3, seed=7,
              export=False)  # the export tests turn it on
  base.update(overrides)
  return job(**base)


def run_job(j: Job, hooks=()):
  """Trains the built-in job through the public API; returns engine.Result."""
  return engine.run(j.task(), j.config, hooks=hooks)


def engine_cmd(*flags):
  """The CLI as users run it, with this interpreter."""
  return [sys.executable, "-m", "engine.main", *flags]


def read_scalars(run_dir):
  """{tag: {step: value}} from every event file in `run_dir`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  out = {}
  for name in os.listdir(run_dir):
    for record in tf.data.TFRecordDataset(os.path.join(run_dir, name)):
      event = event_pb2.Event.FromString(record.numpy())
      for v in event.summary.value:
        out.setdefault(v.tag, {})[event.step] = float(
            tf.make_ndarray(v.tensor))
  return out


def train_batches(j: Job, global_batch: int, start_step: int = 0,
                  with_rows: bool = False):
  """(the built-in job's training batches from `start_step`, its TrainData);
  `with_rows`: as the train step takes them, (features, labels, rows)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.core import inputs  # pylint: disable=g-import-not-at-top
  data = inputs.TrainData(j.task(), tf.distribute.InputContext(),
                          j.config.data, global_batch, j.config.randomness.seed)
  return data.batches(start_step, with_rows), data


def eval_batches(j: Job, global_batch: int):
  """(the built-in job's evaluation batches, their example count)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.core import inputs  # pylint: disable=g-import-not-at-top
  data = inputs.eval_inputs(j.task(), tf.distribute.InputContext(),
                            global_batch)
  return data.batches(), data.num_examples


def conv_bn_task(examples: int, filters, strides: int = 1,
                 name: str = "conv_bn"):
  """A user's task of convolutions each with BatchNormalization: `examples`
  random 8x8 images of 3 classes; one Conv2D (3x3, `strides`) + BN + ReLU per
  entry of `filters`, global average pooling, a Dense head. With strides 2
  and three layers the last maps are 1x1, as in MobileNetV2's last layers."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  images = rng.normal(size=(examples, 8, 8, 3)).astype(np.float32)
  labels = rng.integers(0, 3, size=examples).astype(np.int32)

  def model():
    x = inputs = keras.Input((8, 8, 3))
    for width in filters:
      x = keras.layers.Conv2D(width, 3, strides=strides, padding="same",
                              use_bias=False)(x)
      x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))

  return engine.Task(
      model=model, name=name,
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          (images, labels)),
      loss=lambda y, logits: keras.losses.sparse_categorical_crossentropy(
          y, logits, from_logits=True))
