"""tests/forkserver.py: a forked command sees what a fresh `python` would."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import forkserver

_PROBE = """
import json, os, sys, tempfile
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "marker": os.environ.get("PROBE_MARKER"),
                  "tmp": tempfile.gettempdir(), "sid": os.getsid(0),
                  "pid": os.getpid(), "main": __name__}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_script_gets_its_arguments_place_environment_and_exit_code(
    tmp_path):
  script = tmp_path / "probe.py"
  script.write_text(_PROBE)
  (tmp_path / "scratch").mkdir()
  env = dict(os.environ, PROBE_MARKER="m1", TMPDIR=str(tmp_path / "scratch"))
  out = forkserver.run([sys.executable, str(script), "7", "--x=1"],
                       cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 7
  seen = json.loads(out.stdout)
  assert seen["argv"] == [str(script), "7", "--x=1"]
  assert seen["cwd"] == str(tmp_path)
  assert seen["path0"] == str(tmp_path)
  assert seen["marker"] == "m1"
  assert seen["tmp"] == str(tmp_path / "scratch")
  assert seen["main"] == "__main__"
  assert out.stderr == "to stderr\n"
  assert seen["pid"] != os.getpid()


@pytest.mark.skipif(os.environ.get("TESTS_FORKSERVER") == "0",
                    reason="forks turned off")
def test_a_module_gets_its_argv_and_a_new_session_takes_signals(tmp_path):
  (tmp_path / "probe_mod.py").write_text(
      _PROBE.replace("sys.exit(int(sys.argv[1]))",
                     "sys.stdout.flush()\nimport time\ntime.sleep(60)"))
  log = tmp_path / "log"
  with open(log, "w") as f:
    proc = forkserver.Popen([sys.executable, "-m", "probe_mod", "0"],
                            cwd=tmp_path, stdout=f,
                            stderr=subprocess.STDOUT, start_new_session=True)
  assert isinstance(proc, forkserver.Popen)  # not the fallback
  deadline = time.monotonic() + 60
  while "to stderr" not in log.read_text() and time.monotonic() < deadline:
    time.sleep(0.1)
  seen = json.loads(log.read_text().splitlines()[0])
  assert seen["argv"] == [str(tmp_path / "probe_mod.py"), "0"]
  assert seen["path0"] == str(tmp_path)
  assert seen["sid"] == proc.pid  # its own session and process group
  os.killpg(proc.pid, signal.SIGTERM)
  assert proc.wait(30) == -signal.SIGTERM


def test_what_a_fork_cannot_give_runs_as_a_plain_subprocess():
  code = [sys.executable, "-c", "print(1)"]
  assert isinstance(forkserver.Popen(code, stdout=subprocess.DEVNULL),
                    subprocess.Popen)
  # TensorFlow reads its oneDNN variable when it is imported.
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"
             if os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0" else "1")
  proc = forkserver.Popen([sys.executable, "-m", "json.tool", os.devnull],
                          env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  assert isinstance(proc, subprocess.Popen)
  proc.wait(60)


_NESTED = """
import json, os, subprocess, sys
if sys.argv[1] == "outer":
  # As the launcher starts its workers: preexec_fn given, but None.
  inner = subprocess.Popen([sys.executable, __file__, "inner"],
                           stdout=subprocess.PIPE, preexec_fn=None)
  out, _ = inner.communicate(timeout=60)
  print(json.dumps({"pid": os.getpid(), "inner": json.loads(out),
                    "code": inner.returncode}))
else:
  print(json.dumps({"ppid": os.getppid(),
                    "imported": "tensorflow" in sys.modules}))
  sys.exit(3)
"""


@pytest.mark.skipif(os.environ.get("TESTS_FORKSERVER") == "0",
                    reason="forks turned off")
def test_what_a_forked_command_starts_is_forked_too(tmp_path):
  script = tmp_path / "nested.py"
  script.write_text(_NESTED)
  out = forkserver.run([sys.executable, str(script), "outer"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  seen = json.loads(out.stdout)
  assert seen["code"] == 3
  assert seen["inner"]["imported"]  # forked from the server: no import
  assert seen["inner"]["ppid"] != seen["pid"]  # the server's child
