"""The public API: a user's own task keeps every guarantee of the built-in job.

tests/user_task.py is the user: dict features, a hand-written label-smoothed
loss, a kernel and an activity regularizer, 37 examples (partial batches).
"""
import json
import os
import re
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import engine
import forkserver
from conftest import ROOT
from engine.core import inputs
import user_task

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
GLOBAL_BATCH = 16
STEPS = 6  # 37 examples: batches of 16, 16, 5, twice
SCRIPT = os.path.join(ROOT, "tests", "user_task.py")


def config(tmp_path, replicas, **kw):
  return engine.Config.create(
      strategy="one_device" if replicas == 1 else "mirrored",
      cpu_devices=0 if replicas == 1 else replicas,
      batch_size_per_replica=GLOBAL_BATCH // replicas, train_steps=STEPS,
      steps_per_loop=2, optimizer="sgd", learning_rate=0.2, seed=3,
      export=False, model_dir=str(tmp_path / f"r{replicas}"), **kw)


class _Recorder(engine.Hook):
  """A user's hook: what it hears, in order."""

  def __init__(self):
    self.events = []

  def begin(self, step):
    self.events.append(("begin", step))

  def on_eval(self, step, metrics):
    self.events.append(("eval", step, dict(metrics)))

  def close(self):
    self.events.append(("close",))

  def end(self, summary):
    self.events.append(("end", summary["global_step"]))


_RECORDER = _Recorder()


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
  return engine.run(user_task.make_task(),
                    config(tmp_path_factory.mktemp("one"), 1),
                    hooks=[_RECORDER])


def test_a_users_hook_hears_every_evaluation_and_the_end(one_replica):
  # 37 examples, global batch 16: epochs end at steps 3 and 6 (the last).
  events = _RECORDER.events
  assert [e[:2] for e in events] == [("begin", 0), ("eval", 3), ("eval", 6),
                                     ("close",), ("end", 6)]
  for _, _, metrics in events[1:3]:
    assert set(metrics) == {"eval_loss", "eval_accuracy", "eval_examples"}
    assert metrics["eval_examples"] == 20
  assert events[1][2]["eval_loss"] != events[2][2]["eval_loss"]  # it trained
  summary = one_replica.summary
  assert events[2][2] == {k: summary[k] for k in events[2][2]}


class _Preempt(engine.Hook):
  def after_loop(self, step, rows, seconds):
    if step == 1:  # the first host call runs one step
      os.kill(os.getpid(), signal.SIGTERM)


def test_preempted_is_caught_from_the_public_api(tmp_path):
  with pytest.raises(engine.Preempted, match="SIGTERM at step 1; ") as caught:
    engine.run(user_task.make_task(), config(tmp_path, 1), hooks=[_Preempt()])
  assert caught.value.exit_code == engine.ExitCode.PREEMPTED == 75
  assert os.path.exists(tmp_path / "r1" / "checkpoints" / "ckpt-1.index")


def test_importing_the_engine_defines_no_flag_and_yields_to_the_script():
  code = """
import dataclasses
from absl import flags
import engine, engine.cli, engine.main, engine.launch
from engine import config
from engine.tasks import image_classification
ours = set(config.field_sections()) | {
    f.name for f in dataclasses.fields(
        image_classification.ImageClassificationConfig)}
print(sorted(ours & set(flags.FLAGS)))
# A script with its own --learning_rate and --seed, then the engine's flags.
flags.DEFINE_float("learning_rate", 0.5, "the script's own")
flags.DEFINE_string("seed", "abc", "the script's own, another type")
defined = engine.cli.define_flags()
flags.FLAGS(["prog", "--learning_rate=0.25", "--seed=xyz",
             "--train_steps=7"])
c = engine.cli.config_from_flags()
print(flags.FLAGS.learning_rate, flags.FLAGS.seed, c.optimization.learning_rate,
      c.randomness.seed, c.loop.train_steps, "learning_rate" in defined)
"""
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == [
      "[]", "0.25 xyz 0.001 42 7 False"], out.stdout


def test_regularization_is_added_once_for_the_global_batch(one_replica):
  # The first step's loss, computed by hand from the same initial weights
  # and the same first batch: mean data loss + the model's own losses once.
  task = user_task.make_task()
  keras.utils.set_random_seed(3)
  model = task.build_model()
  batch = next(iter(inputs.TrainData(
      task, tf.distribute.InputContext(), engine.DataConfig(
          batch_size_per_replica=GLOBAL_BATCH), GLOBAL_BATCH, 3).batches()))
  outputs = model(batch[0], training=True)
  data_loss = float(tf.reduce_mean(user_task.smoothed_cross_entropy(
      batch[1], outputs)))
  regularization = float(tf.add_n(model.losses))
  assert regularization > 0.01  # both regularizers contribute
  np.testing.assert_allclose(one_replica.history["loss"][0],
                             data_loss + regularization, rtol=1e-5)


@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_match_one_replica(one_replica, tmp_path, replicas):
  result = engine.run(user_task.make_task(), config(tmp_path, replicas))
  assert result.history["examples"].tolist() == [16, 16, 5] * 2
  np.testing.assert_allclose(result.history["loss"],
                             one_replica.history["loss"], rtol=1e-5)
  for got, want in zip(result.weights, one_replica.weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert result.summary["final_accuracy"] == pytest.approx(
      one_replica.summary["final_accuracy"])
  assert result.summary["eval_examples"] == 20


def test_two_workers_through_the_launcher_match_one_replica(one_replica,
                                                            tmp_path):
  out = forkserver.run(
      [sys.executable, "-m", "engine.launch", "--num_workers=2",
       f"--script={SCRIPT}", "--", "--strategy=multi_worker",
       f"--batch_size_per_replica={GLOBAL_BATCH // 2}",
       f"--train_steps={STEPS}", "--steps_per_loop=2", "--optimizer=sgd",
       "--learning_rate=0.2", "--seed=3", "--noexport",
       "--weights_out=w.npz", f"--model_dir={tmp_path}"],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["num_workers"] == 2 and summary["collectives_per_step"] == 1
  assert summary["task"] == "user_task"
  got = np.load(tmp_path / "w.npz")
  for k, want in enumerate(one_replica.weights):
    np.testing.assert_allclose(got[f"arr_{k}"], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(summary["final_loss"],
                             one_replica.history["loss"][-1], rtol=1e-5)


def test_metrics_are_named_everywhere(one_replica):
  summary = one_replica.summary
  for key in ("final_loss", "final_accuracy", "eval_loss", "eval_accuracy",
              "eval_examples"):
    assert summary[key] is not None, key
  assert set(one_replica.history) == {"loss", "examples", "grad_norm",
                                      "learning_rate", "accuracy"}


MISTAKES = {
    "not_pairs": "error: task user_task: build_inputs('train') yields dicts "
                 "with keys ['extra', 'x'], not (features, labels) pairs",
    "scalar_loss": "error: task user_task: the loss returned shape [] for "
                   "labels shape [None] and outputs shape [None, 3]; it must "
                   "return one value per example (shape [batch]): it "
                   "averaged over the batch",
    "shape": "error: task user_task: the loss failed on the model's outputs "
             "(shape [None, 3]) and the labels (shape [None])",
    "duplicate_metric": "error: task user_task: metric name 'accuracy' is "
                        "used twice",
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_users_mistake_is_one_config_error_before_training(tmp_path,
                                                             mistake):
  """Each mistake is caught before training as one ConfigError line, which
  the command line prints as `error: <line>` with exit 2, as it does every
  ConfigError (engine/cli.py; one such run is the next test)."""
  c = config(tmp_path, 1)
  with pytest.raises(engine.ConfigError) as caught:
    engine.run(user_task.make_task(mistake), c)
  message = f"error: {caught.value}"
  assert "\n" not in message and message.startswith(MISTAKES[mistake]), (
      message)
  assert not os.path.exists(os.path.join(c.checkpoints.model_dir,
                                         "checkpoints", "checkpoint"))


def test_a_users_mistake_is_one_line_before_training(tmp_path):
  """The user's script on the command line: the mistake is one line, exit 2,
  no traceback, nothing trained ("shape": the loss raises inside TensorFlow,
  the mistake most likely to escape as a traceback)."""
  out = forkserver.run(
      [sys.executable, SCRIPT, "--mistake=shape", "--train_steps=2",
       "--batch_size_per_replica=8", f"--model_dir={tmp_path}"],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(MISTAKES["shape"]), (
      out.stderr[-2000:])
  assert "| loss " not in out.stderr  # nothing was trained
  assert not os.path.exists(tmp_path / "checkpoints" / "checkpoint")


def test_every_summary_key_is_in_the_reference(one_replica):
  with open(os.path.join(ROOT, "docs", "reference", "summary-json.md")) as f:
    documented = set(re.findall(r"`(\w+)`", f.read()))
  metrics = {"accuracy"}  # user_task's
  missing = [k for k in one_replica.summary if k not in documented and not (
      k.split("_", 1)[0] in ("final", "eval") and k.split("_", 1)[1] in
      metrics)]
  assert not missing, missing
