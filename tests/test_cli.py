"""`python -m engine.main` end to end, as users run it, in subprocesses."""
import json
import os
import subprocess
import sys

import pytest

import forkserver
from conftest import ROOT, engine_cmd

TINY = ["--model=small_cnn", "--image_size=32", "--synthetic_examples=128",
        "--batch_size_per_replica=8", "--log_every=4", "--steps_per_loop=4"]


def run_engine(*flags, timeout=240):
  return forkserver.run(engine_cmd(*flags), cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def test_train_writes_summary_and_logs_progress(tmp_path):
  """Also --flagfile: the job's flags from a file, --model_dir on the
  command line beside it (the flagfile test with --strategy=one_device was
  a second training process; the strategy comes from the same config
  in-process runs make, e.g. test_eval_mode's one_device runs)."""
  flagfile = tmp_path / "job.flags"
  flagfile.write_text("\n".join(TINY + ["--cpu_devices=2", "--epochs=2"]))
  proc = run_engine(f"--flagfile={flagfile}", f"--model_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  for key in ("global_step", "final_loss", "final_accuracy",
              "examples_per_sec", "num_replicas", "strategy",
              "cross_device_ops"):
    assert key in summary
  assert summary["global_step"] == 16  # 128 / (8 * 2) * 2 epochs
  assert summary["num_replicas"] == 2
  assert summary["strategy"] == "mirrored"
  assert summary["cross_device_ops"] == "auto"
  # The command line chooses the allocator before TensorFlow's first op.
  assert summary["cpu_allocator"] == "bfc"
  assert "CPU tensors from TensorFlow's BFC pool (--cpu_allocator=bfc)." in (
      proc.stderr)
  assert summary["examples_per_sec"] > 0
  assert 0.0 <= summary["final_accuracy"] <= 1.0
  progress = [l for l in proc.stderr.splitlines() if "| loss " in l]
  assert [l.split("step ")[1].split(" ")[0] for l in progress] == [
      "4/16", "8/16", "12/16", "16/16"]
  assert "examples/s" in progress[-1]
  assert "ETA" not in proc.stdout  # no terminal: log lines, no progress bar
  assert "Global batch 16 on 1 worker(s)" in proc.stderr


def test_helpfull_lists_the_contract_flags():
  proc = run_engine("--helpfull", timeout=120)
  assert proc.returncode == 1  # absl's help flags print and exit 1
  assert "engine/main.py:" in proc.stdout
  for flag in ("--strategy", "--cross_device_ops", "--devices", "--cpu_devices",
               "--model", "--dataset", "--image_size", "--epochs",
               "--train_steps", "--batch_size_per_replica", "--optimizer",
               "--learning_rate", "--steps_per_loop", "--log_every",
               "--model_dir", "--seed"):
    assert flag in proc.stdout


@pytest.mark.parametrize("flags,expected", [
    # Refused by the flags alone, before TensorFlow is imported.
    (["--batch_size_per_replica=0"],
     "error: --batch_size_per_replica=0: must be a positive integer."),
    (["--steps_per_loop=0"], "error: --steps_per_loop=0: must be a positive"),
    (["--learning_rate=-1"], "error: --learning_rate=-1.0: must be positive."),
    (["--epochs=0", "--train_steps=0"], "error: --epochs=0: must be positive"),
    (["--strategy=bogus"], "flag --strategy=bogus: value should be one of"),
    # Refused after TensorFlow is imported (a ConfigError from the run, as
    # the cases of the next test are; one process start shows the form).
    (["--model_dir=/proc/no_such_dir"],
     "error: --model_dir=/proc/no_such_dir: cannot be written"),
])
def test_bad_input_is_one_line_without_traceback(flags, expected):
  proc = run_engine(*TINY, "--train_steps=1", *flags, timeout=120)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines()
            if l.startswith(("error:", "FATAL"))]
  assert len(errors) == 1, proc.stderr[-2000:]
  assert errors[0].startswith(expected) or expected in errors[0], errors[0]


@pytest.mark.parametrize("fields,expected", [
    (dict(cross_device_ops="nccl", cpu_devices=2),
     "error: --cross_device_ops=nccl: NCCL needs GPUs"),
    (dict(devices=("/gpu:3",)),
     "error: --devices=/gpu:3: /gpu:3 does not exist"),
    (dict(model="resnet"),
     "error: --model=resnet: unknown; valid: mobilenet_v2, small_cnn."),
    (dict(dataset="no_such_data_set_xyz"),
     "error: --dataset=no_such_data_set_xyz: is neither 'synthetic' nor"),
    (dict(image_size=-3), "error: --image_size=-3: must be at least 32"),
])
def test_bad_input_found_by_the_run_is_one_config_error(tmp_path, fields,
                                                        expected):
  """The command line prints a ConfigError as `error: <message>`, exit 2
  (engine/cli.py; the --model_dir case above runs it): these are found by
  the run, in-process here, without a TensorFlow import per case."""
  import engine  # pylint: disable=g-import-not-at-top
  from conftest import run_job, tiny_config  # pylint: disable=g-import-not-at-top
  with pytest.raises(engine.ConfigError) as caught:
    run_job(tiny_config(train_steps=1, model_dir=str(tmp_path), **fields))
  message = f"error: {caught.value}"
  assert "\n" not in message and message.startswith(expected), message
  assert not os.path.exists(tmp_path / "checkpoints" / "checkpoint")


@pytest.mark.parametrize("given", [None, "0", "1"])
def test_importing_the_engine_leaves_onednn_to_tensorflow(given):
  env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
  env["TF_CPP_MIN_LOG_LEVEL"] = "0"  # TF logs whether oneDNN ops are on
  if given is not None:
    env["TF_ENABLE_ONEDNN_OPTS"] = given
  code = ("import engine, os, tensorflow; "
          "print(os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset'))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120,
                       check=True)
  assert out.stdout.strip() == (given or "unset")
  if given == "0":  # TF read the value: it does not announce the rewrites
    assert "oneDNN custom operations are on" not in out.stderr
