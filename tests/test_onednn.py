"""oneDNN stays on: the engine never runs a model on an empty batch.

tests/onednn_repro.py shows TensorFlow's fault in plain TensorFlow (Conv2D
on an empty batch returns its input's shape with oneDNN on). The tests here
run with TensorFlow's default (oneDNN on on x86) and give replicas empty
shares of partial batches: training and evaluation still equal one device.
Models without BatchNorm: tests/test_partial_batch.py (4 replicas, 2 workers,
compressed gradients), which runs with oneDNN on like the whole suite.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import engine

from conftest import ROOT, conv_bn_task, engine_cmd, run_job, tiny_config
from engine import Config, ConfigError, onednn

REPRO = os.path.join(ROOT, "tests", "onednn_repro.py")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop(onednn.ENV, None)  # TensorFlow's default, as for a user


def max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _start(argv, **env):
  return subprocess.Popen(argv, env=dict(ENV, **env), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_the_fault_is_tensorflows_and_the_command_line_avoids_it(tmp_path):
  # The processes at once: each spends most of its time importing.
  off = _start([sys.executable, REPRO], **{onednn.ENV: "0"})
  on = _start([sys.executable, REPRO], **{onednn.ENV: "1"})
  # The choice is made from the flags: small_cnn (no BatchNorm) is enough.
  keras_sync = _start(engine_cmd(
      "--model=small_cnn", "--image_size=32", "--synthetic_examples=64",
      "--batch_size_per_replica=4", "--train_steps=1", "--noexport",
      "--cpu_devices=2", "--sync_batchnorm", "--nofused_batchnorm",
      f"--model_dir={tmp_path / 'keras_sync'}"))
  out, err = off.communicate(timeout=180)
  assert off.returncode == 0, out + err[-2000:]
  assert json.loads(out)["empty_conv_shape"] == [0, 16, 16, 16]
  out, err = on.communicate(timeout=180)
  faulty = json.loads(out)
  if faulty["onednn_active"]:
    # If this fails, this TensorFlow computes empty-batch convolutions right
    # with oneDNN on: engine/onednn.py's one exception can go.
    assert on.returncode == 1 and faulty["empty_conv_shape"] == [0, 32, 32, 3]
  # Keras's synchronized BatchNorm on 2 replicas: the command line turned
  # oneDNN off before TensorFlow read the variable, and says so.
  out, err = keras_sync.communicate(timeout=300)
  assert keras_sync.returncode == 0, err[-2000:]
  summary = json.loads((tmp_path / "keras_sync" / "summary.json").read_text())
  assert summary["onednn"] is False
  assert summary["onednn_source"].startswith(f"engine ({onednn.ENV}=0: ")
  assert "oneDNN off: engine (" in err


@pytest.mark.parametrize("sync", [False, True])
def test_empty_replicas_train_and_evaluate_as_one_device(tmp_path, sync):
  # 4 replicas of 2 rows against one device of 8: the second batch holds
  # one example, so three replicas get none, in training and in evaluation.
  base = dict(epochs=1, steps_per_loop=1, log_every=1, eval_every=1,
              optimizer="sgd", learning_rate=0.1, shuffle_buffer=0,
              sync_batchnorm=sync, export=False)
  four = engine.run(conv_bn_task(9, (4, 8)), Config.create(
      cpu_devices=4, batch_size_per_replica=2,
      model_dir=str(tmp_path / "four"), **base))
  # TensorFlow's default here: on on x86 (the fault's condition), and said.
  assert four.summary["onednn"] is onednn.active()
  assert four.summary["onednn_source"].startswith(("TensorFlow's default",
                                                   "user ("))
  assert len(four.losses) == 2
  # Every replica's moving statistics stay finite (an empty batch's moments
  # are NaN), so the evaluation, where each replica uses its own, is too.
  assert np.isfinite(four.summary["eval_loss"])
  if sync:  # global moments: the same computation as one device
    # (Per-replica moments are not: the one-device run is only needed here.)
    one = engine.run(conv_bn_task(9, (4, 8)), Config.create(
        strategy="one_device", batch_size_per_replica=8,
        model_dir=str(tmp_path / "one"), **base))
    np.testing.assert_allclose(four.losses, one.losses, rtol=1e-5)
    assert max_diff(four.weights, one.weights) < 1e-5
    np.testing.assert_allclose(four.summary["eval_loss"],
                               one.summary["eval_loss"], rtol=1e-5)


def test_keras_sync_batchnorm_on_cpu_replicas_is_refused_with_onednn_on(
    tmp_path):
  config = tiny_config(model="mobilenet_v2", cpu_devices=2,
                       sync_batchnorm=True, fused_batchnorm=False,
                       model_dir=str(tmp_path / "m"))
  if not onednn.active():
    pytest.skip("oneDNN is off in this process: nothing to refuse")
  with pytest.raises(ConfigError, match="^--sync_batchnorm with "
                     "--nofused_batchnorm on several CPU replicas"):
    run_job(config)
  model_dir = tmp_path / "m"  # refused before anything was written
  assert not model_dir.exists() or not any(model_dir.iterdir())


@pytest.mark.parametrize("fields,faulty", [
    (dict(sync_batchnorm=True, fused_batchnorm=False, cpu_devices=2), True),
    (dict(sync_batchnorm=True, fused_batchnorm=False,
          strategy="multi_worker"), True),
    (dict(sync_batchnorm=True, fused_batchnorm=False,
          strategy="one_device"), False),
    (dict(sync_batchnorm=True, cpu_devices=2), False),
    (dict(cpu_devices=4), False), (dict(), False)])
def test_faulty_by_flags(fields, faulty):
  assert onednn.faulty(Config.create(**fields)) is faulty
  # Never once TensorFlow is imported (this process): too late to matter.
  assert not onednn.turn_off_for(Config.create(**fields))
