"""Local launcher: `python -m engine.launch --num_workers=N -- <engine flags>`.

Starts N `engine.main` workers on this host, on free loopback ports, with the
right `--task_index`; prefixes every output line with `[worker i] `; stops all
workers and exits non-zero as soon as one fails; stops all on Ctrl-C or
SIGTERM; exits 0 only when every worker succeeded. This is a standalone
command with its own small argument parser, not an engine flag module.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

# How long stopped workers get to exit after SIGTERM before SIGKILL.
_GRACE_SECONDS = 10.0


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
                    host: str = "127.0.0.1", module: str = "engine.main"):
  hosts = ",".join(f"{host}:{p}" for p in ports)
  return [[sys.executable, "-m", module, "--strategy=multi_worker",
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


def launch(num_workers: int, engine_flags, cpu_pinning: bool = False,
           module: str = "engine.main") -> int:
  """Runs the workers to completion; returns the launcher's exit code."""
  ports = free_ports(num_workers)
  cores = sorted(os.sched_getaffinity(0))
  if cpu_pinning and len(cores) < num_workers:
    print(f"error: --cpu_pinning needs {num_workers} cores, this process may "
          f"use {len(cores)}.", file=sys.stderr)
    return 2
  lock = threading.Lock()
  procs, pumps = [], []
  for i, cmd in enumerate(worker_commands(num_workers, engine_flags, ports,
                                               module=module)):
    pin = {cores[i]} if cpu_pinning else None
    procs.append(subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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
        print(f"launcher: got signal {interrupted[0]}, stopping all workers.",
              file=sys.stderr, flush=True)
        _stop(procs)
        return 128 + interrupted[0]
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, code = failed[0]
        _stop(procs)
        for t in pumps:
          t.join(2)
        print(f"launcher: worker {i} exited with code {code}; stopped the "
              "others.", file=sys.stderr, flush=True)
        return 1
      if all(c == 0 for c in codes):
        for t in pumps:
          t.join(2)
        print(f"launcher: all {num_workers} workers succeeded.",
              file=sys.stderr, flush=True)
        return 0
      time.sleep(0.2)
  finally:
    for s, h in old.items():
      signal.signal(s, h)
    _stop(procs)


def launch_with_restarts(num_workers: int, engine_flags, cpu_pinning: bool,
                         max_restarts: int, module: str = "engine.main") -> int:
  """Restarts all workers when one fails, up to `max_restarts` times.

  Workers resume from the latest checkpoint in --model_dir, so a restart costs
  at most the steps since that checkpoint. Ctrl-C/SIGTERM never restarts.
  """
  for attempt in range(max_restarts + 1):
    code = launch(num_workers, engine_flags, cpu_pinning, module)
    if code == 0 or code >= 128 or code == 2:
      return code
    if attempt < max_restarts:
      print(f"launcher: restart {attempt + 1}/{max_restarts}: starting all "
            f"{num_workers} workers again from the latest checkpoint.",
            file=sys.stderr, flush=True)
  if max_restarts:
    print(f"launcher: giving up: workers still failing after {max_restarts} "
          "restart(s).", file=sys.stderr, flush=True)
  return code


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m engine.launch",
      usage="%(prog)s --num_workers=N [--max_restarts=K] [--cpu_pinning] "
      "-- <engine flags>")
  parser.add_argument("--num_workers", type=int, required=True)
  parser.add_argument("--max_restarts", type=int, default=0,
                      help="restart all workers this many times when one "
                      "fails; they resume from the latest checkpoint")
  parser.add_argument("--cpu_pinning", action="store_true",
                      help="pin worker i to the i-th core this process may use")
  parser.add_argument("--module", default="engine.main",
                      help="module each worker runs with python -m (e.g. "
                      "engine.bench_allreduce); it gets the cluster flags")
  argv = sys.argv[1:] if argv is None else argv
  ours, engine_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]
                        ) if "--" in argv else (argv, [])
  args = parser.parse_args(ours)
  if args.num_workers < 1:
    parser.error(f"--num_workers={args.num_workers}: must be at least 1.")
  if args.max_restarts < 0:
    parser.error(f"--max_restarts={args.max_restarts}: must be >= 0.")
  for f in engine_flags:
    if f.split("=")[0] in ("--strategy", "--worker_hosts", "--task_index"):
      parser.error(f"{f}: the launcher sets this flag itself; drop it.")
  return launch_with_restarts(args.num_workers, engine_flags,
                              args.cpu_pinning, args.max_restarts,
                              args.module)


if __name__ == "__main__":
  sys.exit(main())
