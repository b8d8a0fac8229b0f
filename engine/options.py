"""`option`: a config field that carries its help, choices and bounds.

engine/config.py declares every engine flag with it, and the built-in image
task its own; engine/cli.py makes the flags and their help from the fields,
engine/reference.py the flags reference, and `check_options` checks a
section's values against them when it is made.
"""
import dataclasses
import typing
from typing import Optional, Sequence

from engine.errors import flag_error


def option(default, help: str, *, choices: Sequence[str] = (),  # pylint: disable=redefined-builtin
           at_least=None, above=None, below=None, at_most=None,
           problem: str = ""):
  """A config field with everything the CLI and the docs say about it.

  Args:
    default: the default value (its type is the field's).
    help: one or two sentences: what it does, in the user's words.
    choices: the only values allowed (a string field).
    at_least, above, below, at_most: bounds (>=, >, <, <=) on a number.
    problem: the error's text when a bound is broken, if the generic one
      ("must be a positive integer.") would not say enough.
  """
  return dataclasses.field(default=default, metadata={
      "help": help, "choices": tuple(choices), "at_least": at_least,
      "above": above, "below": below, "at_most": at_most, "problem": problem})


def element_type(field: dataclasses.Field):
  """A list field's element type (Tuple[int, ...] -> int); None otherwise."""
  if typing.get_origin(field.type) is tuple:
    return typing.get_args(field.type)[0]
  return None


def bounds_text(field: dataclasses.Field) -> str:
  """The allowed numbers in short ("integer > 0", "[0, 1)"); "" if any."""
  meta = field.metadata
  low_open = meta["above"] is not None
  low = meta["above"] if low_open else meta["at_least"]
  if low is None:
    return ""
  if meta["below"] is not None:
    return f"{'(' if low_open else '['}{low}, {meta['below']})"
  if meta["at_most"] is not None:
    return f"{'(' if low_open else '['}{low}, {meta['at_most']}]"
  kind = "integer " if _is_int(field.default) else ""
  return f"{kind}{'>' if low_open else '>='} {low}"


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _problem(field: dataclasses.Field, value) -> Optional[str]:
  """Why `value` breaks the field's choices or bounds; None if it does not."""
  meta, integer = field.metadata, _is_int(field.default)
  if meta["choices"] and value not in meta["choices"]:
    return f"unknown; valid: {', '.join(meta['choices'])}."
  low_open = meta["above"] is not None
  low = meta["above"] if low_open else meta["at_least"]
  if low is None:
    return None
  number = _is_int(value) or (not integer and isinstance(value, float))
  if number and (value > low if low_open else value >= low) and (
      meta["below"] is None or value < meta["below"]) and (
          meta["at_most"] is None or value <= meta["at_most"]):
    return None
  if meta["problem"]:
    return meta["problem"]
  if meta["below"] is not None or meta["at_most"] is not None:
    return f"must be in {bounds_text(field)}."
  if low == 0 and integer:
    return f"must be a {'positive' if low_open else 'non-negative'} integer."
  if low == 0:
    return "must be positive." if low_open else "must not be negative."
  return (f"must be {'an integer ' if integer else ''}"
          f"{'above' if low_open else 'at least'} {low}.")


def check_options(section) -> None:
  """Checks each field of a section against its choices and bounds.

  Raises:
    ConfigError: the first bad field, naming the flag and the value.
  """
  for field in dataclasses.fields(section):
    value = getattr(section, field.name)
    problem = _problem(field, value)
    if problem:
      raise flag_error(field.name, value, problem)
