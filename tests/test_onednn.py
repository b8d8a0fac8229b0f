"""The engine's oneDNN default against tests/onednn_repro.py (plain TF)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, engine_cmd, run_job, tiny_config
from engine import Config, onednn

REPRO = os.path.join(ROOT, "tests", "onednn_repro.py")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop(onednn.ENV, None)  # the engine's choice, as for a user


def _start(argv, **env):
  return subprocess.Popen(argv, env=dict(ENV, **env), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_engine_defaults_avoid_the_empty_batch_conv_fault(tmp_path):
  # The TensorFlow processes at once: each spends most of its time importing.
  default = _start([sys.executable, REPRO],
                   **{onednn.ENV: onednn.ENGINE_DEFAULT})
  on = _start([sys.executable, REPRO], **{onednn.ENV: "1"})
  one = _start(engine_cmd(
      "--model=small_cnn", "--image_size=32", "--synthetic_examples=64",
      "--batch_size_per_replica=8", "--train_steps=2", "--noexport",
      "--strategy=one_device", f"--model_dir={tmp_path / 'one'}"))
  out, err = default.communicate(timeout=180)
  assert default.returncode == 0, out + err[-2000:]
  assert json.loads(out)["empty_conv_shape"] == [0, 16, 16, 16]
  out, err = on.communicate(timeout=180)
  faulty = json.loads(out)
  if faulty["onednn_active"]:
    # If this fails, this TensorFlow computes empty-batch convolutions
    # right with oneDNN on: turn it back on (engine/onednn.py, the docs).
    assert on.returncode == 1 and faulty["empty_conv_shape"] == [0, 32, 32, 3]
  # Several replicas (in this process, engine imported first): off.
  summary = run_job(tiny_config(cpu_devices=2,
                                model_dir=str(tmp_path / "two"))).summary
  assert summary["onednn"] is False
  # "engine default": a plain pytest run. Under pytest-xdist the workers
  # inherit the variable that the controller's engine import set, which
  # then reads as the user's.
  assert summary["onednn_source"].startswith(
      ("engine default", f"user ({onednn.ENV}=0)"))
  # One replica from the command line: back on, and said so.
  out, err = one.communicate(timeout=180)
  assert one.returncode == 0, err[-2000:]
  summary = json.loads((tmp_path / "one" / "summary.json").read_text())
  assert summary["onednn"] is faulty["onednn_active"], summary
  assert summary["onednn_source"].startswith("engine (")
  assert "oneDNN on: engine (" in err or not faulty["onednn_active"]


@pytest.mark.parametrize("fields,one", [
    (dict(strategy="one_device"), True), (dict(cpu_devices=1), True),
    (dict(cpu_devices=2), False), (dict(), False),
    (dict(devices=["/cpu:0"]), True)])
def test_one_replica_by_flags(fields, one):
  assert onednn.one_replica(Config.create(**fields).distribution) is one
  # Never once TensorFlow is imported (this process): too late to matter.
  assert not onednn.prefer_for(Config.create(**fields).distribution, True)
