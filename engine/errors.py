"""Errors the engine reports to users as one line, without a traceback."""


class ConfigError(ValueError):
  """A bad flag value or combination, found before or while setting up training.

  The message names the flag and its value and says what to do instead; `main`
  prints it as one line and exits non-zero.
  """


def flag_error(flag: str, value, problem: str) -> ConfigError:
  """Builds a ConfigError whose message starts with `--flag=value:`."""
  return ConfigError(f"--{flag}={value}: {problem}")


class ClusterError(RuntimeError):
  """A peer was lost or a collective is stuck; the run cannot go on.

  The message is one line naming the task or the call that outlived its
  bound (engine/hang.py); `main` prints it and exits with code 3.
  """
