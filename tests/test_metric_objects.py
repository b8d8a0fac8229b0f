"""What Keras `compile` takes, a Task takes (issue 28): Keras metric objects
exact across replicas and workers, several outputs with a loss each and
weights, and each mistake as one line.

The task is tests/outputs_job.py: a binary `click` head with AUC, Precision
and Recall objects and a `value` head with Huber (weight 0.5), the MAE
function and a MeanSquaredError object; `count` (a user's metric object,
given once) counts each output's examples. 35 training examples in global
batches of 8: each epoch ends with 3, so on 4 replicas two replicas get
none.
"""
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import forkserver
from conftest import read_scalars
import engine
import outputs_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
           PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
GLOBAL_BATCH = 8
STEPS_PER_EPOCH = 5  # ceil(35 / 8)
OBJECTS = ("click/auc", "click/precision", "click/recall", "value/mse")


def config(model_dir, replicas: int, **fields) -> engine.Config:
  base = dict(strategy="mirrored" if replicas > 1 else "one_device",
              cpu_devices=replicas,
              batch_size_per_replica=GLOBAL_BATCH // replicas,
              train_steps=2 * STEPS_PER_EPOCH, optimizer="sgd",
              learning_rate=0.1, seed=3, export=False, log_every=5,
              model_dir=str(model_dir))
  base.update(fields)
  return engine.Config.create(**base)


def keras_values(model, split: str) -> dict:
  """The metrics one device computes with Keras's own objects over the
  split's examples, with `model`'s weights."""
  features, labels = outputs_job.examples(split)
  outputs = model(features, training=False)
  click, value = (np.asarray(outputs[k]) for k in ("click", "value"))
  out = {}
  for name, metric in (("click/auc", keras.metrics.AUC(from_logits=True)),
                       ("click/precision",
                        keras.metrics.Precision(thresholds=0.0)),
                       ("click/recall", keras.metrics.Recall(thresholds=0.0))):
    metric.update_state(labels["click"][:, None], click[:, None])
    out[name] = float(metric.result())
  mse = keras.metrics.MeanSquaredError()
  mse.update_state(labels["value"][:, None], value[:, None])
  out["value/mse"] = float(mse.result())
  return out


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
  """Runs with a learning rate of 1e-30 on 1, 2 and 4 replicas: the weights
  stay the initial ones (to float32's precision), so training's metrics over
  an epoch are Keras's over the training examples."""
  runs = {}
  for replicas in (1, 2, 4):
    path = tmp_path_factory.mktemp(f"frozen{replicas}")
    runs[replicas] = engine.run(outputs_job.make_task(),
                                config(path, replicas, learning_rate=1e-30))
  return runs


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_metric_objects_equal_keras_over_the_same_examples(frozen, replicas):
  result = frozen[replicas]
  s = result.summary
  train = keras_values(result.model, "train")
  evaluation = keras_values(result.model, "eval")
  for name in OBJECTS:
    # Training's value is over the last epoch: its 35 examples.
    assert s[f"final_{name}"] == pytest.approx(train[name], abs=1e-6), name
    assert s[f"eval_{name}"] == pytest.approx(evaluation[name], abs=1e-6), (
        name)
  # Not trivially equal: untrained heads, neither perfect nor constant.
  assert 0.1 < s["eval_click/auc"] < 0.9 and s["eval_value/mse"] > 0.01
  assert 0.0 < s["final_click/precision"] < 1.0
  # States restart each epoch, as under fit, and count every example once:
  # partial batches and empty replicas included.
  assert s["final_click/count"] == s["final_value/count"] == 35.0
  assert s["eval_click/count"] == s["eval_value/count"] == 21.0
  history = result.history["click/count"]
  assert history[STEPS_PER_EPOCH - 1] == 35.0 and history[-1] == 35.0


def test_several_outputs_report_each_loss_and_metric(frozen):
  s = frozen[1].summary
  history = frozen[1].history
  # "loss" is the weighted sum of the outputs' own losses.
  np.testing.assert_allclose(
      history["loss"], history["click/loss"] + 0.5 * history["value/loss"],
      rtol=1e-6)
  assert {"eval_click/loss", "eval_value/loss", "eval_value/mae",
          "final_value/mae"} <= set(s)
  # A metric object's value is known where a host call ends: at every log
  # step and epoch end; NaN between them.
  auc = history["click/auc"]
  assert np.isfinite(auc[[4, 9]]).all()


class Evaluations(engine.Hook):
  """A user's hook: every evaluation it hears."""

  def __init__(self):
    self.seen = []

  def on_eval(self, step, metrics):
    self.seen.append((step, metrics))


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
  path = tmp_path_factory.mktemp("one")
  heard = Evaluations()
  result = engine.run(outputs_job.make_task(),
                      config(path, 1, weights_out="weights.npz",
                             eval_every=STEPS_PER_EPOCH,
                             keep_best="eval_click/auc"), hooks=[heard])
  result.heard = heard.seen
  return result


def test_metric_objects_reach_hooks_and_keep_best(one_replica):
  """Each evaluation's metric objects reach a user's hook; --keep_best
  keeps the evaluation with the highest AUC (a name without loss or error:
  maximised)."""
  steps = [step for step, _ in one_replica.heard]
  assert steps == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
  aucs = [metrics["eval_click/auc"] for _, metrics in one_replica.heard]
  s = one_replica.summary
  assert s["best_metric"] == "eval_click/auc"
  assert s["best_value"] == pytest.approx(max(aucs))
  assert s["best_step"] == steps[int(np.argmax(aucs))]
  assert aucs[-1] == s["eval_click/auc"]


@pytest.mark.parametrize("replicas", [2, 4])
def test_two_outputs_train_as_on_one_replica(tmp_path, one_replica,
                                             replicas):
  result = engine.run(outputs_job.make_task(), config(tmp_path, replicas))
  assert_same_run(result.summary, result.losses, result.weights,
                  one_replica)


def assert_same_run(summary, losses, weights, reference, tol=1e-5,
                    resumed=False):
  """`losses` None: the caller checked them (a resumed run has only its
  own steps')."""
  if losses is not None:
    np.testing.assert_allclose(losses, reference.losses, rtol=tol, atol=tol)
  for got, want in zip(weights, reference.weights):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
  # A metric function's final value is its mean over the last --log_every
  # steps of this run (fewer after a resume); a metric object's is over the
  # epoch, checkpointed with the run.
  for name in OBJECTS + ("click/loss", "value/mae"):
    keys = [f"eval_{name}"]
    if not resumed or name in OBJECTS:
      keys.append(f"final_{name}")
    for key in keys:
      assert summary[key] == pytest.approx(reference.summary[key],
                                           abs=tol), key


def test_resume_mid_epoch_continues_the_epochs_metric_states(tmp_path,
                                                             one_replica):
  """Stopped at step 7 (2 steps into epoch 2) and resumed on 2 replicas:
  the epoch's metric states come back with the checkpoint."""
  first = engine.run(outputs_job.make_task(),
                     config(tmp_path, 1, train_steps=7, checkpoint_every=7))
  assert first.summary["global_step"] == 7
  resumed = engine.run(outputs_job.make_task(), config(tmp_path, 2))
  assert resumed.summary["start_step"] == 7
  np.testing.assert_allclose(
      np.concatenate([first.losses, resumed.losses]), one_replica.losses,
      rtol=1e-5, atol=1e-5)
  assert_same_run(resumed.summary, None, resumed.weights, one_replica,
                  resumed=True)
  assert resumed.summary["final_click/count"] == 35.0


def launch(model_dir, *flags):
  return forkserver.run(
      [sys.executable, "-m", "engine.launch", "--num_workers=2",
       "--module=outputs_job", "--", f"--model_dir={model_dir}",
       "--batch_size_per_replica=4", "--train_steps=10", "--optimizer=sgd",
       "--learning_rate=0.1", "--seed=3", "--log_every=5", "--noprogress",
       *flags],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_two_workers(tmp_path, one_replica):
  """2 workers through the launcher: the 1-replica run, and an export that
  returns both outputs."""
  proc = launch(tmp_path, "--weights_out=weights.npz", "--summary_every=1",
                f"--export_dir={tmp_path / 'export'}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary["num_workers"] == 2
  with np.load(tmp_path / "weights.npz") as saved:
    weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
  losses = read_scalars(tmp_path / "train")["loss"]
  assert_same_run(summary, [losses[s] for s in sorted(losses)], weights,
                  one_replica)
  assert summary["final_click/count"] == 35.0
  # Evaluation's metric objects: Keras's over the eval examples with the
  # weights the workers trained.
  model = outputs_job.build_model()
  for variable, value in zip(model.trainable_variables, weights):
    variable.assign(value)
  for name, value in keras_values(model, "eval").items():
    assert summary[f"eval_{name}"] == pytest.approx(value, abs=1e-6), name
  served = tf.saved_model.load(str(tmp_path / "export" / "saved_model"))
  features, _ = outputs_job.examples("eval")
  out = served.signatures["serving_default"](x=tf.constant(features["x"]))
  assert sorted(out) == ["click", "value"]
  want = one_replica.model(features, training=False)
  np.testing.assert_allclose(out["click"], want["click"], atol=1e-5)


@pytest.mark.parametrize("mistake,expected", [
    ("unknown_output", "task outputs: loss for output 'price', which the "
     "model does not have (its outputs: click, value)."),
    ("missing_label", "task outputs: no label for output 'value', which has "
     "a loss (the labels' keys: click)."),
    ("extra_label", "task outputs: label 'price' matches no output of the "
     "model (its outputs: click, value)."),
    ("string_metric", "task outputs: metric 'click/accuracy' is the string "
     "'accuracy'; pass a function (labels, outputs) -> one value per example "
     "or a Keras metric object (e.g. keras.metrics.BinaryAccuracy()), which "
     "Keras `compile` would pick from the loss and the shapes."),
    ("not_summable", "task outputs: metric 'value/top' (Largest) keeps a "
     "state that is not a sum (its variables aggregate by none); the engine "
     "sums each replica's state, so it cannot report it exactly: use a "
     "metric whose variables add up over examples, or a per-example "
     "function."),
])
def test_each_mistake_is_one_line(tmp_path, mistake, expected):
  with pytest.raises(engine.ConfigError) as caught:
    engine.run(outputs_job.make_task(mistake), config(tmp_path, 2))
  assert str(caught.value) == expected


def test_a_mistake_on_the_command_line_exits_2_in_one_line(tmp_path):
  proc = forkserver.run(
      [sys.executable, os.path.join(ROOT, "tests", "outputs_job.py"),
       "--mistake=missing_label", f"--model_dir={tmp_path}", "--noexport",
       "--batch_size_per_replica=8"],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: task outputs: no label for output 'value', which has a loss "
      "(the labels' keys: click).")
