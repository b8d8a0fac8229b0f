"""What users see, wired in one place: progress, TensorBoard, profiler, export.

engine/core/run.py calls `make_hooks` once and `finish` at the end; the
pieces live in progress.py, tensorboard.py, profiler.py and export.py.
"""
import os
from typing import List, Sequence

from absl import logging

from engine.config import ReportingConfig
from engine import hooks
from engine.report import export, profiler, progress, tensorboard


def make_hooks(config: ReportingConfig, *, chief: bool, output_dir: str,
               profile_dir: str, start_step: int, total_steps: int,
               steps_per_epoch: int,
               names: Sequence[str]) -> List[hooks.Hook]:
  """The progress, summary and (with --profile_steps) profiler hooks.

  On workers other than the chief, logging is lowered to warnings and errors
  and the hooks write nothing, so N workers print one copy of the progress;
  with --profile_steps the chief traces into `profile_dir`, and with
  --profile_all_workers every worker does, each into its own.
  """
  if not chief:
    logging.set_verbosity(logging.WARNING)
  hook_list = [
      progress.make_hook(chief=chief, enabled=config.progress,
                         log_every=config.log_every, total_steps=total_steps,
                         steps_per_epoch=steps_per_epoch),
      tensorboard.SummaryHook(
          output_dir, names, enabled=chief, every=config.summary_every),
  ]
  if config.profile_steps:
    hook_list.append(profiler.ProfileHook(
        profile_dir, config.profile_steps, start_step,
        trace=chief or config.profile_all_workers))
  return hook_list


def export_dir(config: ReportingConfig, chief: bool, output_dir: str) -> str:
  """--export_dir on the chief (default model_dir/export); a private one elsewhere."""
  if chief and config.export_dir:
    return config.export_dir
  return os.path.join(output_dir, "export")


def finish(config: ReportingConfig, task, model, features_spec, *,
           chief: bool, output_dir: str) -> None:
  """Exports the trained model (every worker, so saving stays collective-safe)."""
  if config.export:
    export.export(model, export_dir(config, chief, output_dir), task,
                  features_spec)
