"""examples/text_classifier.py: strings vectorized in the input pipeline, a
Transformer encoder with two outputs (weighted losses), Keras metric objects.

One launch of 2 workers trains it until its evaluation AUC is above 0.9 and
exports it; the export, loaded in a fresh interpreter, scores a positive
review above a negative one from raw strings. In this process (2 replicas,
the same global batch), the launch's checkpoint of step 50, inside an
epoch, resumed to 60 ends as the launch did and leaves the vocabulary
file as it was.
docs/guide/from-compile.md's programs run as tests/test_docs.py runs the
guide's.
"""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

import engine
import forkserver
from conftest import ROOT
from examples import text_classifier
from test_docs import _pages, _plan, _run_driven, _write
from test_multi_worker import start_from_checkpoint

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
REVIEWS = 3000  # 2400 to train on, 600 to evaluate
LAUNCH_STEPS = 60  # global batch 64: 38 steps an epoch (the last partial)
RESUME_AT = 50  # the launch's checkpoint a run resumes from
POSITIVE = "A wonderful film: brilliant, moving and fun. Loved it!"
NEGATIVE = "Boring, dull and tedious; the worst script. Hated it."


def launch(flags, timeout=300):
  """The launcher with 2 workers of the example; (exit code, its output).
  A launcher still running after `timeout` s is killed, and so is each
  worker it started (by the pids it printed)."""
  proc = forkserver.Popen(
      [sys.executable, "-m", "engine.launch", "--num_workers=2",
       "--module=examples.text_classifier", "--", *flags],
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate(timeout=30)
    for pid in re.findall(r"launcher: worker \d+ pid (\d+)", out):
      try:
        os.killpg(int(pid), signal.SIGKILL)
      except ProcessLookupError:
        pass
    raise
  return proc.returncode, out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("text") / "run"
  code, out = launch([
      f"--reviews={REVIEWS}", f"--train_steps={LAUNCH_STEPS}",
      "--batch_size_per_replica=32", "--learning_rate=0.003", "--seed=1",
      "--eval_every=50", f"--checkpoint_every={RESUME_AT}", "--noprogress",
      f"--model_dir={model_dir}"])
  assert code == 0, out[-4000:]
  return model_dir, json.loads((model_dir / "summary.json").read_text())


def test_two_workers_learn_the_sentiment(launched):  # pylint: disable=redefined-outer-name
  model_dir, s = launched
  assert s["num_workers"] == 2 and s["global_step"] == LAUNCH_STEPS
  assert s["task"] == "review_sentiment" and s["eval_examples"] == 600
  assert s["eval_sentiment/auc"] > 0.9, s
  for name in ("precision", "recall"):
    assert 0.7 < s[f"eval_sentiment/{name}"] <= 1.0, s
  assert s["eval_length/accuracy"] > 0.4, s  # 4 buckets: chance is 0.25
  # The weighted total: the sentiment's loss + 0.2 x the length bucket's.
  assert s["eval_loss"] == pytest.approx(
      s["eval_sentiment/loss"] + 0.2 * s["eval_length/loss"], rel=1e-5)
  assert s["final_loss"] < s["first_loss"]
  # The chief saved the vocabulary every worker computed from the data.
  texts, _ = text_classifier.make_reviews(REVIEWS, 0)
  assert text_classifier.read_vocabulary(
      str(model_dir / "vocabulary.txt")) == text_classifier.count_vocabulary(
          texts[:REVIEWS * 4 // 5], 1000)


def test_the_export_reads_raw_strings_in_a_fresh_interpreter(launched):  # pylint: disable=redefined-outer-name
  model_dir, _ = launched
  saved = str(model_dir / "export" / "saved_model")
  code = (  # no engine import: the SavedModel vectorizes the strings itself
      "import tensorflow as tf\n"
      f"m = tf.saved_model.load({saved!r})\n"
      f"out = m.signatures['serving_default'](text=tf.constant("
      f"[{POSITIVE!r}, {NEGATIVE!r}]))\n"
      "print({k: v.shape.as_list() for k, v in sorted(out.items())})\n"
      "print(out['sentiment'].numpy().tolist())\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=model_dir,
                       env={k: v for k, v in ENV.items() if k != "PYTHONPATH"},
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  shapes, logits = out.stdout.strip().splitlines()[-2:]
  assert shapes == "{'length': [2, 4], 'sentiment': [2]}"
  positive, negative = json.loads(logits)
  assert positive > 0 > negative, (positive, negative)


def test_a_resumed_run_ends_as_an_uninterrupted_one(launched,  # pylint: disable=redefined-outer-name
                                                    tmp_path):
  # The launch's checkpoint of step RESUME_AT and its vocabulary: the
  # model_dir a run stopped there leaves (test_multi_worker.py's
  # start_from_checkpoint), resumed here on 2 replicas with the launch's
  # global batch (a resume may change the worker count, not the batch).
  model_dir, launched_summary = launched
  start_from_checkpoint(model_dir, tmp_path, RESUME_AT)
  vocabulary = tmp_path / "vocabulary.txt"
  shutil.copy2(model_dir / "vocabulary.txt", vocabulary)
  saved = (vocabulary.read_bytes(), vocabulary.stat().st_mtime_ns)
  task = text_classifier.ReviewSentiment(reviews=REVIEWS, data_seed=0,
                                         model_dir=str(tmp_path))
  resumed = engine.run(task, engine.Config.create(
      cpu_devices=2, batch_size_per_replica=32, train_steps=LAUNCH_STEPS,
      learning_rate=0.003, eval_every=50, seed=1, export=False,
      model_dir=str(tmp_path))).summary
  assert resumed["start_step"] == RESUME_AT
  assert resumed["global_step"] == LAUNCH_STEPS
  # Steps 39 to 76 are the second epoch: the final training metrics
  # count its steps before RESUME_AT through the states checkpointed.
  for key in ("final_loss", "final_sentiment/auc", "final_length/accuracy",
              "eval_loss", "eval_sentiment/auc", "eval_length/accuracy"):
    assert resumed[key] == pytest.approx(launched_summary[key], abs=1e-5), key
  assert (vocabulary.read_bytes(), vocabulary.stat().st_mtime_ns) == saved


def test_a_saved_vocabulary_is_the_one_used(tmp_path):
  # A run that finds the file takes it as it is, even where the data would
  # give another order (here: reversed).
  def task(model_dir):
    return text_classifier.ReviewSentiment(reviews=100, data_seed=0,
                                           model_dir=str(model_dir))
  counted = task(tmp_path).vocabulary
  text_classifier.write_vocabulary(str(tmp_path / "vocabulary.txt"),
                                   counted[::-1])
  found = task(tmp_path)
  assert found.vocabulary == counted[::-1]
  # ... and a checkpoint of the other vocabulary is not resumed with it.
  assert (found.describe()["vocabulary_sha256"] !=
          task(tmp_path / "new").describe()["vocabulary_sha256"])


def test_the_from_compile_guide_runs(tmp_path):
  files, driven, alone = _plan(_pages("from-compile.md"), tmp_path)
  assert not alone and "engine_train.py" in files
  _write(files, tmp_path)
  _run_driven(driven, tmp_path)
  s = json.loads((tmp_path / "clicks" / "summary.json").read_text())
  assert s["task"] == "clicks" and s["eval_examples"] == 256
  assert s["eval_loss"] == pytest.approx(
      s["eval_click/loss"] + 0.5 * s["eval_spend/loss"], rel=1e-5)
  # Both programs learn (spend's deviation is 2.2): the CSV logs of their
  # 2 epochs, Keras's columns named click_auc, the engine's click/auc.
  fit = _csv_rows(tmp_path / "fit_log.csv")
  moved = _csv_rows(tmp_path / "clicks" / "log.csv")
  assert len(fit) == len(moved) == 2
  assert fit[-1]["val_click_auc"] > 0.9 and fit[-1]["val_spend_mae"] < 0.5
  assert moved[-1]["val_click/auc"] > 0.9 and moved[-1]["val_spend/mae"] < 0.5
  assert moved[-1]["val_click/auc"] == pytest.approx(s["eval_click/auc"])


def _csv_rows(path):
  with open(path) as f:
    return [{k: float(v) for k, v in row.items()}
            for row in csv.DictReader(f)]
