"""Multi-worker training through real processes on loopback ports.

Every wait is bounded and every process started here is killed in `finally`.
Workers never get --cpu_devices: each is one CPU replica, as on real hosts.
"""
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import forkserver
from conftest import ROOT, engine_cmd, run_job, tiny_config
from engine.core import roles
from engine.distribute import cluster
from engine.host import memory
from engine.errors import ConfigError
from engine import launch as launcher
from engine.launch import free_ports

GLOBAL_BATCH = 16
STEPS = 4
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
ENV.pop("TF_CONFIG", None)


def lr(optimizer):
  return 0.05 if optimizer == "sgd" else 0.005


def tiny_flags(**overrides):
  """tiny_config's values as engine flags, so CLI and in-process runs match."""
  c = tiny_config(**overrides)
  names = ("model", "image_size", "synthetic_examples",
           "batch_size_per_replica", "epochs", "train_steps", "steps_per_loop",
           "log_every", "seed", "optimizer", "learning_rate",
           "cross_device_ops", "model_dir", "weights_out", "init_timeout",
           "collective_timeout")
  return [f"--{n}={getattr(c, n)}" for n in names]


def start_from_checkpoint(model_dir, to_dir, step):
  """Makes `to_dir` a model_dir that holds only `model_dir`'s checkpoint of
  `step`, as if a run had stopped there: a run in `to_dir` resumes from it.

  (A periodic checkpoint of an uninterrupted run is the state that a run
  stopped at that step saves: the resume tests start from one instead of
  training the interrupted run's first part again.)
  """
  src, dst = os.path.join(model_dir, "checkpoints"), os.path.join(
      to_dir, "checkpoints")
  os.makedirs(dst)
  names = [n for n in os.listdir(src)
           if n.startswith(f"ckpt-{step}.") or n == "run.json"]
  assert any(n.endswith(".index") for n in names), os.listdir(src)
  for name in names:
    shutil.copy(os.path.join(src, name), dst)
  with open(os.path.join(dst, "checkpoint"), "w") as f:
    f.write(f'model_checkpoint_path: "ckpt-{step}"\n'
            f'all_model_checkpoint_paths: "ckpt-{step}"\n')


def launch(flags, timeout=150, num_workers=2, cpu_pinning=False):
  """Runs the launcher; its CompletedProcess, plus `done_to_exit`: seconds
  from the last `Done:` line a worker printed to the launcher's exit (every
  worker ended), None without one."""
  cmd = [sys.executable, "-m", "engine.launch", f"--num_workers={num_workers}",
         *(["--cpu_pinning"] if cpu_pinning else []), "--", *flags]
  proc = forkserver.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  out, err, done_at = [], [], []

  def read(stream, lines):
    for line in stream:
      lines.append(line)
      if "] Done: " in line:
        done_at.append(time.monotonic())
  readers = [threading.Thread(target=read, args=a, daemon=True)
             for a in ((proc.stdout, out), (proc.stderr, err))]
  for r in readers:
    r.start()
  try:
    code = proc.wait(timeout)
  finally:
    _kill([proc])
  ended = time.monotonic()
  for r in readers:
    r.join(10)
  result = subprocess.CompletedProcess(cmd, code, "".join(out), "".join(err))
  result.done_to_exit = ended - done_at[-1] if done_at else None
  return result


def check_two_worker_run(out, model_dir, steps, global_batch, entries=(),
                         packs=1):
  """What every 2-worker launch of the built-in job must show: success, an
  explicit shard policy, only the chief writing model_dir (holding
  `entries` besides the usual ones) and reporting progress, the checkpoint
  of the last step, one collective per step; returns summary.json."""
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "launcher: all 2 workers succeeded." in out.stderr
  # Each worker left at once after the last barrier (engine/ending.py):
  # no abort in TensorFlow's teardown, no lost barrier answer.
  for text in ("terminate called", "not every worker reached the end"):
    assert text not in out.stdout + out.stderr
  assert "AutoShardPolicy" not in out.stdout  # the policy is explicit
  # Only the chief wrote model_dir (worker 1 only its trace, worker_1, with
  # --profile_steps); worker 1's temp dir is gone.
  assert sorted(os.listdir(model_dir)) == sorted([
      "checkpoints", "export", "summary.json", "train", "weights.npz",
      *entries])
  # Only the chief reports progress; worker 1 logs warnings and errors only.
  lines = out.stdout.splitlines()
  assert any(l.startswith("[worker 0] ") and "| loss " in l for l in lines)
  assert not any(l.startswith("[worker 1] ") and "| loss " in l for l in lines)
  assert f"ckpt-{steps}.index" in os.listdir(model_dir / "checkpoints")
  summary = json.loads((model_dir / "summary.json").read_text())
  assert summary["num_workers"] == 2 and summary["num_replicas"] == 2
  assert summary["global_batch_size"] == global_batch
  assert summary["global_step"] == steps
  # Each step's one collective is the gradient all-reduce (the example count
  # rides in it), one per pack: no per-step metrics reduce, no iterator data
  # check.
  assert summary["collectives_per_step"] == packs
  assert summary["malloc_tuned"] is (memory.glibc() is not None)
  assert summary["cpu_allocator"] == "bfc"  # each worker's command line
  return summary


# The optimizer recipe of tests/test_recipe_optimizers.py's runs (decoupled
# weight decay, clipping by global norm, warmup + cosine), for the one
# 2-worker launch that checks it.
RECIPE = dict(optimizer="adamw", learning_rate=0.005, weight_decay=0.5,
              clip_global_norm=0.4, lr_schedule="cosine", warmup_steps=1)


def test_two_workers_match_one_replica(tmp_path):
  """adamw with weight decay, clipping by global norm and warmup + cosine
  (RECIPE), --cross_device_ops=auto, gradients accumulated over 4
  micro-batches and sent in packs of at most 1024 bytes, and the chief
  profiled (_check_profile): 2 workers x 4 micro-batches of 2 == one
  replica with batch 16, over 2 * STEPS steps; the workers' checkpoint of
  step STEPS resumes on 1 and 4 replicas (_resume_on_other_counts).

  sgd and ring without accumulation, with --strategy=multi_worker given to
  the launcher (accepted; tests/test_exits.py checks that other strategies
  are refused), are tests/test_partial_batch.py's 2-worker test, with
  partial batches: each case is a real 2-worker launch, and the suite has a
  time budget. (The recipe had a 2-worker launch of its own in
  tests/test_recipe_optimizers.py, on the same model and global batch with
  2 micro-batches: this one checks the same and more.)
  """
  start = time.monotonic()
  steps = 2 * STEPS
  out = launch(tiny_flags(
      cross_device_ops="auto", train_steps=steps,
      batch_size_per_replica=GLOBAL_BATCH // 2 // 4,
      model_dir=str(tmp_path / "mw"), weights_out="weights.npz",
      collective_timeout=20, **RECIPE) + [
          f"--{k}={v}" for k, v in RECIPE.items()
          if k not in ("optimizer", "learning_rate")] + [
              "--profile_steps=2,3", "--grad_accum_steps=4",
              "--bytes_per_pack=1024", f"--checkpoint_every={STEPS}"])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  packs = json.loads((tmp_path / "mw" / "summary.json").read_text())[
      "allreduce_packs"]
  assert packs >= 4  # --bytes_per_pack reached MWMS
  summary = check_two_worker_run(out, tmp_path / "mw", steps, GLOBAL_BATCH,
                                 entries=["plugins"], packs=packs)
  assert re.search(r"\[worker 0\] .*Each step all-reduces 58664 gradient "
                   r"bytes \(float32\) per replica in \d+ pack", out.stdout)
  assert summary["lr_schedule"] == "cosine"
  assert summary["peak_learning_rate"] == pytest.approx(0.005)
  _check_profile(tmp_path / "mw", time.monotonic() - start)
  ref = run_job(tiny_config(
      strategy="one_device", batch_size_per_replica=GLOBAL_BATCH,
      train_steps=steps, model_dir=str(tmp_path / "ref"), **RECIPE))
  assert max(ref.history["grad_norm"]) > RECIPE["clip_global_norm"]
  assert ref.history["learning_rate"][0] == 0.0  # warmup from 0
  assert summary["final_learning_rate"] == pytest.approx(
      float(ref.history["learning_rate"][-1]), rel=1e-6)
  got = np.load(tmp_path / "mw" / "weights.npz")
  assert len(got.files) == len(ref.weights)
  for k, want in enumerate(ref.weights):
    np.testing.assert_allclose(got[f"arr_{k}"], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(summary["final_loss"], ref.losses[-1], rtol=1e-5)
  # A wrong reduction would move weights by far more than the tolerance.
  diff = max(np.abs(got[f"arr_{k}"] - w).max()
             for k, w in enumerate(ref.weights))
  assert diff < 1e-5
  _resume_on_other_counts(tmp_path, ref)


def _resume_on_other_counts(tmp_path, ref):
  """The 2-worker checkpoint of step STEPS resumes on 1 replica and on 4,
  without --allow_resume_change (the global batch is the same), and trains
  on as the uninterrupted one-replica run `ref` does (1 replica -> 2
  workers is tests/test_partial_batch.py's launch)."""
  for replicas in (1, 4):
    to = tmp_path / f"resumed_{replicas}"
    start_from_checkpoint(tmp_path / "mw", to, STEPS)
    devices = (dict(strategy="one_device") if replicas == 1 else
               dict(strategy="mirrored", cpu_devices=replicas))
    resumed = run_job(tiny_config(
        batch_size_per_replica=GLOBAL_BATCH // replicas, model_dir=str(to),
        train_steps=2 * STEPS, **devices, **RECIPE))
    assert resumed.summary["start_step"] == STEPS
    assert resumed.summary["num_replicas"] == replicas
    np.testing.assert_allclose(resumed.losses, ref.losses[STEPS:],
                               rtol=1e-5, atol=1e-5)
    for got, want in zip(resumed.weights, ref.weights):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _check_profile(model_dir, seconds):
  """Every worker ends host calls at --profile_steps (2,3: calls of steps 1,
  2-3, 4, ... instead of 1-3, 4, ... with --steps_per_loop=3), or the two
  wait on different collectives until --collective_timeout (20 s: the run
  would fail with exit 3); the chief traces steps 2-3 into model_dir, and
  its trace holds those two steps' gradient all-reduces, one after the other
  (what benchmarks.worker_skew reads). Worker 1 traces nothing without
  --profile_all_workers (check_two_worker_run: no model_dir/worker_1), and
  nothing of its trace hook crashed it (TensorFlow 2.21's profiler can, on
  a non-chief worker: engine/report/profiler.py)."""
  from benchmarks import worker_skew  # pylint: disable=g-import-not-at-top
  assert seconds < 100
  runs = os.listdir(model_dir / "plugins" / "profile")
  assert len(runs) == 1
  files = os.listdir(model_dir / "plugins" / "profile" / runs[0])
  assert any(f.endswith(".xplane.pb") for f in files), files
  (s2, e2), (s3, e3) = worker_skew.gradient_all_reduces(
      str(model_dir / "plugins"), steps=2)
  assert e2 <= s3 < e3


def _wait_for(proc_lines, pattern, deadline):
  while time.monotonic() < deadline:
    if any(pattern in line for line in proc_lines()):
      return True
    time.sleep(0.2)
  return False


def _start(cmd, log):
  return forkserver.Popen(cmd, cwd=ROOT, env=ENV, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)


def _kill(procs):
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait(10)


LONG = dict(train_steps=100000, steps_per_loop=5, log_every=5)


# A SIGKILLed peer ends the other worker with one line and exit 3: see
# tests/test_exits.py::test_a_killed_peer_ends_the_run_with_exit_3, which
# kills it while the worker waits in a collective, between host calls, while
# evaluating and while saving (the test that killed it at an arbitrary step
# here was one more 2-worker start for the same check).


def _launched_pid(log, index):
  """The pid the launcher printed for worker `index`."""
  return int(next(line.split()[4].rstrip(":")
                  for line in log.read_text().splitlines()
                  if line.startswith(f"launcher: worker {index} pid")))


def test_the_next_worker_removes_the_directory_of_a_killed_one(
    tmp_path, monkeypatch):
  """A non-chief worker writes to tfengine_worker_<pid>_* in the temp
  directory, holds an flock on its .lock while it lives and removes the
  directory at its end, which a SIGKILL skips (a worker started without
  engine.launch, whose private TMPDIR would go with it). The kernel lets go
  of the lock however the process ends: the next worker on the host removes
  the directories whose lock it can take, and no other."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  mine = roles._worker_dir()  # pylint: disable=protected-access
  assert os.path.basename(mine).startswith(f"tfengine_worker_{os.getpid()}_")
  assert os.listdir(mine) == [".lock"]
  killed, live, making = (tmp_path / f"tfengine_worker_{n}_ab12"
                          for n in (7, 8, 9))
  other = tmp_path / "mine_1_ab12"
  for d in (killed, live, making, other):
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "ckpt-4.index").write_bytes(b"x" * 1024)
  for d in (killed, live, other):
    (d / ".lock").touch()
  held = os.open(live / ".lock", os.O_RDONLY)
  fcntl.flock(held, fcntl.LOCK_EX)
  try:
    assert roles.remove_orphans(str(tmp_path)) == [str(killed)]
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(d) for d in (mine, live, making, other))
    os.close(roles._held.pop())  # pylint: disable=protected-access
    assert roles.remove_orphans(str(tmp_path)) == [mine]
  finally:
    os.close(held)
  assert roles.remove_orphans(str(tmp_path)) == [str(live)]
  assert roles.remove_orphans(str(tmp_path / "none")) == []


def test_lone_worker_gives_up_after_init_timeout(tmp_path):
  ports = free_ports(2)
  hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
  start = time.monotonic()
  out = forkserver.run(engine_cmd(
      "--strategy=multi_worker", f"--worker_hosts={hosts}", "--task_index=0",
      *tiny_flags(model_dir=str(tmp_path), init_timeout=2.0)),
                       cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=90, check=False)
  # The watchdog process ends the worker with SIGTERM, then SIGKILL (see
  # engine/distribute/watchdog.py): the worker is blocked in C++ holding the GIL.
  assert out.returncode in (-signal.SIGTERM, -signal.SIGKILL)
  assert time.monotonic() - start < 60
  want = (f"error: --init_timeout=2: tasks worker:1 (127.0.0.1:{ports[1]}) "
          "never joined the cluster.")
  assert want in out.stderr.splitlines(), out.stderr[-2000:]


def _cli_error(tmp_path, *flags):
  out = forkserver.run(engine_cmd("--strategy=multi_worker", *flags,
                                  f"--model_dir={tmp_path}"),
                       cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=60, check=False)
  assert out.returncode == 2, out.stderr[-2000:]
  errors = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
  assert len(errors) == 1, out.stderr[-2000:]
  return errors[0]


def test_port_in_use_is_one_line(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    other = free_ports(1)[0]
    line = _cli_error(tmp_path, f"--worker_hosts=127.0.0.1:{port},"
                      f"127.0.0.1:{other}", "--task_index=0")
  assert line.startswith(f"error: this task's address 127.0.0.1:{port} "
                         "cannot be bound (Address already in use)")


def test_nccl_without_gpu_is_one_line(tmp_path):
  line = _cli_error(tmp_path, "--worker_hosts=127.0.0.1:1,127.0.0.1:2",
                    "--task_index=0", "--cross_device_ops=nccl")
  assert line.startswith("error: --cross_device_ops=nccl: NCCL needs GPUs")


@pytest.mark.parametrize("hosts,index,message", [
    ("127.0.0.1:1,127.0.0.1:2", 2,
     "--task_index=2: must be in 0..1 for 2 --worker_hosts."),
    ("127.0.0.1:1,127.0.0.1:1", 0,
     "--worker_hosts=127.0.0.1:1,127.0.0.1:1: lists 127.0.0.1:1 more than "
     "once"),
    ("127.0.0.1:1,no-such-host.invalid:2", 0,
     "host 'no-such-host.invalid' does not resolve"),
    ("127.0.0.1", 0, "'127.0.0.1' is not host:port"),
    ("127.0.0.1:1,127.0.0.1:70000", 0, "'127.0.0.1:70000' is not host:port"),
])
def test_bad_worker_hosts(hosts, index, message):
  config = tiny_config(strategy="multi_worker",
                       worker_hosts=tuple(hosts.split(",")), task_index=index)
  with pytest.raises(ConfigError, match=None) as e:
    cluster.cluster_resolver(config, {})
  assert message in str(e.value)


def test_multi_worker_refuses_local_device_flags():
  with pytest.raises(ConfigError, match="--cpu_devices=2: is not used"):
    tiny_config(strategy="multi_worker", cpu_devices=2)


def test_cluster_sources():
  base = dict(strategy="multi_worker")
  tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                          "task": {"type": "worker", "index": 1}})
  r = cluster.cluster_resolver(tiny_config(**base), {"TF_CONFIG": tf_config})
  assert (r.task_type, r.task_id) == ("worker", 1)
  assert r.cluster_spec().as_dict() == {"worker": ["a:1", "b:2"]}
  with pytest.raises(ConfigError, match="needs a cluster"):
    cluster.cluster_resolver(tiny_config(**base), {})
  with pytest.raises(ConfigError, match="needs --worker_hosts"):
    cluster.cluster_resolver(tiny_config(task_index=0, **base), {})
  # Both --worker_hosts and TF_CONFIG: one line (the command line prints
  # this ConfigError as that line, exit 2, as test_port_in_use_is_one_line
  # shows for a multi_worker run; here without a TensorFlow start).
  with pytest.raises(ConfigError, match=re.escape(
      "--worker_hosts=127.0.0.1:1: conflicts with TF_CONFIG in the "
      "environment; use one of them")):
    cluster.cluster_resolver(tiny_config(worker_hosts=("127.0.0.1:1",),
                                         task_index=0, **base),
                             {"TF_CONFIG": tf_config})
  with pytest.raises(ConfigError, match="SLURM step"):
    cluster.cluster_resolver(tiny_config(**base), {
        "TF_CONFIG": tf_config, "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "2"})
  with pytest.raises(ConfigError, match="not in its cluster"):
    cluster.cluster_resolver(tiny_config(**base), {"TF_CONFIG": json.dumps(
        {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker",
                                                  "index": 3}})})


# Stand-in workers for the launcher's own logic (no TensorFlow, so a launch
# costs no worker start-up): each prints a line and then, as
# STANDIN_EXIT says, exits with that code at once or ("term") waits for
# SIGTERM and exits 75 as a preempted worker does. That real workers save a
# checkpoint at one step on the SIGTERM the launcher forwards, exit 75 and
# resume is tests/test_preemption.py's 2-worker test.
STANDIN = """
import os, signal, sys, time
print("stand-in worker", *sys.argv[1:4], flush=True)
code = os.environ["STANDIN_EXIT"]
if code != "term":
  sys.exit(int(code))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
print("waiting for SIGTERM", flush=True)
while True:
  time.sleep(0.1)
"""


def _standin_launch(tmp_path, code, *launcher_flags):
  script = tmp_path / "standin.py"
  script.write_text(STANDIN)
  log = tmp_path / "launch.log"
  proc = forkserver.Popen(
      [sys.executable, "-m", "engine.launch", "--num_workers=2",
       f"--script={script}", *launcher_flags, "--"], cwd=ROOT,
      env=dict(ENV, STANDIN_EXIT=code), stdout=open(log, "w"),
      stderr=subprocess.STDOUT, start_new_session=True)
  return proc, log


def test_launcher_stops_all_on_ctrl_c(tmp_path):
  proc, log = _standin_launch(tmp_path, "term")
  try:
    deadline = time.monotonic() + 60
    while (log.read_text().count("waiting for SIGTERM") < 2 and
           time.monotonic() < deadline):
      time.sleep(0.1)
    assert log.read_text().count("waiting for SIGTERM") == 2, (
        log.read_text()[-2000:])
    pids = [int(line.split()[4].rstrip(":")) for line in log.read_text().splitlines()
            if line.startswith("launcher: worker ") and " pid " in line]
    assert len(pids) == 2
    os.kill(proc.pid, signal.SIGINT)
    # Forwarded as SIGTERM: both exit 75, as preempted workers do.
    assert proc.wait(60) == 75, log.read_text()[-3000:]
    text = log.read_text()
    assert ("launcher: got signal 2, forwarded SIGTERM to all workers" in
            text), text[-3000:]
    assert "launcher: all 2 workers saved a checkpoint" in text
    for pid in pids:  # every worker was stopped (and reaped) by the launcher
      with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
  finally:
    _kill([proc])


def test_launcher_gives_up_after_max_restarts(tmp_path):
  # Workers that fail (exit 4, as on divergence) every attempt: one restart,
  # then the launcher gives up with 1. Bad flags (2) and preemptions (75)
  # never restart (test_preemption's launches pass --max_restarts=1).
  proc, log = _standin_launch(tmp_path, "4", "--max_restarts=1")
  try:
    assert proc.wait(60) == 1
  finally:
    _kill([proc])
  text = log.read_text()
  assert text.count("launcher: restart 1/1") == 1, text
  assert text.count("stand-in worker") == 4, text  # 2 attempts of 2
  assert "launcher: giving up: workers still failing after 1 restart(s)." in (
      text)


def test_two_diverging_workers_stop_and_the_launcher_fails(tmp_path):
  # Real workers: both see the NaN in the same all-reduced step row, stop
  # with "training diverged" (exit 4), and the launcher without
  # --max_restarts exits 1.
  out = forkserver.run(
      [sys.executable, "-m", "engine.launch", "--num_workers=2", "--",
       *tiny_flags(model_dir=str(tmp_path / "m"), optimizer="sgd",
                   learning_rate=1e6, train_steps=200, steps_per_loop=1)],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=150)
  assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
  assert "training diverged" in out.stdout
  assert "launcher: restart" not in out.stderr


@pytest.mark.parametrize("failed,cause", [
    ([(1, -9)], "worker 1 exited with code -9"),
    # The chief lost its peer (3) and the poll found it ended beside the
    # SIGKILLed worker: the killed one is named, the other in brackets.
    ([(0, 3), (1, -9)], "worker 1 exited with code -9"),
    ([(0, 3), (1, 4)], "worker 1 exited with code 4"),
    ([(0, 1), (1, -6)], "worker 1 exited with code -6"),
    ([(0, 3), (1, 3)], "worker 0 exited with code 3")])
def test_launcher_names_the_worker_that_failed_first(failed, cause):
  line = launcher._failure_line(failed)
  assert line.startswith(f"launcher: {cause}; stopped the others."), line
  others = [f"worker {i} had exited with code {c}" for i, c in failed
            if not cause.startswith(f"worker {i} ")]
  assert line.endswith(f" ({'; '.join(others)})" if others else "others."), (
      line)


def test_launcher_waits_for_the_worker_that_crashed():
  # Worker 0 lost its peer and ended with CLUSTER (3) before the peer, still
  # writing its stack dump, was reaped: the launcher waits for it (at most
  # launcher._CAUSE_SECONDS), so the line names the crash, not its echo.
  workers = ("import sys; sys.exit(3)",
             "import os, time; time.sleep(0.5); os.abort()",
             "import time; time.sleep(60)")
  procs = [subprocess.Popen([sys.executable, "-c", w], start_new_session=True)
           for w in workers]
  try:
    procs[0].wait(30)
    assert launcher._wait_for_cause(procs) == [(0, 3), (1, -signal.SIGABRT)]
    # No other end within the bound: the CLUSTER codes alone.
    start = time.monotonic()
    assert launcher._wait_for_cause([procs[0], procs[2]]) == [(0, 3)]
    assert (launcher._CAUSE_SECONDS <= time.monotonic() - start <
            launcher._CAUSE_SECONDS + 2)
  finally:
    _kill(procs)


# The launcher restarts after a lost worker (SIGKILL): reported with the
# others stopped before the restart, each attempt's temporary directory
# removed, the restart resumed from the latest checkpoint. Checked in
# tests/test_preemption.py's 2-worker test, whose second launch loses a
# worker between its two preemptions: the restart there is part of the run
# that must end with the uninterrupted run's weights (a launch of its own
# here was 2 more worker starts for the same check).
