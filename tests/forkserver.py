"""Test processes without TensorFlow's import: forks of an interpreter that
imported it once.

A command-line run in a test (`python -m engine.main ...`, a user's script)
spends about 4 s of CPU importing TensorFlow, Keras and TensorFlow Datasets
before it reads its first flag; the suite starts about fifty of them.
`Popen` and `run` here start such a command as a fork of a server process
that imported those three once and ran no TensorFlow op (so the child
configures its logical devices as a fresh process does). The child gets the
command's arguments, environment, working directory and standard streams,
runs the module or script as `__main__` and ends as that interpreter would
(atexit, the engine's `os._exit`); its exit status comes back through the
server. The process is a real one: its pid takes signals, its streams are
pipes or files. What the command itself starts with `subprocess.Popen` (the
launcher's workers, a benchmark's runs) is forked from the server the same
way, under the same rules.

What a fork cannot give is what is read while those modules are imported:
a command whose environment differs from the server's in such a variable
(`TF_*` but `TF_CONFIG`, `KERAS_*`, `PYTHON*` but `PYTHONPATH`, thread
counts, locale, `HOME`), or that passes interpreter options, runs as a plain
subprocess. So do tests about imports, the interpreter or oneDNN's variable:
they call `subprocess` themselves. `TESTS_FORKSERVER=0` in the environment
of pytest makes every command a plain subprocess.

    proc = forkserver.run(engine_cmd("--train_steps=4"), cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
"""
import atexit
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types

# What the server imports before it forks. The engine first, as a command
# line imports it before TensorFlow (engine/__init__.py notes which came
# first).
PRELOAD = ("engine", "numpy", "tensorflow", "keras", "tensorflow_datasets")
# Environment variables read while the preloaded modules import.
_IMPORT_TIME = ("TF_", "KERAS_", "PYTHON", "OMP_", "OPENBLAS_", "MKL_",
                "CUDA_", "TFDS_", "XLA_", "LD_", "LC_", "LANG", "HOME")
_RUNTIME = ("TF_CONFIG", "PYTHONPATH")
_MAX_MESSAGE = 1 << 20
_PLAIN_POPEN = subprocess.Popen  # forked commands find `Popen` in its place


def _import_time_env(env):
  return {k: v for k, v in env.items()
          if k.startswith(_IMPORT_TIME) and k not in _RUNTIME}


# ---------------------------------------------------------------- server


def _serve(root):
  """Forks a child per request; returns (request, fds, the child's own
  connection to this server), in the child only.

  Requests come from the test process (`root`) and from the commands forked
  here: each child gets a connection of its own, through which what it
  starts with `subprocess.Popen` is forked here too (a launcher's workers).
  An exit status goes back to whoever asked for that child; when a command
  ends, what it started runs on, as a real process's children would; when
  the test process ends, everything forked here is killed."""
  clients = [root]
  children = {}  # pid -> the connection that asked for it
  while True:
    ready, _, _ = select.select(clients, [], [], 0.02)
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if not pid:
        break
      asker = children.pop(pid)
      if asker in clients:
        try:
          asker.send(json.dumps({"exit": pid, "code":
                                 os.waitstatus_to_exitcode(status)}).encode())
        except OSError:  # it ended just now
          pass
    for client in ready:
      try:
        message, fds, _, _ = socket.recv_fds(client, _MAX_MESSAGE, 3)
      except OSError:
        message, fds = b"", []
      if not message and client is root:  # the test process is gone
        for pid in children:
          try:
            os.kill(pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
        os._exit(0)  # pylint: disable=protected-access
      if not message:  # a command ended
        clients.remove(client)
        client.close()
        continue
      request = json.loads(message)
      ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        for c in clients:
          c.close()
        ours.close()
        if request["new_session"]:
          os.setsid()  # as subprocess does it: before the caller gets the pid
        return request, fds, theirs
      theirs.close()
      if request["new_session"]:
        while os.getsid(pid) != pid:  # so that killpg(pid) finds the group
          time.sleep(0.001)
      children[pid] = client
      clients.append(ours)
      for fd in fds:
        os.close(fd)
      try:
        client.send(json.dumps({"started": request["id"],
                                "pid": pid}).encode())
      except OSError:  # the asker ended meanwhile
        pass


def _become(request, fds, connection, base_path, server_env):
  """In the child: takes the command's streams, place and environment, and
  runs it as `python ARGS` would; what it starts with `subprocess.Popen` goes
  through `connection` (see `Popen`)."""
  global _SERVER
  _SERVER = _Server(connection, server_env)
  subprocess.Popen = Popen
  for target, fd in zip((0, 1, 2), fds):
    os.dup2(fd, target)
  for fd in fds:
    if fd > 2:
      os.close(fd)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  import importlib  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  tempfile.tempdir = None  # found again from this environment's TMPDIR
  importlib.invalidate_caches()  # files written since the server started
  import numpy as np  # pylint: disable=g-import-not-at-top
  np.random.seed()  # a fresh process seeds from the OS, not its parent
  args = request["args"]
  extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  import runpy  # pylint: disable=g-import-not-at-top
  if args[0] == "-m":
    sys.argv = [args[1]] + args[2:]  # runpy puts the module's path first
    sys.path[:] = [os.getcwd()] + extra + base_path
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
  else:
    script = os.path.abspath(args[0])
    sys.argv = [args[0]] + args[1:]
    sys.path[:] = [os.path.dirname(script)] + extra + base_path
    runpy.run_path(script, run_name="__main__")


def _main():
  sock = socket.socket(fileno=int(sys.argv[1]))
  own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  base_path = [p for p in sys.path[1:] if p not in own]
  import importlib  # pylint: disable=g-import-not-at-top
  for name in PRELOAD:
    importlib.import_module(name)
  server_env = dict(os.environ)
  sock.send(b'{"ready": true}')
  request, fds, connection = _serve(sock)
  del sock
  _become(request, fds, connection, base_path, server_env)


# ---------------------------------------------------------------- client


class _Server:
  """The connection to the server: in the test process, a server started on
  first use; in a forked command, the one it was forked with."""

  def __init__(self, connection=None, env=None):
    self._lock = threading.Lock()
    self._sock = connection
    self._env = env  # the server's environment, once known
    self._reader = None
    self._next_id = 0
    self._started = {}  # request id -> (Event, [pid])
    self._procs = {}  # pid -> Popen
    self._early = {}  # pid -> exit code that came before its Popen knew it

  def _start(self):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self._env = dict(os.environ)
    self._proc = _PLAIN_POPEN(
        [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    theirs.close()
    ours.settimeout(120)
    if json.loads(ours.recv(_MAX_MESSAGE)) != {"ready": True}:
      raise RuntimeError("fork server did not start")
    ours.settimeout(None)
    self._sock = ours
    atexit.register(self._stop)

  def _stop(self):
    """At the test process's exit: the server ends (it kills what it still
    runs) and is waited for, so its CPU time counts to this process."""
    self._sock.shutdown(socket.SHUT_RDWR)  # EOF for the server and _read
    try:
      self._proc.wait(10)
    except subprocess.TimeoutExpired:
      self._proc.kill()

  def _read(self):
    while True:
      message = self._sock.recv(_MAX_MESSAGE)
      if not message:  # the server is gone: no exit status will come
        with self._lock:
          for proc in self._procs.values():
            proc._exited(-signal.SIGKILL)  # pylint: disable=protected-access
        return
      m = json.loads(message)
      with self._lock:
        if "started" in m:
          event, out = self._started.pop(m["started"])
          out.append(m["pid"])
          event.set()
        else:
          proc = self._procs.pop(m["exit"], None)
          if proc is None:
            self._early[m["exit"]] = m["code"]
          else:
            proc._exited(m["code"])  # pylint: disable=protected-access

  def serves(self, args, env) -> bool:
    if len(args) < 2 or args[0] != sys.executable:
      return False
    rest = args[1:]
    if rest[0] == "-m":
      if len(rest) < 2:
        return False
    elif rest[0].startswith("-") or not rest[0].endswith(".py"):
      return False
    current = dict(os.environ) if self._env is None else self._env
    return _import_time_env(env) == _import_time_env(current)

  def start(self, proc, args, env, cwd, new_session, fds):
    with self._lock:
      if self._sock is None:
        self._start()
      if self._reader is None:  # a forked command has no thread until here
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="forkserver")
        self._reader.start()
      self._next_id += 1
      rid = self._next_id
      event, out = threading.Event(), []
      self._started[rid] = (event, out)
      socket.send_fds(self._sock, [json.dumps(
          {"id": rid, "args": args[1:], "env": env, "cwd": cwd,
           "new_session": new_session}).encode()],
                      fds)
    if not event.wait(60):
      raise RuntimeError("fork server did not answer")
    pid = out[0]
    with self._lock:
      if pid in self._early:
        proc._exited(self._early.pop(pid))  # pylint: disable=protected-access
      else:
        self._procs[pid] = proc
    return pid


_SERVER = _Server()


def _stream(target, inherit: int):
  """(the child's end: a file descriptor this process closes once the child
  has it, the caller's end: a pipe's read end or None) for subprocess's
  stdout= or stderr= value `target`; None inherits fd `inherit`."""
  if target is None:
    return os.dup(inherit), None
  if target == subprocess.PIPE:
    r, w = os.pipe()
    return w, r
  if target == subprocess.DEVNULL:
    return os.open(os.devnull, os.O_WRONLY), None
  if isinstance(target, int):
    return os.dup(target), None
  return os.dup(target.fileno()), None


_SUPPORTED = ("cwd", "env", "stdout", "stderr", "text", "universal_newlines",
              "stdin", "start_new_session")
# subprocess.Popen's own defaults: given as such, they ask for nothing more.
_DEFAULTS = {"preexec_fn": None, "close_fds": True, "bufsize": -1,
             "executable": None, "shell": False, "pass_fds": ()}


class Popen:
  """subprocess.Popen's interface for a forked command (see the module);
  falls back to subprocess.Popen for what a fork cannot run."""

  __class_getitem__ = classmethod(types.GenericAlias)

  def __new__(cls, args, *rest, **kwargs):
    env = kwargs.get("env")
    env = dict(os.environ) if env is None else dict(env)
    unsupported = [k for k, v in kwargs.items() if k not in _SUPPORTED and
                   (k not in _DEFAULTS or _DEFAULTS[k] != v)]
    if (rest or unsupported
        or kwargs.get("stdin") not in (None, subprocess.DEVNULL)
        or os.environ.get("TESTS_FORKSERVER") == "0"
        or not _SERVER.serves(list(map(str, args)), env)):
      return _PLAIN_POPEN(args, *rest, **kwargs)
    return super().__new__(cls)

  def __init__(self, args, cwd=None, env=None, stdout=None, stderr=None,
               text=False, universal_newlines=False, stdin=None,
               start_new_session=False, **defaults):
    del stdin, defaults  # the defaults __new__ let through
    self.args = args
    self.returncode = None
    self._done = threading.Event()
    env = dict(os.environ) if env is None else dict(env)
    text = text or universal_newlines
    out_w, out_r = _stream(stdout, 1)
    if stderr == subprocess.STDOUT:
      err_w, err_r = os.dup(out_w), None
    else:
      err_w, err_r = _stream(stderr, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
      self.pid = _SERVER.start(self, [str(a) for a in args], env,
                               os.path.abspath(cwd or os.getcwd()),
                               start_new_session, [null, out_w, err_w])
    finally:
      for fd in (null, out_w, err_w):
        os.close(fd)
    wrap = ((lambda fd: io.open(fd, "r", errors="backslashreplace"))
            if text else (lambda fd: io.open(fd, "rb")))
    self.stdin = None
    self.stdout = None if out_r is None else wrap(out_r)
    self.stderr = None if err_r is None else wrap(err_r)

  def _exited(self, code):
    self.returncode = code
    self._done.set()

  def poll(self):
    return self.returncode

  def wait(self, timeout=None):
    if not self._done.wait(timeout):
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def communicate(self, input=None, timeout=None):  # pylint: disable=redefined-builtin
    assert input is None
    results = {}

    def drain(name, stream):
      results[name] = stream.read()
      stream.close()

    readers = [threading.Thread(target=drain, args=(n, s), daemon=True)
               for n, s in (("out", self.stdout), ("err", self.stderr)) if s]
    for r in readers:
      r.start()
    self.wait(timeout)
    for r in readers:
      r.join(timeout)
    return results.get("out"), results.get("err")

  def send_signal(self, sig):
    if self.returncode is None:
      os.kill(self.pid, sig)

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    for s in (self.stdout, self.stderr):
      if s:
        s.close()
    self.wait()


def run(args, *, capture_output=False, timeout=None, check=False, **kwargs):
  """subprocess.run for a forked command."""
  if capture_output:
    kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
  with Popen(args, **kwargs) as proc:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      raise
  done = subprocess.CompletedProcess(args, proc.returncode, out, err)
  if check:
    done.check_returncode()
  return done


if __name__ == "__main__":
  _main()
