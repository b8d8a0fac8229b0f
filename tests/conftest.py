"""Test set-up: four logical CPU devices, configured once before TensorFlow runs."""
import os
import sys

import pytest

# Before any test module imports TensorFlow: the engine's TF defaults.
import engine  # noqa: F401  pylint: disable=unused-import

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_CPUS = 4

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="session", autouse=True)
def logical_cpus():
  """Splits the host CPU once per test process, before any test runs an op."""
  from engine import devices  # pylint: disable=g-import-not-at-top
  devices.configure_host(NUM_CPUS)
  return NUM_CPUS


def tiny_config(**overrides):
  """small_cnn on 32x32 synthetic images: the configuration tests start from."""
  from engine.config import Config  # pylint: disable=g-import-not-at-top
  base = dict(model="small_cnn", dataset="synthetic", image_size=32,
              synthetic_examples=256, batch_size_per_replica=8, epochs=1,
              train_steps=6, steps_per_loop=3, log_every=3, seed=7,
              export=False)  # the export tests turn it on
  base.update(overrides)
  return Config(**base)


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
