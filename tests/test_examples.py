"""examples/: users' scripts train, evaluate, checkpoint, resume and export,
on logical CPU devices and on 2 workers through the launcher.

The image example runs 20 steps on 2 workers through the launcher; the
tabular one runs 20 steps on 2 local replicas, and 2 workers resume its
checkpoint of step 10 to 20 (exact resume of a user's script, and its
workers' weights those of the local replicas); both exported SavedModels
are then loaded and asked for predictions in one fresh interpreter.
"""
import json
import os
import sys

import numpy as np
import pytest

import forkserver
from conftest import ROOT
from engine.data import to_tfds
from test_multi_worker import start_from_checkpoint

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
COMMON = ["--batch_size_per_replica=16", "--steps_per_loop=5",
          "--checkpoint_every=5", "--log_every=5", "--weights_out=w.npz",
          "--learning_rate=0.01", "--seed=5"]


def run(cmd, timeout=300):
  out = forkserver.run(cmd, cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  return out


def summary(model_dir):
  return json.loads((model_dir / "summary.json").read_text())


def weights(model_dir):
  got = np.load(model_dir / "w.npz")
  return [got[f"arr_{k}"] for k in range(len(got.files))]


def predict_elsewhere(*exports):
  """Loads each (export_dir, inputs_code) SavedModel in one fresh interpreter
  (no engine import) and asks it for predictions: per model, its outputs'
  shapes and whether all are finite."""
  code = "import numpy as np, tensorflow as tf\n"
  for export_dir, inputs_code in exports:
    code += (
        f"m = tf.saved_model.load({str(export_dir / 'saved_model')!r})\n"
        f"out = m.signatures['serving_default'](**{inputs_code})\n"
        f"print({{k: list(v.shape) for k, v in sorted(out.items())}})\n"
        f"print(all(np.isfinite(v.numpy()).all() for v in out.values()))\n")
  out = run([sys.executable, "-c", code], timeout=120)
  return out.stdout.strip().splitlines()


def train_resume_and_launch(tmp_path, program, flags, local=True):
  """The runs: on 2 local replicas, then on 2 workers resumed from its
  checkpoint of step 10 (only a 2-worker run from the start without
  `local`); returns (the summary of the uninterrupted run, its model_dir)."""
  b, mw = tmp_path / "b", tmp_path / "mw"
  local_cmd = [sys.executable, *program, "--cpu_devices=2", *COMMON, *flags]
  launcher = ([f"--script={program[0]}"] if program[0].endswith(".py") else
              [f"--module={program[1]}"])
  launch = [sys.executable, "-m", "engine.launch", "--num_workers=2",
            *launcher, "--", *COMMON, *flags, "--train_steps=20",
            f"--model_dir={mw}"]
  if not local:
    run(launch)
    s = summary(mw)
    assert s["num_workers"] == 2 and s["global_step"] == 20
    assert s["final_loss"] < s["first_loss"]  # it learns
    return s, mw
  run([*local_cmd, "--train_steps=20", f"--model_dir={b}"])
  # An interrupted run: the checkpoint of step 10 (--checkpoint_every=5),
  # resumed to 20 on 2 workers (the state a run stopped at 10 saves; the
  # same global batch, so any worker count resumes it). One run checks both
  # the exact resume of a user's script and its 2 workers against its 2
  # local replicas: their 2-value sums are the same (0.0 apart measured),
  # so the resume's tolerance holds.
  start_from_checkpoint(b, mw, 10)
  run(launch)
  s = summary(mw)
  assert s["num_workers"] == 2
  assert s["start_step"] == 10 and s["global_step"] == 20
  for got, want in zip(weights(mw), weights(b)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  s = summary(b)
  assert s["final_loss"] < s["first_loss"]  # it learns
  return s, b


IMAGE_INPUTS = "{'images': tf.random.uniform([4, 32, 32, 3])}"
TABULAR_INPUTS = ("{'rooms': tf.constant([3.0, 5.0]), 'area': tf.constant("
                  "[80.0, 150.0]), 'age': tf.constant([10.0, 40.0]), 'city': "
                  "tf.constant([1, 6])}")


@pytest.fixture(scope="module")
def image_runs(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("image")
  images = to_tfds.write_sample_folder(str(tmp_path / "pets"),
                                      ["cat", "dog", "fox"], 20, size=(36, 36))
  # On 2 workers only: a user's script on local replicas, resumed, and
  # matching 2 workers is test_tabular_regression; folder images on 2
  # workers matching one replica, test_input_scale.py.
  s, run_dir = train_resume_and_launch(
      tmp_path, [os.path.join("examples", "image_classifier.py")],
      [f"--image_dir={images}", "--image_size=32"], local=False)
  return run_dir, s


@pytest.fixture(scope="module")
def tabular_runs(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("tabular")
  s, run_dir = train_resume_and_launch(
      tmp_path, ["-m", "examples.tabular_regression"], ["--houses=512"])
  return run_dir, s


def test_image_classifier(image_runs):  # pylint: disable=redefined-outer-name
  _, s = image_runs
  assert s["task"] == "folder_classifier"
  assert s["eval_examples"] == 12 and 0.0 <= s["eval_accuracy"] <= 1.0


def test_tabular_regression(tabular_runs):  # pylint: disable=redefined-outer-name
  _, s = tabular_runs
  assert s["task"] == "house_prices"
  assert s["eval_examples"] == 103
  assert s["eval_mae"] > 0 and s["eval_mse"] >= s["eval_mae"] ** 2 - 1e-6


def test_both_exports_predict_in_a_fresh_interpreter(image_runs, tabular_runs):  # pylint: disable=redefined-outer-name
  # One interpreter for both SavedModels (one TensorFlow start-up fewer).
  lines = predict_elsewhere(
      (image_runs[0] / "export", IMAGE_INPUTS),
      (tabular_runs[0] / "export", TABULAR_INPUTS))
  assert lines == ["{'logits': [4, 3], 'probabilities': [4, 3]}", "True",
                   "{'outputs': [2, 1]}", "True"]
