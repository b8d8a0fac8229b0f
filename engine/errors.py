"""Errors the engine reports to users as one line, without a traceback."""


class ConfigError(ValueError):
  """A bad flag value or combination, found before or while setting up training.

  The message names the flag and its value (or the part of the task) and says
  what to do instead; the CLI prints it as one line and exits with code 2.
  """
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
  bound (engine/distribute/hang.py); the CLI prints it and exits with code 3.
  """
