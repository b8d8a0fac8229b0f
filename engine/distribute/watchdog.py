"""The cluster watchdog, run as its own small process by
engine/distribute/cluster.py.

A separate process because MultiWorkerMirroredStrategy's constructor blocks in
C++ while holding the GIL, so no Python thread of the worker can run a timer.
This script imports nothing but the standard library and must stay that way
(it starts in milliseconds and cannot be blocked by TensorFlow).

  watchdog.py PARENT_PID INIT_TIMEOUT PROBE_SECONDS PROBE_FAILURES GRACE PEERS_JSON

PEERS_JSON maps "job:index" to "host:port". The parent writes "joined" on our
stdin once the strategy is built and "stop" after its last collective; EOF
means it has ended and we end too.

A peer that never joins within INIT_TIMEOUT: we print one line to stderr
(shared with the parent) and end the parent with SIGTERM (SIGKILL 2 s later:
the parent is blocked in C++ holding the GIL and cannot act itself).

A peer lost after joining: we write `lost <reason>` on stdout, a pipe the
parent's hang guard thread (engine/distribute/hang.py) reads; it aborts the
parent's collectives, so the parent exits with its documented code (3). Only if the
parent is still running GRACE seconds later do we print the line ourselves
and end it as above.
"""
import json
import os
import signal
import socket
import sys
import threading
import time


def accepts(address: str, timeout: float = 1.0) -> bool:
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout):
      return True
  except OSError:
    return False


# An HTTP/2 client connection preface followed by an empty SETTINGS frame.
# A gRPC server answers it at once with its own SETTINGS frame; a stopped or
# hung process does not, although its kernel still accepts the connection.
_HTTP2_PREFACE = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" +
                  b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")


def responds(address: str, timeout: float = 2.0) -> bool:
  """True if the gRPC server at `address` answers within `timeout` seconds."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)),
                                  timeout) as s:
      s.settimeout(timeout)
      s.sendall(_HTTP2_PREFACE)
      return bool(s.recv(9))
  except OSError:
    return False


def names(tasks, peers) -> str:
  return ", ".join(f"{t} ({peers[t]})" for t in tasks)


def main(argv):
  parent, init_timeout = int(argv[1]), float(argv[2])
  probe_seconds, probe_failures = float(argv[3]), int(argv[4])
  grace, peers = float(argv[5]), json.loads(argv[6])
  # A SIGTERM/Ctrl-C sent to the whole process group is for the worker, which
  # goes on to agree on a preemption step and save; we end when it ends (EOF).
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
  joined, stopped = threading.Event(), threading.Event()

  def read_parent():
    for line in sys.stdin:
      (joined if line.strip() == "joined" else stopped).set()
    stopped.set()
    os._exit(0)  # the parent ended: nothing left to watch
  threading.Thread(target=read_parent, daemon=True).start()

  def end_parent(message, graceful=False):
    if stopped.is_set():
      return
    if graceful:  # the parent can act: let it stop itself with its own code
      print(f"lost {message}", flush=True)
      if stopped.wait(grace):
        return
    print(f"error: {message}", file=sys.stderr, flush=True)
    os.kill(parent, signal.SIGTERM)
    time.sleep(2)
    try:
      os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
      pass
    os._exit(0)

  seen, deadline = set(), time.monotonic() + init_timeout
  while not joined.wait(probe_seconds):
    seen.update(t for t, a in peers.items() if t not in seen and accepts(a))
    if time.monotonic() > deadline:
      missing = [t for t in peers if t not in seen] or list(peers)
      end_parent(f"--init_timeout={init_timeout:g}: tasks "
                 f"{names(missing, peers)} never joined the cluster.")
  failures = dict.fromkeys(peers, 0)
  while not stopped.wait(probe_seconds):
    for t, address in peers.items():
      failures[t] = 0 if accepts(address) else failures[t] + 1
      if failures[t] >= probe_failures:
        end_parent(f"lost task {names([t], peers)}: it stopped accepting "
                   "connections during training; stopping this worker too.",
                   graceful=True)


if __name__ == "__main__":
  main(sys.argv)
