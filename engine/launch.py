"""Local launcher: `python -m engine.launch --num_workers=N -- <engine flags>`.

Starts N `engine.main` workers on this host, on free loopback ports, with the
right `--task_index`; prefixes every output line with `[worker i] `; stops all
workers and exits non-zero as soon as one fails; exits 0 only when every
worker succeeded. This is a standalone command with its own small argument
parser, not an engine flag module.

Preemption (docs/guide/multi-worker.md): SIGTERM or Ctrl-C to
the launcher is forwarded as SIGTERM to every worker; a worker that gets a
SIGTERM (from us or from outside) makes all workers save a checkpoint at the
same step and exit with 75. The launcher waits up to `--preempt_timeout`
seconds for all of them and then exits with 75 itself, never restarting: a
preemption asks for the machines back, and whoever sent it (a scheduler, a
cloud VM's shutdown) runs the job again later, which resumes.

Each launch gives its workers a private TMPDIR that it removes when it ends,
so a worker killed with SIGKILL (which cannot clean up after itself) leaves
no temporary output directory behind.
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# engine.errors imports nothing: the launcher still loads no TensorFlow.
from engine.errors import ExitCode

# How long stopped workers get to exit after SIGTERM before SIGKILL.
_GRACE_SECONDS = 10.0
# How long, after workers ended with CLUSTER (they lost a peer), the launcher
# waits for the peer that caused it to end, so that it names that one.
_CAUSE_SECONDS = 3.0
# A worker's exit status after a coordinated preemption checkpoint.
PREEMPTED = ExitCode.PREEMPTED


def free_ports(n: int, host: str = "127.0.0.1"):
  """N distinct ports the kernel reports free (held open until all are picked)."""
  socks = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind((host, 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def worker_commands(num_workers: int, engine_flags, ports,
                    host: str = "127.0.0.1", module: str = "engine.main",
                    script: str = ""):
  """Each worker's command: `python -m MODULE` or `python SCRIPT`, with the
  cluster flags and then the given flags."""
  hosts = ",".join(f"{host}:{p}" for p in ports)
  program = [script] if script else ["-m", module]
  return [[sys.executable, *program, "--strategy=multi_worker",
           f"--worker_hosts={hosts}", f"--task_index={i}", *engine_flags]
          for i in range(num_workers)]


def _pump(index: int, stream, lock):
  for line in iter(stream.readline, b""):
    with lock:
      sys.stdout.write(f"[worker {index}] " + line.decode(errors="replace"))
      sys.stdout.flush()
  stream.close()


def _stop(procs):
  """SIGTERM each worker's process group, then SIGKILL what is left."""
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + _GRACE_SECONDS
  for p in procs:
    try:
      p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait(5)


def _failure_line(failed) -> str:
  """Names the worker whose end caused the others' (`failed`: the (index,
  code) pairs one poll found ended with a code other than 0).

  A worker that loses its peer ends with CLUSTER within a fraction of a
  second, so one poll may find both it and the peer that was killed: the
  cause is a worker ended by a signal (a negative code), else one that did
  not end with CLUSTER, else the first.
  """
  failed = sorted(failed, key=lambda f: (f[1] >= 0, f[1] == ExitCode.CLUSTER))
  (i, code), rest = failed[0], failed[1:]
  line = f"launcher: worker {i} exited with code {code}; stopped the others."
  if rest:
    line += " (" + "; ".join(f"worker {j} had exited with code {c}"
                             for j, c in rest) + ")"
  return line


def _wait_for_cause(procs):
  """The failed (index, code) pairs once a worker that did not end with
  CLUSTER has ended too, or after _CAUSE_SECONDS: a worker that crashes
  (a C++ abort writes a stack dump first) may be reaped after the peer that
  lost it."""
  deadline = time.monotonic() + _CAUSE_SECONDS
  while True:
    failed = [(i, c) for i, c in enumerate(p.poll() for p in procs)
              if c not in (None, 0)]
    if (time.monotonic() > deadline or
        any(c != ExitCode.CLUSTER for _, c in failed)):
      return failed
    time.sleep(0.05)


def _wait_all(procs, timeout: float, interrupted):
  """Exit codes once all workers ended, None for those still running after
  `timeout` seconds or a further signal to the launcher."""
  deadline, seen = time.monotonic() + timeout, len(interrupted)
  while (time.monotonic() < deadline and len(interrupted) == seen and
         any(p.poll() is None for p in procs)):
    time.sleep(0.2)
  return [p.poll() for p in procs]


def _preempted(procs, pumps, timeout: float, interrupted, cause: str) -> int:
  """Waits for every worker's preemption checkpoint; 75 if all saved one."""
  print(f"launcher: {cause}; waiting up to {timeout:g} s for every worker to "
        "save a checkpoint.", file=sys.stderr, flush=True)
  codes = _wait_all(procs, timeout, interrupted)
  _stop(procs)
  for t in pumps:  # every worker has ended: its pipe is at EOF, drain it all
    t.join(10)
  if all(c == PREEMPTED for c in codes):
    print(f"launcher: all {len(procs)} workers saved a checkpoint at the same "
          f"step; exiting with {PREEMPTED}. Run the same command again to "
          "resume.", file=sys.stderr, flush=True)
    return PREEMPTED
  if all(c == ExitCode.DONE for c in codes):  # ended before the stop did
    print(f"launcher: all {len(procs)} workers succeeded.", file=sys.stderr,
          flush=True)
    return ExitCode.DONE
  print(f"launcher: preemption failed, worker exit codes {codes} (None: "
        f"still running after {timeout:g} s, then killed); the latest "
        "checkpoint may be older.", file=sys.stderr, flush=True)
  return 128 + interrupted[0] if interrupted else ExitCode.FAILED


def launch(num_workers: int, engine_flags, cpu_pinning: bool = False,
           preempt_timeout: float = 60.0,
           module: str = "engine.main", script: str = "") -> int:
  """Runs the workers to completion; returns the launcher's exit code."""
  ports = free_ports(num_workers)
  cores = sorted(os.sched_getaffinity(0))
  if cpu_pinning and len(cores) < num_workers:
    print(f"error: --cpu_pinning needs {num_workers} cores, this process may "
          f"use {len(cores)}.", file=sys.stderr)
    return ExitCode.BAD_INPUT
  lock = threading.Lock()
  procs, pumps = [], []
  scratch = tempfile.mkdtemp(prefix="tfengine_launch_")
  env = dict(os.environ, TMPDIR=scratch)
  print(f"launcher: workers' temporary files in {scratch} (removed at the "
        "end)", file=sys.stderr, flush=True)
  for i, cmd in enumerate(worker_commands(num_workers, engine_flags, ports,
                                          module=module, script=script)):
    pin = {cores[i]} if cpu_pinning else None
    procs.append(subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        start_new_session=True,  # own process group, so killpg stops it all
        preexec_fn=(lambda pin=pin: os.sched_setaffinity(0, pin))
        if pin else None))
    print(f"launcher: worker {i} pid {procs[-1].pid}: {' '.join(cmd)}",
          file=sys.stderr, flush=True)
    pumps.append(threading.Thread(target=_pump, daemon=True,
                                  args=(i, procs[-1].stdout, lock)))
    pumps[-1].start()
  interrupted = []

  def on_signal(signum, _):
    interrupted.append(signum)
  old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT,
                                                   signal.SIGTERM)}
  try:
    while True:
      if interrupted:
        # SIGTERM to each worker process only (not its group: the worker's
        # watchdog must keep running until the worker has agreed to stop).
        for p in procs:
          if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
        return _preempted(procs, pumps, preempt_timeout, interrupted,
                          f"got signal {interrupted[0]}, forwarded SIGTERM "
                          "to all workers")
      codes = [p.poll() for p in procs]
      if PREEMPTED in codes:
        return _preempted(procs, pumps, preempt_timeout, interrupted,
                          f"worker {codes.index(PREEMPTED)} exited with "
                          f"{PREEMPTED} (preempted)")
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        if all(c == ExitCode.CLUSTER for _, c in failed):
          failed = _wait_for_cause(procs)
        _stop(procs)
        for t in pumps:
          t.join(2)
        print(_failure_line(failed), file=sys.stderr, flush=True)
        return ExitCode.FAILED
      if all(c == ExitCode.DONE for c in codes):
        for t in pumps:
          t.join(2)
        print(f"launcher: all {num_workers} workers succeeded.",
              file=sys.stderr, flush=True)
        return ExitCode.DONE
      time.sleep(0.2)
  finally:
    for s, h in old.items():
      signal.signal(s, h)
    _stop(procs)
    shutil.rmtree(scratch, ignore_errors=True)


def launch_with_restarts(num_workers: int, engine_flags, cpu_pinning: bool,
                         max_restarts: int, preempt_timeout: float = 60.0,
                         module: str = "engine.main", script: str = "") -> int:
  """Restarts all workers when one fails, up to `max_restarts` times.

  Workers resume from the latest checkpoint in --model_dir, so a restart costs
  at most the steps since that checkpoint. A preemption (75), Ctrl-C/SIGTERM
  or bad flags (2) never restart.
  """
  for attempt in range(max_restarts + 1):
    code = launch(num_workers, engine_flags, cpu_pinning, preempt_timeout,
                  module, script)
    if code in (ExitCode.DONE, ExitCode.BAD_INPUT, PREEMPTED) or code >= 128:
      return code
    if attempt < max_restarts:
      print(f"launcher: restart {attempt + 1}/{max_restarts}: starting all "
            f"{num_workers} workers again from the latest checkpoint.",
            file=sys.stderr, flush=True)
  if max_restarts:
    print(f"launcher: giving up: workers still failing after {max_restarts} "
          "restart(s).", file=sys.stderr, flush=True)
  return code


class _Parser(argparse.ArgumentParser):
  """The engine's form for bad input: one `error:` line, exit 2 (no usage)."""

  def error(self, message):
    print(f"error: {message} (see python -m engine.launch --help)",
          file=sys.stderr)
    sys.exit(ExitCode.BAD_INPUT)


def main(argv=None) -> int:
  parser = _Parser(
      prog="python -m engine.launch",
      usage="%(prog)s --num_workers=N [--max_restarts=K] [--preempt_timeout=S] "
      "[--cpu_pinning] [--module=M | --script=PATH] "
      "-- <engine flags>")
  parser.add_argument("--num_workers", type=int, required=True)
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="restart all workers this many times when one "
                      "fails; they resume from the latest checkpoint")
  parser.add_argument("--preempt_timeout", type=float, default=60.0,
                      help="after a SIGTERM/SIGINT, seconds to wait for every "
                      "worker to save its preemption checkpoint before "
                      "killing them")
  parser.add_argument("--cpu_pinning", action="store_true",
                      help="pin worker i to the i-th core this process may use")
  # Another program that takes engine.main's cluster flags: a user's script
  # built on engine.cli, the Keras `fit` runner of benchmarks/seed_table.py,
  # benchmarks.allreduce.
  program = parser.add_mutually_exclusive_group()
  program.add_argument("--module", default="engine.main",
                       help="python module each worker runs with python -m "
                       "(e.g. examples.tabular_regression); it gets the "
                       "cluster flags")
  program.add_argument("--script", default="",
                       help="python script each worker runs instead of "
                       "--module (e.g. my_train.py)")
  argv = sys.argv[1:] if argv is None else argv
  ours, engine_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]
                        ) if "--" in argv else (argv, [])
  args = parser.parse_args(ours)
  if args.num_workers < 1:
    parser.error(f"--num_workers={args.num_workers}: must be at least 1.")
  if args.max_restarts < 0:
    parser.error(f"--max_restarts={args.max_restarts}: must be >= 0.")
  if not args.preempt_timeout > 0:
    parser.error(f"--preempt_timeout={args.preempt_timeout:g}: must be "
                 "positive.")
  if args.script and not os.path.isfile(args.script):
    parser.error(f"--script={args.script}: no such file.")
  for f in engine_flags:
    name, _, value = f.partition("=")
    if name == "--strategy" and value == "multi_worker":
      continue  # what the launcher sets anyway
    if name in ("--strategy", "--worker_hosts", "--task_index"):
      parser.error(f"{f}: the launcher sets this flag itself (--strategy="
                   "multi_worker and the cluster); drop it.")
  engine_flags = [f for f in engine_flags if f != "--strategy=multi_worker"]
  return launch_with_restarts(args.num_workers, engine_flags,
                              args.cpu_pinning, args.max_restarts,
                              args.preempt_timeout, args.module, args.script)


if __name__ == "__main__":
  sys.exit(main())
