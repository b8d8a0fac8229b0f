"""Evaluation: the distributed pass equals Keras `evaluate`, on schedule."""
import dataclasses
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import data
import models
from conftest import tiny_config
from engine import train
from engine.errors import ConfigError

# 37 examples in batches of 8 or 9: the last eval batch is partial, and with
# 3 replicas a batch of 1 leaves two replicas without examples.
EXAMPLES = 37


def keras_evaluate(config, weights, global_batch, num_classes=None):
  """Plain Keras on the same weights and the same (undistributed) data."""
  model = models.create_model(config.model, num_classes or config.num_classes,
                              config.image_size)
  model.set_weights(weights)
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), metrics=["accuracy"])
  dataset, count = data.build_eval(config, global_batch)
  # Told the batch count, Keras does not warn when the pass ends.
  dataset = dataset.apply(tf.data.experimental.assert_cardinality(
      -(-count // global_batch)))
  loss, accuracy = model.evaluate(dataset, verbose=0)
  return loss, accuracy, count


@pytest.mark.parametrize("strategy,replicas", [("one_device", 0),
                                               ("mirrored", 3)])
def test_eval_metrics_equal_keras_evaluate(tmp_path, strategy, replicas):
  config = tiny_config(strategy=strategy, cpu_devices=replicas,
                       batch_size_per_replica=9 if replicas else 8,
                       synthetic_examples=EXAMPLES, train_split="train[:30]",
                       eval_split="train", train_steps=4,
                       model_dir=str(tmp_path))
  result = train.train(config)
  s = result.summary
  assert s["eval_examples"] == EXAMPLES
  loss, accuracy, count = keras_evaluate(config, result.weights,
                                         s["global_batch_size"])
  assert count == EXAMPLES
  np.testing.assert_allclose(s["eval_loss"], loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s["eval_accuracy"], accuracy, atol=1e-5)
  # Not trivially equal: trained weights differ from a fresh model's.
  assert 0.0 < s["eval_loss"] < 10.0


def test_eval_schedule_and_log(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  # 37 training examples, global batch 8: 5 steps per epoch.
  config = tiny_config(cpu_devices=2, batch_size_per_replica=4,
                       synthetic_examples=EXAMPLES, eval_split="train[80%:]",
                       train_steps=12, model_dir=str(tmp_path / "epoch"))
  train.train(config)
  steps = [r.getMessage().split()[3] for r in caplog.records
           if r.getMessage().startswith("eval at step")]
  assert steps == ["5", "10", "12"]  # each epoch's end, and the last step
  caplog.clear()
  result = train.train(dataclasses.replace(
      config, eval_every=4, model_dir=str(tmp_path / "n")))
  lines = [r.getMessage() for r in caplog.records
           if r.getMessage().startswith("eval at step")]
  assert [l.split()[3] for l in lines] == ["4", "8", "12"]
  assert lines[-1].endswith("| 7 examples")  # 37 - round(0.8 * 37) = 7
  assert result.summary["eval_examples"] == 7
  assert f"{result.summary['eval_loss']:.4f}" in lines[-1]


def test_no_eval_split_means_no_evaluation(tmp_path):
  result = train.train(tiny_config(model_dir=str(tmp_path)))
  assert result.summary["eval_loss"] is None
  assert result.summary["eval_accuracy"] is None


def test_unknown_eval_split_is_refused_before_training(tmp_path):
  with pytest.raises(ConfigError, match=r"^--eval_split=test: is not a split"):
    train.train(tiny_config(eval_split="test", model_dir=str(tmp_path)))
