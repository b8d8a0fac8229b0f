"""test_docs' driver: runs the commands of a docs group in this interpreter.

    python tests/docs_driver.py '[["-m", "engine.main", "--flag", ...], ["my_train.py", ...]]'

Each command runs as `python -m MODULE ...` or `python SCRIPT ...` would run
it (runpy, sys.argv, the exit code from SystemExit), with absl's flags reset
to their defaults before it. Prints one JSON line of exit codes (or the
error of a command that raised).
"""
import json
import os
import runpy
import sys
import traceback

from absl import flags

from engine import ending
from engine.host import cpus


def _end(code):
  """The command line exits at its end with os._exit (engine/ending.py);
  here the next command must run, so its end is an exception."""
  ending._clean_up()  # pylint: disable=protected-access
  sys.exit(code)


def main(commands):
  cpus.split_cpu(4)  # the most any command asks for; fewer are kept
  ending.end = _end
  sys.path[0] = os.getcwd()  # python SCRIPT: the script's folder, not ours
  codes = []
  for argv in commands:
    flags.FLAGS.unparse_flags()
    try:
      if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
      else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
      codes.append(0)
    except SystemExit as e:
      codes.append(e.code or 0)
    except Exception:  # pylint: disable=broad-except
      codes.append(traceback.format_exc()[-3000:])
  print("CODES " + json.dumps(codes), flush=True)
  # As the command line ends (engine/core/iterators.py): not waiting for
  # tf.data's threads to let go of the runs' iterators.
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
