"""Your script as a command line: the engine's flags next to your own.

    # train_mine.py
    from absl import flags
    import engine

    flags.DEFINE_float("dropout", 0.1, "My model's dropout.")

    def make_task(config: engine.Config) -> engine.Task:
      return MyTask(dropout=flags.FLAGS.dropout)

    if __name__ == "__main__":
      engine.cli.run(make_task)

    python train_mine.py --dropout=0.2 --cpu_devices=2 --train_steps=500
    python -m engine.launch --num_workers=2 --script=train_mine.py -- ...

Importing the engine defines no flag: `define_flags` (which `run` calls)
defines them, at the caller's module so that `--help` lists them with the
script's own, and skips any name the script already defined: your
`--learning_rate` or `--seed` stays yours, and the engine's field keeps its
default (set it in `make_task` by returning `(task, config.replace(...))`).

Outcomes: the exit codes of engine/errors.py's `ExitCode` (its table is
docs/reference/exit-codes.md): 0 done; 2 bad input (one line on stderr,
before any training; absl's own flag errors too); 3 a lost peer or a stuck
collective; 4 training diverged; 5 a host resource ran out (a checkpoint
saved where one could be); 75 preempted (checkpoint saved).
"""
import dataclasses
import inspect
import signal
import sys
import traceback
from typing import Callable, List, Optional, Tuple, Union

from absl import app
from absl import flags
from absl import logging

from engine import config as config_lib
from engine import options
from engine.errors import ClusterError, ConfigError, Diverged, ExitCode
from engine.errors import Preempted, ResourceStop, flag_error

MakeTask = Callable[[config_lib.Config], Union["Task", Tuple["Task", config_lib.Config]]]


def caller_module(depth: int = 2) -> str:
  """The module name absl files a flag under: the script's path for __main__.

  Walks up the frames: `inspect.stack()` would also read every frame's
  source lines and look up its module, a quarter of a second of each
  process's start once TensorFlow's ~2,900 modules are loaded."""
  frame = inspect.currentframe()
  for _ in range(depth):
    frame = frame.f_back
  name = frame.f_globals.get("__name__", "__main__")
  return sys.argv[0] if name == "__main__" else name


def help_text(field: dataclasses.Field) -> str:
  """A field's flag help: its help, and its bounds if it has any."""
  bounds = options.bounds_text(field)
  return field.metadata["help"] + (f" [{bounds}]" if bounds else "")


def define_dataclass_flags(cls, *, flag_values=flags.FLAGS,
                           module_name: Optional[str] = None) -> List[str]:
  """Defines one flag per field of `cls`, made with `options.option` (its
  default, help, choices); returns the names defined (a name the script
  already has is skipped)."""
  module_name = module_name or caller_module()
  defined = []
  for f in dataclasses.fields(cls):
    if f.name in flag_values:
      continue
    default, text = f.default, help_text(f)
    kw = dict(flag_values=flag_values, module_name=module_name)
    if f.metadata["choices"]:
      flags.DEFINE_enum(f.name, default, f.metadata["choices"], text, **kw)
    elif options.element_type(f) is not None:
      flags.DEFINE_list(f.name, [str(v) for v in default], text, **kw)
    elif isinstance(default, bool):
      flags.DEFINE_boolean(f.name, default, text, **kw)
    elif isinstance(default, int):
      flags.DEFINE_integer(f.name, default, text, **kw)
    elif isinstance(default, float):
      flags.DEFINE_float(f.name, default, text, **kw)
    else:
      flags.DEFINE_string(f.name, default, text, **kw)
    defined.append(f.name)
  return defined


def flag_values_of(cls, names, flag_values=flags.FLAGS) -> dict:
  """{name: value} of the parsed flags of `cls`'s fields in `names`, each as
  the field's type (a list flag's items as the field's element type).

  Raises:
    ConfigError: a list item that is not of the element type.
  """
  values = {}
  for f in dataclasses.fields(cls):
    if f.name not in names:
      continue
    value = flag_values[f.name].value
    kind = options.element_type(f)
    if kind is not None:
      value = _items(f.name, value or (), kind)
    values[f.name] = value
  return values


_defined: List[str] = []


def define_flags(flag_values=flags.FLAGS,
                 module_name: Optional[str] = None) -> List[str]:
  """Defines the engine's flags, skipping names already defined; idempotent.

  Returns:
    The names of the engine flags defined here.
  """
  module_name = module_name or caller_module()
  for cls in config_lib.SECTIONS.values():
    _defined.extend(define_dataclass_flags(
        cls, flag_values=flag_values, module_name=module_name))
  return list(_defined)


def config_from_flags(flag_values=flags.FLAGS) -> config_lib.Config:
  """The Config of the parsed engine flags; defaults for the script's own.

  Raises:
    ConfigError: a bad value or combination, naming the flag.
  """
  values = {}
  for cls in config_lib.SECTIONS.values():
    values.update(flag_values_of(cls, _defined, flag_values))
  shadowed = sorted(set(config_lib.field_sections()) - set(_defined))
  if shadowed:
    logging.info("Your script defines --%s itself; the engine's field(s) of "
                 "that name keep their defaults.", ", --".join(shadowed))
  return config_lib.Config.create(**values)


_EXAMPLES = {int: "integers, e.g. 10,20", float: "numbers, e.g. 0.1,0.01"}


def _items(flag, items, kind):
  if kind is str:
    return tuple(items)
  try:
    return tuple(kind(v) for v in items)
  except ValueError as e:
    raise flag_error(flag, ",".join(items),
                     f"must be {_EXAMPLES[kind]}.") from e


def parse_flags(argv):
  """absl's parsing, with the engine's form for its errors: one line, exit 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    # absl prefixes some messages ("ERROR:: Unable to open flagfile: ...").
    fail(str(e).removeprefix("ERROR:: ").strip(), ExitCode.BAD_INPUT)


def say_error(message: str) -> None:
  """The engine's form of a failure: one `error:` line on stderr."""
  logging.flush()
  print(f"error: {message}", file=sys.stderr, flush=True)


def fail(message: str, code: int = ExitCode.BAD_INPUT):
  """Says the error and exits (before TensorFlow is loaded)."""
  say_error(message)
  sys.exit(code)


def run(make_task: MakeTask, argv=None, *, callbacks=()) -> None:
  """Defines the engine's flags, parses them and trains `make_task(config)`.

  `make_task` is called after the host is set up, before any training; it
  returns the task, or `(task, config)` to run with a changed config.
  `callbacks`: Keras callbacks (engine/core/callbacks.py), or a function of
  the final config returning them (e.g. a CSVLogger into its model_dir).
  """
  define_flags(module_name=caller_module())
  app.run(lambda args: main(make_task, args, callbacks=callbacks), argv=argv,
          flags_parser=parse_flags)


def main(make_task: MakeTask, argv, *, callbacks=()) -> None:
  """Runs one training job from parsed flags and exits with its code."""
  if len(argv) > 1:
    fail(f"unexpected arguments {' '.join(argv[1:])}; flags look like "
         "--name=value.")
  try:
    config = config_from_flags()
  except ConfigError as e:
    fail(str(e), ExitCode.BAD_INPUT)
  # Before TensorFlow reads it: oneDNN off for the one combination it
  # computes wrong (engine/onednn.py).
  from engine import onednn  # pylint: disable=g-import-not-at-top
  onednn.turn_off_for(config)
  # Imported only now: a bad flag is refused without loading TensorFlow, and
  # the engine's environment defaults (engine/__init__.py) are already set.
  from engine import ending  # pylint: disable=g-import-not-at-top
  from engine.distribute import cluster  # pylint: disable=g-import-not-at-top
  code, agreed, config = _train(make_task, config, callbacks)
  if agreed:  # every worker ends this way: leave together (cluster.py)
    cluster.meet_peers(config.distribution.collective_timeout)
  # Everything is written: exit now, without TensorFlow's teardown, which can
  # wait a minute for tf.data's threads (engine/ending.py).
  ending.end(code)


def _train(make_task: MakeTask, config, callbacks):
  """Trains; returns (exit code, whether every worker ends with it alike,
  the config the task ran with).

  Every outcome but an unexpected error is one line on stderr (README's
  exit codes). "Alike": done, preempted, stopped for a resource and
  diverged are agreed by all workers at the same step; a lost peer, bad
  input or an out-of-memory step are one worker's own.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.core.run import run as run_task  # pylint: disable=g-import-not-at-top
  from engine.distribute import cluster  # pylint: disable=g-import-not-at-top
  from engine.host import cpus  # pylint: disable=g-import-not-at-top
  try:
    # SIGTERM before the first step (from then on engine/core/preemption.py
    # only notes it, to save at an agreed step) exits with 128 + 15.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    # Logical devices must exist before TensorFlow runs any op.
    cpus.configure_host(config)
    made = make_task(config)
    task, config = made if isinstance(made, tuple) else (made, config)
    run_task(task, config, callbacks=(callbacks(config) if callable(callbacks)
                                      else callbacks))
    return ExitCode.DONE, True, config
  except Preempted as e:
    logging.flush()
    print(f"preempted: {e}", file=sys.stderr, flush=True)
    return e.exit_code, True, config
  except ResourceStop as e:
    say_error(str(e))
    return e.exit_code, True, config
  except Diverged as e:
    say_error(f"training diverged: {e}; the latest checkpoint in "
              f"{config.checkpoints.model_dir}/checkpoints holds the last "
              "finite weights. Lower --learning_rate.")
    return e.exit_code, True, config
  except (ConfigError, ClusterError) as e:
    # ClusterError: a lost peer or a stuck collective, named by
    # engine/distribute/hang.py.
    say_error(str(e))
    return e.exit_code, False, config
  except (MemoryError, tf.errors.ResourceExhaustedError) as e:
    # Raised inside a step, whose update may be half applied: no new
    # checkpoint; a rerun resumes from the latest one.
    text = str(e).strip().splitlines()
    say_error(f"out of memory ({type(e).__name__}: "
              f"{text[-1] if text else 'no details'}); the latest checkpoint "
              f"in {config.checkpoints.model_dir}/checkpoints is intact. "
              "Lower --batch_size_per_replica or free memory.")
    return ExitCode.RESOURCE, False, config
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.CancelledError, tf.errors.AbortedError) as e:
    # A collective failed: a peer died or hung. One line, non-zero exit.
    say_error(cluster.failure_line(e, config.distribution.collective_timeout))
    return ExitCode.CLUSTER, False, config
  except SystemExit as e:  # the SIGTERM above, before the first step
    return e.code if isinstance(e.code, int) else ExitCode.FAILED, False, config
  except Exception:  # pylint: disable=broad-except
    # Not one of the documented outcomes: the traceback, as Python prints it.
    traceback.print_exc()
    return ExitCode.FAILED, False, config
