"""Evaluation: the distributed pass equals Keras `evaluate`, on schedule."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import eval_batches, read_scalars, run_job, tiny_config
from engine import models
from engine.core import evaluate, inputs, step
from engine.distribute import strategy as strategy_lib
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
  dataset, count = eval_batches(config, global_batch)
  # Told the batch count, Keras does not warn when the pass ends.
  dataset = dataset.apply(tf.data.experimental.assert_cardinality(
      -(-count // global_batch)))
  loss, accuracy = model.evaluate(dataset, verbose=0)
  return loss, accuracy, count


@pytest.mark.parametrize("strategy,replicas", [("one_device", 0),
                                               ("mirrored", 3)])
def test_eval_metrics_equal_keras_evaluate(tmp_path, strategy, replicas):
  config = tiny_config(strategy=strategy, cpu_devices=replicas,
                       batch_size_per_replica=3 if replicas else 8,
                       synthetic_examples=EXAMPLES, train_split="train[:30]",
                       eval_split="train", train_steps=4,
                       model_dir=str(tmp_path))
  result = run_job(config)
  s = result.summary
  assert s["eval_examples"] == EXAMPLES
  loss, accuracy, count = keras_evaluate(config, result.weights,
                                         s["global_batch_size"])
  assert count == EXAMPLES
  np.testing.assert_allclose(s["eval_loss"], loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s["eval_accuracy"], accuracy, atol=1e-5)
  # Not trivially equal: trained weights differ from a fresh model's.
  assert 0.0 < s["eval_loss"] < 10.0


def test_passes_reuse_one_iterator_and_agree():
  # A new distributed iterator per pass leaked memory: every pass reads on
  # from the one iterator over the passes repeated, each exactly 5 batches
  # (the last partial, 5 rows as 3 and 2 on 2 replicas), so it stays aligned.
  config = tiny_config(strategy="mirrored", cpu_devices=2,
                       batch_size_per_replica=4, synthetic_examples=EXAMPLES,
                       eval_split="train")
  strategy = strategy_lib.make_strategy(config.config.distribution)
  task = config.task()
  data = inputs.eval_inputs(task, inputs.input_context(strategy), 8)
  with strategy.scope():
    model = task.build_model()
  evaluator = evaluate.Evaluator(
      strategy, step.resolve(task, model, data.element_spec), model, data)
  iterator = evaluator._iterator  # pylint: disable=protected-access
  results = [evaluator.evaluate() for _ in range(3)]
  assert evaluator._iterator is iterator  # pylint: disable=protected-access
  assert evaluator.traces == 1
  assert results[0]["eval_examples"] == EXAMPLES
  assert results[1] == results[0] and results[2] == results[0]


class CountingEvaluator:
  """Stands in for Evaluator where only the schedule is under test."""

  def __init__(self):
    self.calls = 0
    self.released = 0

  def evaluate(self):
    assert not self.released, "evaluated after release()"
    self.calls += 1
    return {"eval_loss": 1.0 / self.calls, "eval_accuracy": 0.5,
            "eval_examples": 7}

  def release(self):
    self.released += 1


@pytest.mark.parametrize("eval_every,expected", [(0, [5, 10, 12]),
                                                 (4, [4, 8, 12])])
def test_eval_schedule(eval_every, expected):
  # 5 steps per epoch (37 examples, global batch 8), 12 steps: eval_every=0
  # means each epoch's end; the last step is always evaluated.
  config = tiny_config(synthetic_examples=EXAMPLES, eval_split="train",
                       eval_every=eval_every)
  evaluator = CountingEvaluator()
  hook = evaluate.EvalHook(evaluator, config.eval_every or 5, 12)
  step = 0
  while step < 12:  # the outer loop's contract: stop where a hook asks
    step = min(step + 3, hook.next_stop(step))
    hook.after_loop(step, None, 0.0)
  assert [s for s, _ in hook.results] == expected
  summary = {"global_step": 12}
  hook.end(summary)
  assert summary["eval_loss"] == 1.0 / 3 and len(hook.results) == 3
  assert evaluator.released == 1  # its iterator goes once the run ends


def test_eval_every_steps_in_a_real_run(tmp_path):
  result = run_job(tiny_config(
      cpu_devices=2, batch_size_per_replica=4, synthetic_examples=EXAMPLES,
      eval_split="train[80%:]", eval_every=4, train_steps=12,
      model_dir=str(tmp_path)))
  # Each evaluation also lands in model_dir/eval (TensorBoard). The events,
  # not the log, are checked: other tests' libraries may reroute absl logs.
  scalars = read_scalars(tmp_path / "eval")
  assert sorted(scalars["loss"]) == [4, 8, 12]
  assert scalars["examples"] == {4: 7, 8: 7, 12: 7}  # 37 - round(0.8 * 37)
  assert result.summary["eval_examples"] == 7
  assert scalars["loss"][12] == pytest.approx(result.summary["eval_loss"],
                                              rel=1e-6)


def test_no_eval_split_means_no_evaluation(tmp_path):
  result = run_job(tiny_config(model_dir=str(tmp_path)))
  assert result.summary["eval_loss"] is None
  assert result.summary["eval_accuracy"] is None


def test_unknown_eval_split_is_refused_before_training(tmp_path):
  with pytest.raises(ConfigError, match=r"^--eval_split=test: is not a split"):
    run_job(tiny_config(eval_split="test", model_dir=str(tmp_path)))
