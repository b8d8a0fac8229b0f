"""The engine's oneDNN default against tests/onednn_repro.py (plain TF)."""
import json
import os
import subprocess
import sys

from conftest import ROOT, run_job, tiny_config
from engine import onednn

REPRO = os.path.join(ROOT, "tests", "onednn_repro.py")


def _repro(value):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env[onednn.ENV] = value
  return subprocess.Popen([sys.executable, REPRO], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_engine_default_avoids_the_empty_batch_conv_fault(tmp_path):
  # Both TensorFlow processes at once: each spends most of its time importing.
  default, on = _repro(onednn.ENGINE_DEFAULT), _repro("1")
  out, err = default.communicate(timeout=120)
  assert default.returncode == 0, out + err[-2000:]
  assert json.loads(out)["empty_conv_shape"] == [0, 16, 16, 16]
  out, err = on.communicate(timeout=120)
  faulty = json.loads(out)
  if faulty["onednn_active"]:
    # If this fails, this TensorFlow computes empty-batch convolutions
    # right with oneDNN on: turn it back on (engine/onednn.py, the docs).
    assert on.returncode == 1 and faulty["empty_conv_shape"] == [0, 32, 32, 3]
  # What the run reports: the engine chose, and TensorFlow obeyed.
  summary = run_job(tiny_config(model_dir=str(tmp_path))).summary
  assert summary["onednn"] is False
  assert summary["onednn_source"].startswith("engine default")
