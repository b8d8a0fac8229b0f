"""One source per fact: the flags, their help and reference, and the exit codes.

The CLI's flags and docs/reference/flags.md are generated from the fields of
engine/config.py (and of the image task's config); docs/reference/
exit-codes.md from engine/errors.py. A stale generated file fails here:
`python -m engine.reference` rewrites it.
"""
import dataclasses
import os

from absl import flags

from engine import cli, config, errors, reference
from engine.tasks import image_classification


def test_the_generated_reference_files_are_fresh():
  for path, text in reference.generated().items():
    assert os.path.exists(path), path
    with open(path) as f:
      assert f.read() == text, (
          f"{path} is stale: run python -m engine.reference")


def test_every_flag_is_its_fields_name_default_choices_and_help():
  values = flags.FlagValues()
  cli.define_dataclass_flags(image_classification.ImageClassificationConfig,
                             flag_values=values, module_name="t")
  for cls in config.SECTIONS.values():
    cli.define_dataclass_flags(cls, flag_values=values, module_name="t")
  fields = {**config.fields_by_name(), **{
      f.name: f for f in dataclasses.fields(
          image_classification.ImageClassificationConfig)}}
  assert set(values) == set(fields)
  for name, field in fields.items():
    flag = values[name]
    # absl puts an enum's values first: "<a|b|c>: help".
    assert field.metadata["help"] and flag.help.endswith(cli.help_text(field))
    want = field.default
    if isinstance(want, tuple):
      want = [str(v) for v in want]
    assert flag.default == want, name
    if field.metadata["choices"]:
      assert flag.parser.enum_values == list(field.metadata["choices"])
  # Bounds reach the help: --batch_size_per_replica says it is positive.
  assert values["batch_size_per_replica"].help.endswith("[integer > 0]")


def test_each_flag_lives_in_the_section_of_the_component_that_reads_it():
  where = config.field_sections()
  assert where["seed"] == "randomness" and where["malloc_tuning"] == "host"
  for name in ("mode", "eval_every", "keep_best", "early_stopping_patience",
               "checkpoint"):
    assert where[name] == "evaluation", name
  assert where["sync_batchnorm"] == where["fused_batchnorm"] == "batchnorm"
  assert where["ema_decay"] == "optimization"


def test_every_exit_code_is_in_the_one_table():
  codes = {row[0] for row in errors.EXIT_CODES}
  assert {str(int(c)) for c in errors.ExitCode} <= codes
  for exc in (errors.ConfigError, errors.ClusterError, errors.Diverged,
              errors.ResourceStop, errors.Preempted):
    row = dict(errors.EXIT_CODES)[str(int(exc.exit_code))]
    assert f"`{exc.__name__}`" in row, exc
