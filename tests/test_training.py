"""The loop on real tiny data: learning, host-loop invariance, data order."""
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from conftest import run_job, tiny_config, train_batches
from engine.errors import ConfigError


def test_loss_falls_and_accuracy_rises(tmp_path):
  result = run_job(tiny_config(
      cpu_devices=2, synthetic_examples=512, batch_size_per_replica=16,
      train_steps=120, steps_per_loop=20, log_every=20, learning_rate=0.005,
      model_dir=str(tmp_path)))
  losses, acc = result.losses, result.history["accuracy"]
  assert len(losses) == 120 and result.summary["global_step"] == 120
  assert losses[-10:].mean() < 0.6 * losses[:10].mean()
  assert acc[-10:].mean() > acc[:10].mean() + 0.3
  assert result.summary["final_accuracy"] > 0.5
  assert result.summary["examples_per_sec"] > 0


LOOP_KW = dict(cpu_devices=2, train_steps=10, log_every=5)


@pytest.fixture(scope="module")
def one_step_per_loop(tmp_path_factory):
  """The reference: host calls of one step (trained once for the module)."""
  return run_job(tiny_config(steps_per_loop=1,
                             model_dir=str(tmp_path_factory.mktemp("a")),
                             **LOOP_KW))


@pytest.mark.parametrize("steps_per_loop", [1, 4, 50])
def test_steps_per_loop_changes_nothing_and_never_retraces(
    one_step_per_loop, tmp_path, steps_per_loop):
  one = one_step_per_loop
  many = run_job(tiny_config(steps_per_loop=steps_per_loop,
                             model_dir=str(tmp_path / "b"), **LOOP_KW))
  np.testing.assert_array_equal(one.losses, many.losses)
  for a, b in zip(one.weights, many.weights):
    np.testing.assert_array_equal(a, b)
  # Host calls of 1 and of steps_per_loop steps share one trace.
  assert many.traces == 1 and one.traces == 1


def test_epochs_set_the_step_count_with_a_partial_last_batch(tmp_path):
  # 37 examples, global batch 16: 3 batches per epoch (16, 16, 5).
  result = run_job(tiny_config(
      cpu_devices=2, synthetic_examples=37, train_steps=0, epochs=2,
      model_dir=str(tmp_path)))
  assert result.summary["global_step"] == 6
  dropped = run_job(tiny_config(
      cpu_devices=2, synthetic_examples=37, train_steps=0, epochs=2,
      drop_remainder=True, model_dir=str(tmp_path / "dropped")))
  assert dropped.summary["global_step"] == 4


def _batches(config, global_batch, n, start_step=0):
  ds, info = train_batches(config, global_batch, start_step)
  return [(x.numpy(), y.numpy()) for x, y in ds.take(n)], info


def test_synthetic_data_are_seeded_and_resumable(tmp_path):
  config = tiny_config(synthetic_examples=37, model_dir=str(tmp_path))
  first, info = _batches(config, 16, 7)
  # Endless, and it says so (see engine/core/inputs.py's _endless).
  assert (train_batches(config, 16)[0].cardinality() ==
          tf.data.INFINITE_CARDINALITY)
  again, _ = _batches(config, 16, 7)
  later, _ = _batches(config, 16, 4, start_step=3)
  assert info.steps_per_epoch == 3
  assert [len(y) for _, y in first] == [16, 16, 5, 16, 16, 5, 16]
  for (x1, y1), (x2, y2) in zip(first, again):
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
  for (x1, _), (x2, _) in zip(first[3:], later):
    np.testing.assert_array_equal(x1, x2)
  # Each epoch is a permutation of the 37 examples, reshuffled per epoch.
  epoch1 = np.concatenate([y for _, y in first[:3]])
  assert np.bincount(epoch1, minlength=10).sum() == 37
  assert not np.array_equal(first[0][0], first[3][0])
  x = first[0][0]
  assert x.shape == (16, 32, 32, 3) and x.min() >= 0.0 and x.max() <= 1.0
  other, _ = _batches(tiny_config(synthetic_examples=37, seed=8,
                                  model_dir=str(tmp_path)), 16, 1)
  assert not np.array_equal(other[0][0], first[0][0])


def test_tfds_data_set_through_mock_data(tmp_path):
  with tfds.testing.mock_data(num_examples=40):
    result = run_job(tiny_config(
        dataset="tf_flowers", train_split="train[:80%]", cpu_devices=2,
        batch_size_per_replica=4, train_steps=0, epochs=2,
        model_dir=str(tmp_path)))
  summary = result.summary
  assert summary["dataset"] == "tf_flowers" and summary["num_classes"] == 5
  assert "roses" in summary["class_names"]
  assert summary["global_step"] == 10  # 40 mock examples / 8 per step * 2
  assert np.all(np.isfinite(result.losses))


def test_too_few_examples_for_one_batch(tmp_path):
  with pytest.raises(ConfigError, match=(
      r"--batch_size_per_replica=16: task image_classification has 10 "
      r"training examples, fewer than one global batch \(16\)")):
    run_job(tiny_config(synthetic_examples=10, batch_size_per_replica=16,
                            model_dir=str(tmp_path)))

