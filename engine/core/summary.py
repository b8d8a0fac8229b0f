"""summary.json and eval.json: the keys a run reports, defined in one place.

`run_keys` are the keys of every run, training and --mode=eval alike (what
ran, on what, split how); `training` adds the training run's results and
`evaluation` the evaluation's. Hooks add their own keys in `Hook.end`
(evaluation, best, communication, host resources, callbacks).
docs/reference/summary-json.md lists them all.
"""
import json
import os

from absl import logging
import numpy as np
import tensorflow as tf

from engine import onednn
from engine.config import Config
from engine.core import schedules
from engine.core.roles import Setup
from engine.distribute import comm, devices
from engine.host import memory
from engine.task import Task

TRAINING_FILE = "summary.json"
EVALUATION_FILE = "eval.json"  # --mode=eval: the training summary stays


def run_keys(task: Task, config: Config, setup: Setup) -> dict:
  """What ran and how it was split: the keys every run reports."""
  return {
      "num_replicas": setup.replicas,
      "num_workers": setup.workers,
      "global_batch_size": setup.global_batch,
      "strategy": config.distribution.strategy,
      "cross_device_ops": config.distribution.cross_device_ops,
      "cross_device_impl": devices.describe(setup.strategy),
      "task": task.name,
      **task.describe(),
  }


def onednn_state() -> dict:
  """{"onednn": on?, "onednn_source": who chose} (engine/onednn.py)."""
  import engine  # pylint: disable=g-import-not-at-top,protected-access
  return onednn.state(engine._TENSORFLOW_FIRST)


def training(task: Task, config: Config, setup: Setup, state, history,
             steady) -> dict:
  """A training run's keys, before the hooks add theirs.

  Args:
    state: engine/core/state.py's State after the host loop.
    history: engine/core/host_loop.py's History of this run's steps.
    steady: (examples, seconds) of the host calls after the first.
  """
  collectives = comm.collectives_per_step(
      state.train_loop.get_concrete_function(
          state.iterator, tf.constant(1, tf.int32), tf.constant([0.0, 0.0])),
      len(setup.strategy.extended.worker_devices))
  columns = history.columns()
  loss = columns["loss"]
  last = lambda a: float(a[-1]) if len(a) else None
  summary = {
      "global_step": int(state.optimizer.iterations.numpy()),
      "start_step": state.start_step,
      "final_loss": last(loss),
  }
  # A metric function's final value is its mean over the last --log_every
  # steps; a metric object's is its result over the last epoch so far.
  for name in state.objective.columns:
    window = columns[name][-config.reporting.log_every:]
    summary[f"final_{name}"] = float(np.mean(window)) if len(window) else None
  for name in state.objective.object_names:
    summary[f"final_{name}"] = last(columns[name])
  steady_examples, steady_seconds = steady
  # Examples the task's pipeline dropped (undecodable images): the batches
  # as made minus the all-reduced count of examples the steps really had.
  expected = state.data.expected_examples(state.start_step, history.steps)
  examples = history.totals[history.names.index("examples")]
  summary.update({
      "skipped_images": int(round(expected.sum() - examples)),
      "first_loss": (float(history.first[history.names.index("loss")])
                     if history.steps else None),
      "final_grad_norm": last(columns["grad_norm"]),
      "lr_schedule": config.optimization.lr_schedule,
      "peak_learning_rate": schedules.plan(
          config.optimization, total_steps=state.total_steps,
          steps_per_epoch=state.data.steps_per_epoch,
          global_batch=setup.global_batch).peak,
      "final_learning_rate": last(columns["learning_rate"]),
      "examples_per_sec": (steady_examples / steady_seconds
                           if steady_seconds > 0 else None),
      **run_keys(task, config, setup),
      "malloc_tuned": setup.malloc_tuned,
      "cpu_allocator": memory.cpu_allocator(),
      **onednn_state(),
      "collectives_per_step": collectives,
      # Layers whose random draws depend on the replica count
      # (engine/core/randomness.py); [] when every draw is keyed by row.
      "replica_dependent_randomness": state.randomness.summary(),
      "mode": config.evaluation.mode,
      "ema_decay": config.optimization.ema_decay,
  })
  return summary


def evaluation(task: Task, config: Config, setup: Setup, *, checkpoint: str,
               global_step: int, ema: bool, results: dict) -> dict:
  """--mode=eval's keys: the checkpoint, its step and the evaluation."""
  return {"mode": "eval", "checkpoint": checkpoint, "global_step": global_step,
          "ema": ema, **results, **run_keys(task, config, setup)}


def write(directory: str, name: str, summary: dict) -> None:
  """Writes `summary` as `name` in `directory`."""
  with open(os.path.join(directory, name), "w") as f:
    json.dump(summary, f, indent=2)


def announce(summary: dict) -> None:
  """Logs the `Done:` line: the run's last output (once it is printed,
  everything is written, and the command line exits, engine/ending.py)."""
  logging.info("Done: %s", json.dumps(summary))
