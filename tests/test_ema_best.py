"""--ema_decay, --keep_best and --early_stopping_patience: values, replica
parity, exact resume, the files kept."""
import json
import os

import keras
import numpy as np
import pytest

from callback_job import StopAfter
from conftest import read_scalars, run_job, tiny_config
import engine
from engine.core import best
from test_eval import keras_evaluate
import test_multi_worker as mw

GLOBAL_BATCH = 16
# sgd at 3.0 on this tiny job: the eval loss (of the averaged weights) falls
# at steps 2, 4, 6, rises at 8 and 10, and is lowest at step 14 of 16.
RECIPE = dict(optimizer="sgd", learning_rate=3.0, ema_decay=0.8,
              synthetic_examples=64, eval_split="train[:32]", eval_every=2,
              steps_per_loop=2)


def recipe(tmp, replicas=1, **kw):
  fields = dict(RECIPE, strategy="one_device" if replicas == 1 else
                "mirrored", cpu_devices=0 if replicas == 1 else replicas,
                batch_size_per_replica=GLOBAL_BATCH // replicas,
                model_dir=str(tmp))
  fields.update(kw)
  return tiny_config(**fields)


def engine_run(job, callbacks):
  return engine.run(job.task(), job.config, callbacks=callbacks)


class WeightsAfterEachCall(keras.callbacks.Callback):
  def __init__(self):
    super().__init__()
    self.weights = []

  def on_train_batch_end(self, batch, logs=None):
    self.weights.append([v.numpy() for v in self.model.trainable_variables])


def test_ema_is_the_average_computed_by_hand(tmp_path):
  decay = 0.7
  config = tiny_config(ema_decay=decay, steps_per_loop=1, train_steps=4,
                       learning_rate=0.01, eval_split="train[:24]",
                       model_dir=str(tmp_path))
  seen = WeightsAfterEachCall()
  result = engine_run(config, [seen])
  assert len(seen.weights) == 4  # one host call per step
  want = seen.weights[0]  # the first update copies the weights
  for weights in seen.weights[1:]:
    want = [decay * a + (1 - decay) * w for a, w in zip(want, weights)]
  for got, w in zip(result.averages, want):
    np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)
  assert max(np.abs(a - w).max() for a, w in
             zip(result.averages, result.weights)) > 1e-4  # not the weights
  # Evaluation used the averages, and the trained weights are back after it.
  loss, _, _ = keras_evaluate(config, result.averages, 8)
  np.testing.assert_allclose(result.summary["eval_loss"], loss, rtol=1e-5)
  for a, b in zip(result.weights, seen.weights[-1]):
    np.testing.assert_array_equal(a, b)
  assert result.summary["ema_decay"] == decay


def stopping_run(tmp, replicas):
  """EMA, early stopping on eval_loss (patience 1: it rises at step 8) and
  a callback asking at step 6, which the next host call (7-8) carries."""
  callback = StopAfter(6)
  result = engine_run(recipe(tmp, replicas, early_stopping_patience=1,
                             train_steps=16), [callback])
  return result, callback


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
  return stopping_run(tmp_path_factory.mktemp("one"), 1)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_ema_early_stopping_and_callback_agree_on_1_2_4_replicas(
    one_replica, tmp_path, replicas):
  ref, ref_callback = one_replica
  result, callback = (one_replica if replicas == 1 else
                      stopping_run(tmp_path, replicas))
  s = result.summary
  assert s["num_replicas"] == replicas
  assert s["global_step"] == s["stop_step"] == 8
  # Both decided at step 8: the callback's vote and the evaluations.
  assert s["stop_reason"].startswith(
      "a callback set model.stop_training at step 6; early stopping: "
      "eval_loss did not improve in 1 evaluation(s) (best ")
  assert callback.steps == [1, 2, 4, 6, 8]
  assert s["best_step"] == 6 and s["best_metric"] == "eval_loss"
  np.testing.assert_allclose(s["best_value"], ref.summary["best_value"],
                             rtol=1e-5)
  for got, want in zip(result.weights + result.averages,
                       ref.weights + ref.averages):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert ref_callback.steps == callback.steps
  if replicas == 2:  # the same command again: the run is finished
    again, _ = stopping_run(tmp_path, replicas)
    assert again.traces == 0 and again.summary == s


def test_resume_with_ema_and_early_stopping_state_is_exact(tmp_path):
  """Resumed from the uninterrupted run's checkpoint of step 5 (between its
  evaluations of steps 3 and 6; a run stopped at step 5 saves that state:
  tests/test_multi_worker.py's `start_from_checkpoint`), the run ends as the
  uninterrupted one: weights, averages, the best evaluation and the early
  stopping count carried over."""
  kw = dict(early_stopping_patience=3, steps_per_loop=3, eval_every=3)
  whole = run_job(recipe(tmp_path / "whole", 2, train_steps=12,
                         checkpoint_every=5, **kw))
  mw.start_from_checkpoint(tmp_path / "whole", tmp_path / "parts", 5)
  rest = run_job(recipe(tmp_path / "parts", 2, train_steps=12, **kw))
  assert rest.summary["start_step"] == 5
  for got, want in zip(rest.weights + rest.averages,
                       whole.weights + whole.averages):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  for key in ("best_value", "best_step", "eval_loss", "final_loss"):
    assert rest.summary[key] == pytest.approx(whole.summary[key], abs=1e-6)


def test_keep_best_keeps_the_best_evaluations_checkpoint_and_export(
    tmp_path):
  config = recipe(tmp_path, 2, keep_best="eval_accuracy", train_steps=16,
                  export=True)
  result = run_job(config)
  s = result.summary
  scalars = read_scalars(tmp_path / "eval")
  accuracy, loss = scalars["accuracy"], scalars["loss"]
  assert sorted(accuracy) == list(range(2, 17, 2))
  # Accuracy is maximised; the first evaluation reaching the top is kept.
  best_step = min(accuracy, key=lambda k: (-accuracy[k], k))
  assert best_step == 10 and s["global_step"] == 16  # not the last one
  assert s["best_step"] == best_step and s["best_metric"] == "eval_accuracy"
  assert s["best_value"] == pytest.approx(accuracy[best_step], abs=1e-7)
  kept = json.loads((tmp_path / "best" / "best.json").read_text())
  assert kept["step"] == best_step
  assert kept["eval_loss"] == pytest.approx(loss[best_step], rel=1e-6)
  assert sorted(os.listdir(tmp_path / "best" / "checkpoints")) == [
      "checkpoint", f"ckpt-{best_step}.data-00000-of-00001",
      f"ckpt-{best_step}.index"]
  # The best export holds step 10's averaged weights: Keras evaluates it to
  # step 10's evaluation, and the final export to the last one.
  for export, step in ((tmp_path / "best" / "export", best_step),
                       (tmp_path / "export", 16)):
    model = keras.saving.load_model(export / "model.keras")
    got_loss, got_accuracy, _ = keras_evaluate(config, model.get_weights(),
                                               GLOBAL_BATCH)
    np.testing.assert_allclose(got_loss, loss[step], rtol=1e-5)
    assert got_accuracy == pytest.approx(accuracy[step], abs=1e-6)
  assert (tmp_path / "best" / "export" / "saved_model" /
          "saved_model.pb").exists()


def test_which_way_is_better():
  assert best.minimised("eval_loss") and best.minimised("eval_mean_error")
  assert not best.minimised("eval_accuracy")
  assert not best.minimised("eval_top5_accuracy")
