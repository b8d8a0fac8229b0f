"""What users see: TensorBoard events, progress, profiler traces, exported models."""
import os
import pty
import select
import subprocess
import sys
import time

from absl import logging
import numpy as np
import pytest
import tensorflow as tf

import forkserver
from conftest import (ROOT, engine_cmd, read_scalars, run_job,
                      tiny_config)
from engine.config import ReportingConfig
from engine.hooks import Rows
from engine.errors import ConfigError
from engine.report import export, profiler, reporting, tensorboard

NAMES = ("loss", "examples", "grad_norm", "learning_rate", "accuracy")


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory):
  """(result, model_dir) of one 2-replica run of 8 steps with summaries every
  2 steps, an evaluation every 4 and a profile of steps 3-4: the events, eval
  and profiler tests below each check their part of it (one run, not three).
  """
  model_dir = tmp_path_factory.mktemp("reported")
  result = run_job(tiny_config(cpu_devices=2, train_steps=8,
                               summary_every=2, learning_rate=0.003,
                               eval_split="train[:32]", eval_every=4,
                               profile_steps=(3, 4), model_dir=str(model_dir)))
  return result, model_dir


def test_train_events_hold_every_tag_at_every_summary_step(reported_run):
  """The train run holds every tag at every summary step, the numbers the
  loop returned. (A run without evaluation writes no eval run:
  test_export_dir_flag_is_used.)"""
  result, model_dir = reported_run
  scalars = read_scalars(model_dir / "train")
  # The loss and the task's metrics (10 classes: top-5 accuracy too), then
  # the rates.
  assert list(tensorboard.train_tags(result.history)) == [
      "loss", "accuracy", "top5_accuracy", "learning_rate",
      "examples_per_sec", "steps_per_sec", "grad_norm"]
  assert sorted(scalars) == sorted(tensorboard.train_tags(result.history))
  for tag in tensorboard.train_tags(result.history):
    assert sorted(scalars[tag]) == [2, 4, 6, 8], tag
  for s in (2, 4, 6, 8):  # the same numbers the loop returned
    assert scalars["loss"][s] == pytest.approx(result.losses[s - 1], rel=1e-6)
    assert scalars["accuracy"][s] == pytest.approx(
        result.history["accuracy"][s - 1])
    assert scalars["top5_accuracy"][s] == pytest.approx(
        result.history["top5_accuracy"][s - 1])
    assert scalars["learning_rate"][s] == pytest.approx(0.003)
    assert scalars["examples_per_sec"][s] > 0
    assert scalars["steps_per_sec"][s] > 0
    assert scalars["grad_norm"][s] > 0
  assert scalars["grad_norm"][8] == pytest.approx(
      result.summary["final_grad_norm"], rel=1e-6)


def test_a_run_with_evaluation_writes_the_eval_run(reported_run):
  result, model_dir = reported_run
  scalars = read_scalars(model_dir / "eval")
  assert sorted(scalars) == ["accuracy", "examples", "loss", "top5_accuracy"]
  assert sorted(scalars["loss"]) == [4, 8]
  assert scalars["examples"][8] == 32
  assert scalars["loss"][8] == pytest.approx(result.summary["eval_loss"],
                                             rel=1e-6)
  assert scalars["accuracy"][8] == pytest.approx(
      result.summary["eval_accuracy"])


def test_on_eval_writes_the_eval_run(tmp_path):
  hook = tensorboard.SummaryHook(str(tmp_path), NAMES, enabled=True, every=0)
  hook.on_eval(10, {"eval_loss": 0.5, "eval_accuracy": 0.75})
  hook.on_eval(20, {"eval_loss": 0.25, "eval_accuracy": 0.875})
  hook.end({})
  assert read_scalars(tmp_path / "eval") == {
      "loss": {10: 0.5, 20: 0.25}, "accuracy": {10: 0.75, 20: 0.875}}
  assert not (tmp_path / "train").exists()  # every=0: no train summaries


def test_non_chief_writes_no_event_files(tmp_path):
  hook = tensorboard.SummaryHook(str(tmp_path), NAMES, enabled=False, every=1)
  hook.after_loop(1, Rows(NAMES, np.ones((1, 5), np.float32)), 0.5)
  hook.on_eval(1, {"eval_loss": 0.5})
  hook.end({})
  assert os.listdir(tmp_path) == []


def test_profile_steps_leave_a_trace(reported_run):
  _, model_dir = reported_run
  runs = os.listdir(model_dir / "plugins" / "profile")
  assert len(runs) == 1
  files = os.listdir(model_dir / "plugins" / "profile" / runs[0])
  assert any(f.endswith(".xplane.pb") for f in files), files
  assert all(os.path.getsize(model_dir / "plugins" / "profile" / runs[0] / f)
             > 0 for f in files)


def test_profile_hook_ends_host_calls_at_start_and_end(tmp_path):
  # Every worker cuts its host calls at the same steps (each call ends in a
  # collective that all workers join): where depends only on START, END and
  # the step the run starts from.
  stops = {start_step: [profiler.ProfileHook(str(tmp_path), (3, 5),
                                             start_step).next_stop(s)
                        for s in range(7)]
           for start_step in (0, 1, 5)}
  inf = float("inf")
  assert stops[0] == [2, 2, 5, 5, 5, inf, inf]
  assert stops[1] == stops[0]
  # The run starts after START: no trace and no cut (a warning says so).
  assert stops[5] == [inf] * 7
  assert not os.listdir(tmp_path)  # constructing traces nothing


@pytest.mark.parametrize("chief,all_workers,traces", [
    (True, False, True), (False, False, False), (False, True, True)])
def test_only_the_chief_traces_unless_profile_all_workers(
    tmp_path, chief, all_workers, traces):
  # A non-chief worker still cuts its host calls at START and END (its
  # collectives must match the chief's) but traces only with
  # --profile_all_workers: TensorFlow 2.21's profiler can crash a non-chief
  # worker as its trace stops (engine/report/profiler.py).
  verbosity = logging.get_verbosity()
  try:
    hooks = reporting.make_hooks(
        ReportingConfig(profile_steps=(2, 3), profile_all_workers=all_workers,
                        summary_every=0),
        chief=chief, output_dir=str(tmp_path / "out"),
        profile_dir=str(tmp_path / "trace"), start_step=0, total_steps=6,
        steps_per_epoch=6, names=NAMES)
  finally:
    logging.set_verbosity(verbosity)
  hook, = [h for h in hooks if isinstance(h, profiler.ProfileHook)]
  assert [hook.next_stop(s) for s in range(5)] == [1, 3, 3, float("inf"),
                                                  float("inf")]
  hook.after_loop(1, None, 0.1)
  tf.reduce_sum(tf.ones([4])).numpy()  # something to trace
  hook.after_loop(3, None, 0.1)
  assert os.path.isdir(tmp_path / "trace" / "plugins" / "profile") == traces


@pytest.mark.parametrize("steps", [(0, 3), (4, 3), (3,)])
def test_bad_profile_steps_are_refused(steps):
  with pytest.raises(ConfigError, match="--profile_steps="):
    tiny_config(profile_steps=steps)


# Runs in a fresh interpreter that cannot import this repository's packages.
_LOADER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in ("engine", "models", "data", "benchmarks"):
      raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import numpy as np, keras, tensorflow as tf
images = np.load(sys.argv[1])
for d, keras_out, logits, probs in zip(*[iter(sys.argv[2:])] * 4):
  np.save(keras_out, keras.saving.load_model(d + "/model.keras")(images))
  served = tf.saved_model.load(d + "/saved_model").signatures[
      "serving_default"]
  out = served(images=tf.constant(images))
  np.save(logits, out["logits"].numpy())
  np.save(probs, out["probabilities"].numpy())
"""


def load_elsewhere(export_dirs, images, tmp_path):
  """Predictions of both exported formats of each export directory, from one
  interpreter without us (one TensorFlow import for all of them)."""
  np.save(tmp_path / "images.npy", images)
  args, outs = [], []
  for i, export_dir in enumerate(export_dirs):
    out = [tmp_path / f"{i}_{n}.npy" for n in ("keras", "logits", "probs")]
    args += [str(export_dir), *map(str, out)]
    outs.append(out)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run(
      [sys.executable, "-I", "-c", _LOADER, str(tmp_path / "images.npy"),
       *args],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [[np.load(o) for o in out] for out in outs]


def assert_same_predictions(got, want):
  keras_out, logits, probabilities = got
  assert np.isfinite(want).all() and np.ptp(want) > 0
  np.testing.assert_allclose(keras_out, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(probabilities, tf.nn.softmax(want).numpy(),
                             rtol=1e-5, atol=1e-6)


IMAGES = np.random.default_rng(0).uniform(size=(5, 32, 32, 3)).astype(
    np.float32)


@pytest.fixture(scope="module")
def small_cnn_run(tmp_path_factory):
  """(model_dir, export_dir, the model's predictions of IMAGES): small_cnn,
  exported at the end of a 2-replica run, into --export_dir (checked by
  test_export_dir_flag_is_used; the round trip loads it)."""
  tmp_path = tmp_path_factory.mktemp("small_cnn")
  result = run_job(tiny_config(cpu_devices=2, train_steps=2, export=True,
                               model_dir=str(tmp_path / "m"),
                               export_dir=str(tmp_path / "e")))
  want = result.model(IMAGES, training=False).numpy()
  assert want.shape == (5, 10)
  return tmp_path / "m", tmp_path / "e", want


def random_mobilenet_v2(tmp_path):
  """mobilenet_v2 built in a 2-replica scope, as engine.run builds it.

  Training it here would cost most of a minute; every variable (BatchNorm's
  moving statistics too) is set to random values instead, so a format that
  dropped or reordered any of them would predict differently.
  """
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  task = ic.ImageClassification(ic.ImageClassificationConfig(
      model="mobilenet_v2", image_size=32))
  with strategy.scope():
    model = task.build_model()
  rng = np.random.default_rng(1)
  for v in model.variables:
    value = rng.uniform(0.5, 1.5, v.shape) if "variance" in v.path else (
        rng.normal(0.0, 0.1, v.shape))
    v.assign(value.astype(np.float32))
  export.export(model, str(tmp_path / "export"), task,
                tf.TensorSpec([None, 32, 32, 3], tf.float32))
  return tmp_path / "export", model(IMAGES, training=False).numpy()


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory, small_cnn_run):
  """{name: (predictions of both exported formats, loaded elsewhere; the
  model's own)}: both exports are loaded by one fresh interpreter."""
  made = {"small_cnn": small_cnn_run[1:],
          "mobilenet_v2": random_mobilenet_v2(
              tmp_path_factory.mktemp("mobilenet_v2"))}
  got = load_elsewhere([d for d, _ in made.values()], IMAGES,
                       tmp_path_factory.mktemp("loaded"))
  return {name: (g, want) for (name, (_, want)), g in zip(made.items(), got)}


def test_trained_model_export_round_trip(round_trips):
  assert_same_predictions(*round_trips["small_cnn"])


def test_mobilenet_v2_export_round_trip(round_trips):
  assert_same_predictions(*round_trips["mobilenet_v2"])


def test_export_dir_flag_is_used(small_cnn_run):
  """The round trip's small_cnn run exports into --export_dir, not
  model_dir/export; it has no evaluation, so it writes no eval run."""
  model_dir, export_dir, _ = small_cnn_run
  assert sorted(os.listdir(export_dir)) == [export.KERAS_FILE,
                                            export.SAVED_MODEL_DIR]
  assert "export" not in os.listdir(model_dir)
  assert (model_dir / "train").is_dir()  # it does write the train run
  assert not (model_dir / "eval").exists()  # no evaluation, no eval run


TINY = ["--model=small_cnn", "--image_size=32", "--synthetic_examples=128",
        "--batch_size_per_replica=8", "--cpu_devices=2", "--epochs=2",
        "--log_every=4", "--steps_per_loop=3", "--noexport"]


def run_on_pty(flags, timeout=180):
  """Runs the CLI with stdout on a pseudo-terminal; returns (code, tty, stderr)."""
  master, slave = pty.openpty()
  proc = forkserver.Popen(engine_cmd(*flags), cwd=ROOT,
                          stdin=subprocess.DEVNULL, stdout=slave,
                          stderr=subprocess.PIPE)
  os.close(slave)
  chunks, deadline = [], time.monotonic() + timeout
  try:
    while time.monotonic() < deadline:
      ready, _, _ = select.select([master], [], [], 0.5)
      if ready:
        try:
          chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
          break
        if not chunk:
          break
        chunks.append(chunk)
      elif proc.poll() is not None:
        break
    stderr = proc.communicate(timeout=60)[1].decode()
  finally:
    if proc.poll() is None:
      proc.kill()
    os.close(master)
  return proc.returncode, b"".join(chunks).decode(), stderr


def test_progress_bar_on_a_terminal(tmp_path):
  code, tty, stderr = run_on_pty(TINY + [f"--model_dir={tmp_path}"])
  assert code == 0, stderr[-3000:]
  # 128 examples / global batch 16 = 8 steps per epoch, 2 epochs.
  lines = tty.replace("\r\n", "\n").split("\n")
  finished = [l.split("\r")[-1].replace("\x1b[K", "") for l in lines
              if "total |" in l]
  assert [l.split(" [")[0] for l in finished] == ["epoch 1/2", "epoch 2/2"]
  for l in finished:
    assert "[" + "=" * 30 + "] 8/8 " in l and "examples/s" in l
    loss = float(l.split("| loss ")[1].split(" ")[0])
    assert 0 < loss < 10
  assert "ETA " in tty and "\r" in tty  # redrawn in place while running
  assert "| loss " not in stderr  # the bar replaces the log lines
  assert "Global batch 16" in stderr


def test_noprogress_on_a_terminal_logs_lines(tmp_path):
  code, tty, stderr = run_on_pty(TINY + ["--noprogress",
                                         f"--model_dir={tmp_path}"])
  assert code == 0, stderr[-3000:]
  assert "epoch 1/2" not in tty
  steps = [l.split("step ")[1].split(" ")[0] for l in stderr.splitlines()
           if "| loss " in l]
  assert steps == ["4/16", "8/16", "12/16", "16/16"]
