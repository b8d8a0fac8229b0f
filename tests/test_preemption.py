"""Coordinated preemption: every replica and worker saves at the same step.

In-process tests cover the flag exchange and the local (mirrored) agreement;
the launcher test runs 2 real workers, preempts them twice (SIGTERM to one
worker, then to the launcher; the second launch resumes the first's
checkpoint and, in between, loses a worker to SIGKILL and restarts: the
launcher's restart after a lost worker, formerly a launch of its own in
tests/test_multi_worker.py), trains the last checkpoint on and compares with
a run that was never interrupted.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import run_job, tiny_config, train_batches
import engine
from engine import hooks
from engine.core import model_building, step
from engine.core.optimizers import create_optimizer
from engine.distribute import strategy as strategy_lib
from engine import launch as launcher
from test_multi_worker import (_kill, _launched_pid, _start, _wait_for, lr,
                               tiny_flags)

# The runs go on TAIL steps after the second preemption's step (each run
# stopped 10-20 steps after its signal on 2 loaded cores, at about steps 20
# and 50).
TAIL = 10
FLAGS = dict(optimizer="adam", learning_rate=lr("adam"), steps_per_loop=5,
             log_every=5, weights_out="w.npz")


@pytest.mark.parametrize("kw,replicas", [
    (dict(strategy="one_device"), 1), (dict(cpu_devices=2), 2),
    (dict(cpu_devices=4, cross_device_ops="ring"), 4)])
def test_host_call_sums_every_replicas_vote(kw, replicas):
  """The votes ride in the loop's end-of-call all-reduce (on multi_worker;
  here the same code sums the local replicas), and so does the length of the
  next host call that replica 0 (the chief's) proposes: every replica gets
  that one, not a sum (engine/core/pace.py)."""
  job = tiny_config(**kw)
  config = job.config
  strategy = strategy_lib.make_strategy(config.distribution)
  task = job.task()
  with strategy.scope():
    model = model_building.build_model(
        task, mixed_precision=config.optimization.mixed_precision,
        batchnorm=config.batchnorm)
    optimizer = create_optimizer(config.optimization)
    optimizer.build(model.trainable_variables)
  dataset = train_batches(job, 8 * replicas, with_rows=True)[0]
  objective = step.resolve(task, model, dataset.element_spec)
  loop = step.make_train_loop(strategy, step.make_replica_step(
      objective, model, optimizer, distribution=config.distribution,
      optimization=config.optimization, batchnorm=config.batchnorm,
      batch_size_per_replica=8),
      step.sum_names(objective), exchange_votes=True)
  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  for vote, proposal in ((0.0, 1.0), (1.0, 37.0), (2.0 ** 16, 100000.0)):
    rows, votes, _ = loop(iterator, tf.constant(2),
                          tf.constant([vote, proposal]))
    assert rows.shape[0] == 2
    assert votes.numpy().tolist() == [vote * replicas, proposal]


class _SignalAt(hooks.Hook):
  """Sends this process `signum` after the host call that ends at `at`."""

  def __init__(self, at, signum):
    self._at, self._signum = at, signum

  def after_loop(self, step, rows, seconds):
    if step == self._at:
      os.kill(os.getpid(), self._signum)


@pytest.mark.parametrize("signum,sync", [(signal.SIGTERM, True),
                                         (signal.SIGINT, False)])
def test_signal_on_mirrored_saves_at_the_boundary_reached(tmp_path, signum,
                                                          sync):
  before = signal.getsignal(signum)
  # Host calls end at steps 1, 4, 7, ...: the signal after step 4 is acted on
  # at that same boundary, on both replicas.
  with pytest.raises(engine.Preempted,
                     match=f"{signal.Signals(signum).name} at step 4; "):
    run_job(tiny_config(cpu_devices=2, train_steps=30,
                            preemption_sync=sync, model_dir=str(tmp_path)),
                hooks=[_SignalAt(4, signum)])
  latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
  assert latest.endswith("ckpt-4")
  assert signal.getsignal(signum) is before  # handlers given back


def _exiting(*codes):
  """Stand-in workers (no TensorFlow): code None sleeps until killed."""
  return [subprocess.Popen(
      [sys.executable, "-c", "import time; time.sleep(600)" if c is None else
       f"import sys; sys.exit({c})"], start_new_session=True) for c in codes]


@pytest.mark.parametrize("codes,interrupted,want", [
    ((75, 75), [], 75), ((75, 75), [signal.SIGTERM], 75), ((0, 0), [], 0),
    ((75, 3), [], 1), ((75, 3), [signal.SIGINT], 128 + signal.SIGINT),
    ((75, None), [signal.SIGTERM], 128 + signal.SIGTERM)])
def test_launcher_exit_code_after_a_preemption(codes, interrupted, want):
  procs = _exiting(*codes)
  start = time.monotonic()
  assert launcher._preempted(procs, [], 2.0, interrupted, "test") == want
  assert time.monotonic() - start < 20  # bounded: the sleeper was killed
  assert all(p.poll() is not None for p in procs)


RESTART = "launcher: restart 1/1"


def _resumed_step(text):
  """The step the last "Resumed from" line in `text` names, None without."""
  steps = re.findall(r"Resumed from \S+ at step (\d+)\.", text)
  return int(steps[-1]) if steps else None


def _launch_and_preempt(model_dir, log, target, after_step, lose_worker=False):
  """Starts 2 workers, SIGTERMs `target` once `after_step` is logged.

  `lose_worker`: once `after_step` is logged, SIGKILLs worker 1 instead; the
  launcher (--max_restarts=1) restarts both from the latest checkpoint, and
  `target` gets the SIGTERM 2 host calls after the restart's resume step.

  Returns:
    (launcher log text, launcher exit code).
  """
  # --max_restarts=1: a preemption must still not restart.
  proc = _start([sys.executable, "-m", "engine.launch", "--num_workers=2",
                 "--max_restarts=1", "--",
                 *tiny_flags(train_steps=100000, model_dir=str(model_dir),
                             **FLAGS)], open(log, "w"))
  try:
    assert _wait_for(lambda: log.read_text().splitlines(),
                     f"step {after_step}/", time.monotonic() + 120), (
                         log.read_text()[-3000:])
    if lose_worker:
      os.kill(_launched_pid(log, 1), signal.SIGKILL)
      restarted = lambda: log.read_text().partition(RESTART)[2]
      deadline = time.monotonic() + 120
      while (_resumed_step(restarted()) is None and
             time.monotonic() < deadline):
        time.sleep(0.2)
      resumed = _resumed_step(restarted())
      assert resumed is not None, log.read_text()[-3000:]
      assert _wait_for(lambda: restarted().splitlines(),
                       f"step {(resumed // 5 + 2) * 5}/", deadline), (
                           log.read_text()[-3000:])
    os.kill(proc.pid if target == "launcher" else _launched_pid(log, 1),
            signal.SIGTERM)
    code = proc.wait(120)
  finally:
    _kill([proc])
  return log.read_text(), code


def _check_restart(text, resumed_from):
  """A lost worker (SIGKILL) was reported, the other stopped, and all
  restarted once, from `resumed_from` or from the checkpoint the chief saved
  at the step it reached when the launcher stopped it (SIGTERM) after the
  loss (which one depends on where the chief was at that moment). Returns
  the restart's part of `text` and its resume step."""
  before, restart, after = text.partition(RESTART)
  assert restart and text.count("launcher: restart") == 1, text[-3000:]
  # The loss is reported and the others stopped before the restart (the
  # same path ends a launch without --max_restarts with exit 1, as
  # test_multi_worker's test_launcher_gives_up_after_max_restarts checks
  # once restarts are used up).
  reported = "launcher: worker 1 exited with code -9; stopped the others."
  assert before.count(reported) == 1 and reported not in after, text[-3000:]
  # The SIGKILLed non-chief could not remove its temporary output
  # directory; the launcher removes the TMPDIR it gave the workers, of each
  # attempt.
  scratch = [line.split()[5] for line in text.splitlines()
             if line.startswith("launcher: workers' temporary files")]
  assert len(scratch) == 2 and scratch[0] != scratch[1], scratch
  for d in scratch:
    assert d.startswith(tempfile.gettempdir())
    assert not os.path.exists(d)
  start = _resumed_step(after)
  assert start == resumed_from or (
      start > resumed_from and
      f"[worker 0] preempted: SIGTERM at step {start}; " in before), (
          start, text[-3000:])
  return after, start


def _agreed_step(text, model_dir):
  """The one step both workers saved at, from the logs and from model_dir.

  Returns:
    ({worker: the reason it logged}, the step).
  """
  said = {int(i): (reason, int(s)) for i, reason, s in re.findall(
      r"\[worker (\d)\] preempted: (.*) at step (\d+); checkpoint saved, exit "
      r"code 75\.", text)}
  assert sorted(said) == [0, 1], text[-3000:]
  steps = {s for _, s in said.values()}
  assert len(steps) == 1, said
  reached = steps.pop()
  saved = {int(i): int(s) for i, s in re.findall(
      r"\[worker (\d)\] .*Saved checkpoint \S+/checkpoints/ckpt-(\d+)\.",
      text)}
  # Only the chief logs at info level; worker 1's own "checkpoint saved"
  # line above says it saved at the same step.
  assert saved == {0: reached}, saved
  latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
  assert latest.endswith(f"ckpt-{reached}")
  assert ("launcher: all 2 workers saved a checkpoint at the same step; "
          "exiting with 75.") in text
  assert "launcher: restart" not in text
  return {i: r for i, (r, _) in said.items()}, reached


def test_sigterm_to_a_worker_then_to_the_launcher_resumes_exactly(tmp_path):
  """Preempted twice (worker 1, then the launcher), resumed: the weights of a
  run never interrupted. Between the two preemptions the second launch loses
  worker 1 (SIGKILL) and restarts once (_check_restart: the launcher
  restarts after a lost worker, and the restart resumes exactly: its run is
  part of the one compared with the uninterrupted run)."""
  model_dir = tmp_path / "m"
  text, code = _launch_and_preempt(model_dir, tmp_path / "a.log", "worker",
                                   10)
  assert code == engine.ExitCode.PREEMPTED, text[-3000:]
  reasons, first = _agreed_step(text, model_dir)
  assert reasons == {0: "stop requested by another worker", 1: "SIGTERM"}
  assert re.search(r"launcher: worker \d exited with 75 \(preempted\)", text)
  assert 10 <= first

  # The same command again resumes; 2 host calls later worker 1 is lost
  # (SIGKILL) and the launcher restarts both workers from the latest
  # checkpoint (_check_restart); 2 host calls after that resume, the
  # launcher gets the SIGTERM.
  text, code = _launch_and_preempt(model_dir, tmp_path / "b.log", "launcher",
                                   (first // 5 + 2) * 5, lose_worker=True)
  assert code == engine.ExitCode.PREEMPTED, text[-3000:]
  assert f"Resumed from {model_dir}/checkpoints/ckpt-{first} at step {first}." in text
  text, restarted = _check_restart(text, first)
  reasons, second = _agreed_step(text, model_dir)
  assert restarted < second, (restarted, second)
  # Forwarded to both; one may already be in the exchange that its peer's
  # flag makes stop, before its own signal is noted.
  assert "SIGTERM" in reasons.values()
  assert set(reasons.values()) <= {"SIGTERM", "stop requested by another worker"}
  assert "launcher: got signal 15, forwarded SIGTERM to all workers" in text
  assert first < second, (first, second)

  # The second preemption's checkpoint trained on to TAIL more steps, here
  # on 2 local replicas (a 2-worker checkpoint resumes on any replica count
  # with the same global batch: test_multi_worker's first test), against
  # the run never interrupted, also on 2 local replicas: the same
  # per-replica batches and one all-reduce of 2 values per step, bitwise
  # equal to 2 uninterrupted workers (measured: 0.0 after 60 steps; that 2
  # workers match one replica is test_multi_worker's first test). The
  # launcher's resume of a preempted run is the second launch above; a
  # third launch here cost 3 process starts (2 TensorFlow workers).
  total = second + TAIL
  kw = {k: v for k, v in FLAGS.items() if k != "weights_out"}
  resumed = run_job(tiny_config(cpu_devices=2, train_steps=total,
                                model_dir=str(model_dir), **kw))
  assert resumed.summary["start_step"] == second
  assert resumed.summary["global_step"] == total
  whole = run_job(tiny_config(
      cpu_devices=2, train_steps=total, model_dir=str(tmp_path / "whole"),
      **kw))
  assert len(resumed.weights) == len(whole.weights) > 0
  np.testing.assert_allclose(resumed.losses, whole.losses[second:], rtol=0,
                             atol=1e-6)
  for got, want in zip(resumed.weights, whole.weights):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
