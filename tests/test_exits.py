"""Exit paths keep docs/reference/exit-codes.md's promises: one line on
stderr, the documented exit code, no traceback, nothing overwritten."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import forkserver
from conftest import ROOT, engine_cmd, job, run_job
import engine
from engine.launch import free_ports

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
TINY = ["--model=small_cnn", "--image_size=32", "--synthetic_examples=128",
        "--batch_size_per_replica=8", "--log_every=4", "--steps_per_loop=4",
        "--noexport"]


def run(cmd, timeout=120):
  return forkserver.run(cmd, cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=timeout)


def one_error_line(out):
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  errors = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1, out.stderr[-3000:]
  return errors[0]


def test_unwritable_export_dir_is_refused_before_training(tmp_path):
  """A ConfigError found by the run (engine/core/roles.py), checked
  in-process: the command line prints it as one line, exit 2, as
  tests/test_cli.py's unwritable --model_dir run shows for the same check."""
  with pytest.raises(engine.ConfigError) as caught:
    run_job(job(model="small_cnn", image_size=32, synthetic_examples=128,
                batch_size_per_replica=8, train_steps=2, export=True,
                export_dir="/proc/x", model_dir=str(tmp_path)))
  line = f"error: {caught.value}"
  assert "\n" not in line and line.startswith(
      "error: --export_dir=/proc/x: cannot be written"), line
  assert os.listdir(tmp_path) == []  # nothing trained, nothing written


def test_a_finished_run_says_so_and_keeps_its_summary(tmp_path):
  # The finished run is trained in this process through the API (the same
  # job and devices as the CLI's flags: one process start fewer); the CLI
  # then finds it finished, and the API trains it further when asked to.
  fields = dict(model="small_cnn", image_size=32, synthetic_examples=128,
                batch_size_per_replica=8, log_every=4, steps_per_loop=4,
                export=False, cpu_devices=1, model_dir=str(tmp_path))
  finished = run_job(job(train_steps=4, **fields))
  assert finished.summary["global_step"] == 4
  cmd = engine_cmd(*TINY, "--cpu_devices=1", "--train_steps=4",
                   f"--model_dir={tmp_path}")
  before = (tmp_path / "summary.json").read_bytes()
  files = sorted(os.listdir(tmp_path / "checkpoints"))
  again = run(cmd)
  assert again.returncode == 0, again.stderr[-2000:]
  lines = [l for l in again.stderr.splitlines() if "nothing to train" in l]
  assert len(lines) == 1, again.stderr[-2000:]
  assert (f"nothing to train: {tmp_path} already holds step 4 of 4; start "
          "over with a new --model_dir, or train further with a larger "
          "--train_steps or --epochs.") in lines[0]
  assert "| loss " not in again.stderr
  assert (tmp_path / "summary.json").read_bytes() == before
  assert sorted(os.listdir(tmp_path / "checkpoints")) == files
  # Trained further (in this process again: the CLI's training runs this
  # same engine.run, and its resume is in many tests).
  further = run_job(job(train_steps=8, **fields))
  assert further.summary["global_step"] == 8
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["start_step"] == 4 and summary["global_step"] == 8


@pytest.mark.parametrize("flag, line", [
    ("--no_such_flag=1", "error: Unknown command line flag 'no_such_flag'"),
    ("--grad_compression=int8",
     "error: flag --grad_compression=int8: value should be one of"),
    ("--mixed_precision=fp8",
     "error: flag --mixed_precision=fp8: value should be one of"),
    ("--flagfile=/no/such/file", "error: "),
])
def test_flag_errors_absl_catches_are_one_line_and_exit_2(tmp_path, flag,
                                                          line):
  out = run(engine_cmd(*TINY, flag, f"--model_dir={tmp_path}"))
  assert out.returncode == 2, out.stderr[-2000:]
  assert one_error_line(out).startswith(line)


def test_launcher_refuses_strategies_other_than_multi_worker():
  # --strategy=multi_worker is accepted: tests/test_partial_batch.py's
  # test_two_workers_match_one_device_with_partial_batches trains 2 workers
  # with it (one launch fewer here).
  launch = [sys.executable, "-m", "engine.launch", "--num_workers=2", "--"]
  out = run([*launch, "--strategy=mirrored", *TINY])
  assert out.returncode == 2
  assert one_error_line(out).startswith(
      "error: --strategy=mirrored: the launcher sets this flag itself "
      "(--strategy=multi_worker and the cluster); drop it.")


def _wait(path, deadline):
  while time.monotonic() < deadline and not os.path.exists(path):
    time.sleep(0.1)
  return os.path.exists(path)


@pytest.mark.parametrize("phase", ["collective", "between", "eval", "save"])
def test_a_killed_peer_ends_the_run_with_exit_3(tmp_path, phase):
  """Worker 1 is killed while worker 0 waits in a collective, is between two
  host calls, is evaluating, or is saving a checkpoint (tests/paused_job.py
  pauses the worker in that phase at step 8 while the test kills the peer)."""
  ports = free_ports(2)
  hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
  # "collective": worker 1 pauses between host calls, so worker 0 goes on
  # into the next call's all-reduce and waits there when worker 1 dies.
  env = dict(ENV, PAUSE_IN="between" if phase == "collective" else phase,
             PAUSE_STEP="8", PAUSE_DIR=str(tmp_path),
             PAUSE_TASK="1" if phase == "collective" else "0")
  flags = [*TINY, "--train_steps=100000", "--checkpoint_every=8",
           "--eval_split=train[:32]", "--eval_every=8",
           f"--model_dir={tmp_path / 'm'}"]
  logs = [tmp_path / f"w{i}.log" for i in range(2)]
  procs = [forkserver.Popen(
      [sys.executable, os.path.join("tests", "paused_job.py"),
       "--strategy=multi_worker", f"--worker_hosts={hosts}",
       f"--task_index={i}", *flags], cwd=ROOT, env=env,
      stdout=open(logs[i], "w"), stderr=subprocess.STDOUT,
      start_new_session=True) for i in range(2)]
  try:
    assert _wait(tmp_path / "paused", time.monotonic() + 120), (
        logs[0].read_text()[-2000:])
    if phase == "collective":
      time.sleep(1.0)  # worker 0 is in its next all-reduce by now
    os.killpg(procs[1].pid, signal.SIGKILL)
    procs[1].wait(10)
    open(tmp_path / "go", "w").close()
    code = procs[0].wait(60)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
  text = logs[0].read_text()
  assert code == 3, text[-3000:]
  assert "Traceback" not in text, text[-3000:]
  assert "terminate called" not in text, text[-3000:]  # engine/ending.py
  errors = [l for l in text.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1, text[-3000:]
  assert errors[0].startswith(f"error: lost task worker:1 (127.0.0.1:"
                              f"{ports[1]}): "), errors
