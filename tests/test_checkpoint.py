"""Checkpoints: exact resume, preemption, kills during saves, NaN guard."""
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import tensorflow as tf

import forkserver
from conftest import ROOT, engine_cmd, job, run_job, tiny_config
import engine
from engine.core import checkpoint
from engine.errors import ConfigError
import test_multi_worker as mw


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
  """Partial batches too; host calls of --steps_per_loop=auto (the
  default), whose lengths differ between the runs. The interrupted run
  starts from the uninterrupted run's checkpoint of step 5
  (tests/test_multi_worker.py's `start_from_checkpoint`: a periodic
  checkpoint is the state a run stopped there saves; a run stopped by
  SIGTERM and resumed is test_sigterm_then_sigkills_..., below)."""
  kw = dict(cpu_devices=2, optimizer="adam", learning_rate=0.01,
            synthetic_examples=40, steps_per_loop="auto")
  whole = run_job(tiny_config(train_steps=12, checkpoint_every=5,
                              model_dir=str(tmp_path / "whole"), **kw))
  mw.start_from_checkpoint(tmp_path / "whole", tmp_path / "parts", 5)
  rest = run_job(tiny_config(train_steps=12,
                             model_dir=str(tmp_path / "parts"), **kw))
  assert rest.summary["start_step"] == 5 and rest.summary["global_step"] == 12
  np.testing.assert_allclose(rest.losses, whole.losses[5:], rtol=0, atol=1e-6)
  assert rest.summary["final_loss"] == pytest.approx(
      whole.summary["final_loss"], abs=1e-6)
  for a, b in zip(rest.weights, whole.weights):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """A model_dir of 2 steps on 2 replicas (global batch 16), trained once
  for the module; each test below resumes a copy of it."""
  model_dir = tmp_path_factory.mktemp("two_steps") / "m"
  run_job(tiny_config(cpu_devices=2, train_steps=2, model_dir=str(model_dir)))
  return model_dir


def _copy(model_dir, tmp_path):
  to = tmp_path / "m"
  shutil.copytree(model_dir, to)
  return to


def test_resume_with_another_global_batch_is_refused(two_steps, tmp_path):
  """Another replica count with the same global batch resumes as it is
  (tests/test_multi_worker.py and test_partial_batch.py check that it trains
  on exactly); another global batch is refused with its reason, unless
  --allow_resume_change."""
  model_dir = _copy(two_steps, tmp_path)
  with pytest.raises(ConfigError) as e:
    run_job(tiny_config(cpu_devices=2, batch_size_per_replica=4,
                        train_steps=4, model_dir=str(model_dir)))
  assert str(e.value) == (
      f"--model_dir={model_dir}: was trained with a global batch of 16, this "
      "run has 8: the step, the position in the data and the learning-rate "
      "schedule all count global batches, so resuming would train other "
      "examples at other rates. Resume with a global batch of 16 (any "
      "number of replicas or workers), or pass --allow_resume_change to "
      "accept that.")
  ok = run_job(tiny_config(cpu_devices=4, batch_size_per_replica=2,
                           train_steps=4, allow_resume_change=True,
                           model_dir=str(model_dir)))
  assert ok.summary["start_step"] == 2 and ok.summary["global_step"] == 4
  assert ok.summary["global_batch_size"] == 8


@pytest.mark.parametrize("saved,now,refused", [
    # The default reader: any worker count, the same global batch.
    ((2, 2, 16, False), (1, 1, 16, False), False),
    ((1, 1, 16, False), (4, 4, 16, False), False),
    ((2, 2, 16, None), (3, 3, 16, False), False),  # an older run.json
    ((2, 2, 16, False), (2, 2, 8, False), True),
    # --shard_files: each worker reads its own files.
    ((2, 2, 16, True), (2, 2, 16, True), False),
    ((2, 2, 16, True), (4, 2, 16, True), False),  # 2 replicas per worker
    ((2, 2, 16, True), (1, 1, 16, True), True),
    ((2, 2, 16, False), (2, 2, 16, True), True),
])
def test_which_resumes_change_the_results(saved, now, refused):
  def identity(replicas, workers, batch, shard_files):
    out = checkpoint.run_identity({"task": "t"}, replicas, batch, workers,
                                  bool(shard_files))
    if shard_files is None:  # written before num_workers and shard_files
      del out["num_workers"], out["shard_files"]
    return out
  change = checkpoint.resume_change(identity(*saved), identity(*now))
  assert bool(change) is refused, change
  if change and (saved[3] or now[3]):
    assert "with --shard_files each worker reads its own files" in change


def test_foreign_or_unreadable_checkpoint_is_refused(two_steps, tmp_path):
  model_dir = _copy(two_steps, tmp_path)
  with pytest.raises(ConfigError, match="another run .*model='small_cnn'"):
    run_job(tiny_config(cpu_devices=2, train_steps=2, model="mobilenet_v2",
                        model_dir=str(model_dir)))
  ckpt_dir = model_dir / "checkpoints"
  index = ckpt_dir / "ckpt-2.index"
  index.write_bytes(b"not a checkpoint")
  before = sorted((p.name, p.stat().st_mtime_ns) for p in ckpt_dir.iterdir())
  with pytest.raises(ConfigError, match="cannot be restored"):
    run_job(tiny_config(cpu_devices=2, train_steps=4,
                        model_dir=str(model_dir)))
  after = sorted((p.name, p.stat().st_mtime_ns) for p in ckpt_dir.iterdir())
  assert before == after  # nothing overwritten


TINY = ["--model=small_cnn", "--image_size=32", "--synthetic_examples=256",
        "--batch_size_per_replica=8", "--cpu_devices=2", "--log_every=1"]


def _start(*flags):
  return forkserver.Popen(engine_cmd(*TINY, *flags), cwd=ROOT, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for_step(proc, step, timeout=120):
  """Reads stderr until the progress line of `step` appears."""
  deadline = time.monotonic() + timeout
  lines = []
  while time.monotonic() < deadline:
    line = proc.stderr.readline()
    if not line:
      break
    lines.append(line)
    if f"step {step}/" in line:
      return lines
  proc.kill()
  raise AssertionError("never reached step %d:\n%s" % (step, "".join(lines)))


def _finish(proc, timeout=120):
  try:
    _, err = proc.communicate(timeout=timeout)
  finally:
    proc.kill()
  return proc.returncode, err


def _latest_step(model_dir):
  latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
  return int(latest.rsplit("-", 1)[1]) if latest else None


def test_sigterm_then_sigkills_while_saving_leave_a_checkpoint_to_resume(
    tmp_path):
  """One model_dir, three processes: a SIGTERM saves at the step reached
  (exit 75); the resumed run, saving after every step, is SIGKILLed 0.05 s
  after a step's progress line, and so is the run resumed from that (0.3 s):
  a kill lands during a save or between two, and the latest checkpoint is
  restorable each time; the last run (in-process) resumes from it and
  finishes.

  (The three scenarios were separate tests of 2 processes each: the runs
  that resumed only to finish are now the next scenario's run.)
  """
  proc = _start("--train_steps=100000", "--steps_per_loop=2",
                f"--model_dir={tmp_path}")
  _wait_for_step(proc, 10)
  proc.send_signal(signal.SIGTERM)
  code, err = _finish(proc)
  assert code == engine.ExitCode.PREEMPTED, err[-2000:]
  reached = int(err.split("SIGTERM at step ")[1].split(";")[0])
  assert reached >= 10 and _latest_step(tmp_path) == reached
  saved = reached
  for delay in (0.05, 0.3):
    proc = _start("--train_steps=100000", "--steps_per_loop=1",
                  "--checkpoint_every=1", "--keep_checkpoints=2",
                  f"--model_dir={tmp_path}")
    lines = _wait_for_step(proc, saved + 5)
    assert any(f"Resumed from {tmp_path}/checkpoints/ckpt-{saved} at step "
               f"{saved}." in l for l in lines), "".join(lines)[-2000:]
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    _finish(proc)
    before, saved = saved, _latest_step(tmp_path)
    assert saved is not None and saved >= before + 4, (before, saved)
  # The last run resumes from it and finishes: in this process, the job of
  # TINY's flags through the API (restoring is the engine's, not the
  # command line's; one TensorFlow start fewer).
  last = run_job(job(model="small_cnn", image_size=32, synthetic_examples=256,
                     batch_size_per_replica=8, cpu_devices=2, log_every=1,
                     export=False, train_steps=saved + 3,
                     model_dir=str(tmp_path)))
  assert last.summary["start_step"] == saved
  assert last.summary["global_step"] == saved + 3


def test_nan_stops_names_the_step_and_keeps_finite_weights(tmp_path):
  proc = forkserver.run(
      engine_cmd(*TINY, "--optimizer=sgd", "--learning_rate=1e6",
                 "--train_steps=200", "--checkpoint_every=1",
                 "--steps_per_loop=1", f"--model_dir={tmp_path}"),
      cwd=ROOT, capture_output=True, text=True, timeout=180)
  assert proc.returncode == 4, proc.stderr[-2000:]
  line = [l for l in proc.stderr.splitlines() if l.startswith("error:")][0]
  assert "training diverged" in line and " at step " in line
  bad_step = int(line.split(" at step ")[1].split(";")[0])
  latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
  assert latest is not None and _latest_step(tmp_path) == bad_step - 1
  reader = tf.train.load_checkpoint(latest)
  for name, dtype in reader.get_variable_to_dtype_map().items():
    if dtype.is_floating:
      assert np.all(np.isfinite(reader.get_tensor(name))), name
