"""tfds split expressions (`train[:80%]`, `train[10:20]+train[-5:]`) for sources
that are not tfds data sets: the synthetic set and image folders.

Such a source has one split, `train`, an ordered list of examples; a split
expression selects positions in that list with exactly the rounding tfds uses
(`tfds.core.ReadInstruction`), so `train[:80%]` and `train[80%:]` are disjoint
and together cover every example, as they do for a tfds data set.
"""
import types

import numpy as np
import tensorflow_datasets as tfds

from engine.errors import flag_error

SPLIT = "train"


def select(spec: str, num_examples: int, flag: str) -> np.ndarray:
  """Positions (int64, ascending within each `+` term) chosen by `spec`.

  Args:
    spec: a tfds split expression over the one split `train`.
    num_examples: length of the source's example list.
    flag: the flag `spec` came from, named in errors.

  Raises:
    ConfigError: a malformed expression, another split name, a slice out of
      range, or a selection with no examples.
  """
  try:
    instructions = tfds.core.ReadInstruction.from_spec(spec).to_absolute(
        {SPLIT: types.SimpleNamespace(num_examples=num_examples)})
  except (ValueError, AssertionError) as e:
    raise flag_error(flag, spec, "is not a split of this data set, which has "
                     f"one split, '{SPLIT}', of {num_examples} examples "
                     f"({str(e).splitlines()[0][:160]}).") from e
  positions = np.concatenate(
      [np.arange(num_examples)[i.from_:i.to] for i in instructions])
  if positions.size == 0:
    raise flag_error(flag, spec, f"selects no examples of the {num_examples}.")
  return positions.astype(np.int64)
