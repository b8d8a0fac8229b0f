"""What `engine.run` raises when a run cannot end normally, and every exit code.

Each exception says, in one line, what happened and what to do; the command
line (engine/cli.py) prints it and exits with the exception's `exit_code`.
The launcher (engine/launch.py) reads the same codes from its workers, and
docs/reference/exit-codes.md is generated from `EXIT_CODES`. This module
imports nothing (the launcher and the CLI's flag checks load it without
TensorFlow).

Besides these, `engine.run` lets through what TensorFlow raises when memory
runs out inside a step (`MemoryError`, `tf.errors.ResourceExhaustedError`)
or a collective fails (`tf.errors.UnavailableError`, `DeadlineExceededError`,
`CancelledError`, `AbortedError`); the CLI turns them into `RESOURCE` and
`CLUSTER`. A `TypeError` names a callback that is not a Keras callback.
"""
import enum


class ExitCode(enum.IntEnum):
  """The exit status of `python -m engine.main`, of a script run through
  `engine.cli.run`, and of `python -m engine.launch`."""
  DONE = 0
  FAILED = 1
  BAD_INPUT = 2
  CLUSTER = 3
  DIVERGED = 4
  RESOURCE = 5
  PREEMPTED = 75  # EX_TEMPFAIL, "try again": the run can resume


class ConfigError(ValueError):
  """A bad flag value or combination, or a task mistake, found before training
  (or, for --strict_images, an image that cannot be decoded).

  The message names the flag and its value (or the part of the task) and says
  what to do instead.
  """
  exit_code = ExitCode.BAD_INPUT
  # Raised while TensorFlow traces the step (a task's loss that returns the
  # wrong shape): AutoGraph re-raises it unchanged instead of wrapping its
  # message in a stack of generated code.
  ag_pass_through = True


def flag_error(flag: str, value, problem: str) -> ConfigError:
  """Builds a ConfigError whose message starts with `--flag=value:`."""
  return ConfigError(f"--{flag}={value}: {problem}")


class ClusterError(RuntimeError):
  """A peer was lost or a collective is stuck; the run cannot go on.

  The message is one line naming the task or the call that outlived its
  bound (engine/distribute/hang.py).
  """
  exit_code = ExitCode.CLUSTER


class Diverged(FloatingPointError):
  """The loss or the gradient norm became NaN or infinite (the message names
  the step); nothing of that step was saved, the latest checkpoint is
  finite."""
  exit_code = ExitCode.DIVERGED


class ResourceStop(Exception):
  """Threads, memory or open files neared their limit (engine/distribute/
  resources.py); every worker saved a checkpoint at the same step first, so
  the run resumes where it stopped."""
  exit_code = ExitCode.RESOURCE


class Preempted(Exception):
  """SIGTERM or SIGINT reached a worker; every worker saved a checkpoint at
  the same step first, so the same command resumes the run."""
  exit_code = ExitCode.PREEMPTED


# The exit codes' table, in the order users look them up:
# docs/reference/exit-codes.md shows it as it is here.
EXIT_CODES = (
    ("0", "Trained to the end; summary, checkpoint and export written. Also "
     "a run started again on a finished `--model_dir`: it logs `nothing to "
     "train: DIR already holds step N of N; ...` and changes nothing."),
    ("1", "An unexpected error (a traceback). `engine.launch`: a worker "
     "failed, or `--max_restarts` ran out."),
    ("2", "Bad flags or input (absl's own flag errors and `engine.launch`'s "
     "too): one `error:` line, nothing trained (`ConfigError`). Also "
     "`--strict_images` meeting an undecodable image during training: one "
     "`error:` line naming it; the latest checkpoint is intact (on "
     "multi_worker its peers then stop as for a lost peer, 3)."),
    ("3", "A lost peer or a stuck collective (`ClusterError`)."),
    ("4", "Training diverged (`Diverged`); the latest checkpoint is finite."),
    ("5", "A host resource nearly ran out, checkpoint saved "
     "(`ResourceStop`); or out of memory in a step, the latest checkpoint "
     "intact."),
    ("75", "Preempted by SIGTERM/SIGINT, checkpoint saved (`Preempted`): run "
     "the same command again to resume."),
    ("128 + signal", "A signal before the first step. `engine.launch`: a "
     "preemption that did not complete."),
    ("137, 143 (-9, -15 in Python)", "Ended by the watchdog process after it "
     "printed why (start-up timeout; a lost peer the worker could not act on "
     "within `--collective_timeout` + 10 s)."),
)


def exit_code_table() -> str:
  """EXIT_CODES as a Markdown table."""
  rows = ["| code | meaning |", "|---|---|"]
  rows += [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES]
  return "\n".join(rows) + "\n"
