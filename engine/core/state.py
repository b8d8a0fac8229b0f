"""What a training run trains, built and positioned at its start step.

`build_state` makes, in this order: the training data (counted), the model
and optimizer in the strategy's scope, the checkpoint restore (or the
initial weights), the distributed input iterator from the restored step, and
the compiled train loop. Everything a step needs exists before the first
tf.function call, so nothing is created inside a trace.
"""
import dataclasses
import json
import os

from absl import logging
import keras
import tensorflow as tf

from engine.config import Config
from engine.core import best, checkpoint, evaluate, init_weights, inputs
from engine.core import ema as ema_lib
from engine.core import metric_states, objective as objective_lib
from engine.core import randomness, step, summary
from engine.core.model_building import build_model
from engine.core.optimizers import create_optimizer
from engine.core.roles import Setup, exchanges_votes
from engine.distribute import devices
from engine.host import memory
from engine.task import Task


@dataclasses.dataclass
class State:
  """What the loop trains, positioned at `start_step`."""
  model: keras.Model
  optimizer: keras.optimizers.Optimizer
  checkpointer: checkpoint.Checkpointer
  objective: objective_lib.Objective  # the loss and metrics, resolved
  names: tuple    # the columns of a step's row (engine/hooks.py's Rows)
  data: inputs.TrainData
  iterator: object
  train_loop: object
  start_step: int
  total_steps: int
  ema: object = None         # engine/core/ema.EMA with --ema_decay
  best_state: object = None  # engine/core/best.BestState when one is kept
  randomness: object = None  # engine/core/randomness.RowRandomness
  callbacks: list = dataclasses.field(default_factory=list)  # Keras's
  # Keras metric objects: their results from summed states, and training's
  # states over the epoch so far (engine/core/metric_states.py).
  metric_reader: object = None
  metric_totals: object = None


def build_state(task: Task, config: Config, setup: Setup) -> State:
  """The state at the start step (0, or the latest checkpoint's).

  Raises:
    ConfigError: a task mistake, a schedule that does not fit the run, or a
      checkpoint of another run.
  """
  strategy = setup.strategy
  context = inputs.input_context(strategy)
  keras.utils.set_random_seed(config.randomness.seed)
  data = inputs.TrainData(task, context, config.data, setup.global_batch,
                          config.randomness.seed)
  total_steps = (config.loop.train_steps or
                 config.loop.epochs * data.steps_per_epoch)
  _log_plan(task, config, setup, data, total_steps)
  with strategy.scope():
    model = build_model(
        task, mixed_precision=config.optimization.mixed_precision,
        batchnorm=config.batchnorm, freeze=config.initialization.freeze)
    element_spec = data.batches().element_spec
    outputs_spec = step.output_spec(model, element_spec)
    objective = objective_lib.build(task, model, outputs_spec,
                                    element_spec[1])
    best.check_metric(config.evaluation.keep_best,
                      evaluate.eval_keys(objective))
    step.check_forward(objective, outputs_spec, element_spec)
    optimizer = create_optimizer(
        config.optimization, total_steps=total_steps,
        steps_per_epoch=data.steps_per_epoch, global_batch=setup.global_batch)
    # Built here, in the scope and before the first tf.function call, so the
    # slots are mirrored variables and not created inside the trace; the
    # averages and the best evaluation's record likewise.
    optimizer.build(model.trainable_variables)
    ema = (ema_lib.EMA(model.trainable_variables,
                       config.optimization.ema_decay)
           if config.optimization.ema_decay else None)
    best_state = (best.BestState() if best.tracked_metric(
        config.evaluation.keep_best, config.evaluation.early_stopping_patience)
                  else None)
  states = reader = totals = None
  if objective.objects:
    states = metric_states.Replicas(strategy, task.name, objective.objects,
                                    element_spec[1], outputs_spec)
    reader = metric_states.Reader(task.name, objective.objects,
                                  element_spec[1], outputs_spec)
    with strategy.scope():
      totals = metric_states.Totals(states.width)
  checkpointer, start_step = _restore(task, config, setup, model, optimizer,
                                      ema, best_state, totals)
  row_randomness = randomness.RowRandomness(
      config.randomness.seed, config.data.batch_size_per_replica *
      config.optimization.grad_accum_steps)
  train_loop = step.make_train_loop(
      strategy, step.make_replica_step(
          objective, model, optimizer,
          distribution=config.distribution,
          optimization=config.optimization, batchnorm=config.batchnorm,
          batch_size_per_replica=config.data.batch_size_per_replica,
          ema=ema, randomness=row_randomness, states=states),
      step.sum_names(objective), exchange_votes=exchanges_votes(
          config.checkpoints.preemption_sync, setup), states=states)
  # The pipeline is a pure function of (seed, step): resuming is skipping.
  # Each worker decodes only its own rows (engine/core/inputs.py). The
  # iterator is no local of this frame: a frame outlives its call when a
  # reference cycle holds a frame it called (e.g. an ImportError that a
  # library imported here for the first time keeps with its traceback:
  # tensorflow_datasets does), and the iterator would live on with it
  # until the garbage collector frees it, waiting for tf.data's threads
  # (engine/core/iterators.py).
  return State(model, optimizer, checkpointer, objective,
               step.row_names(objective), data,
               data.distribute(strategy, start_step), train_loop,
               start_step, total_steps, ema, best_state, row_randomness,
               metric_reader=reader, metric_totals=totals)


def _log_plan(task, config, setup, data, total_steps) -> None:
  """The batch arithmetic in one sentence, the task, oneDNN's state, the
  CPU allocator."""
  logging.info(
      "Global batch %d on %d worker(s) = %d per worker = %d per replica "
      "(%d replicas, %s, %s); %d examples, %d steps per epoch, %d steps.",
      setup.global_batch, setup.workers, setup.global_batch // setup.workers,
      setup.global_batch // setup.replicas, setup.replicas,
      config.distribution.strategy, devices.describe(setup.strategy),
      data.num_examples, data.steps_per_epoch, total_steps)
  logging.info("Task %s: %s", task.name, json.dumps(task.describe()))
  onednn_state = summary.onednn_state()
  logging.info("oneDNN %s: %s.", "on" if onednn_state["onednn"] else "off",
               onednn_state["onednn_source"])
  bfc = memory.cpu_allocator() == "bfc"
  too_late = config.host.cpu_allocator == "bfc" and not bfc
  logging.info(
      "CPU tensors from %s (--cpu_allocator=%s%s).",
      "TensorFlow's BFC pool" if bfc else "TensorFlow's own allocator",
      config.host.cpu_allocator,
      ": TensorFlow had made its devices before engine.configure_host"
      if too_late else "")


def _restore(task, config, setup, model, optimizer, ema, best_state, totals):
  """(Checkpointer, start step): the latest checkpoint restored, else the
  initial weights (--init_weights) loaded; run.json written."""
  extras = {k: v.trackable() for k, v in (("ema", ema), ("best", best_state),
                                          ("metric_states", totals))
            if v is not None}
  # Every worker resumes from the chief's checkpoints (model_dir must be
  # shared storage across hosts) and saves into its own output_dir.
  ckpt = config.checkpoints
  checkpointer = checkpoint.Checkpointer(
      os.path.join(ckpt.model_dir, "checkpoints"),
      os.path.join(setup.output_dir, "checkpoints"), model, optimizer,
      model_dir=ckpt.model_dir, keep=ckpt.keep_checkpoints,
      allow_resume_change=ckpt.allow_resume_change, extras=extras)
  identity = checkpoint.run_identity(task.describe(), setup.replicas,
                                     setup.global_batch, setup.workers,
                                     config.data.shard_files)
  init_weights.initialize(model, config.initialization, resuming=bool(
      tf.train.latest_checkpoint(os.path.join(ckpt.model_dir, "checkpoints"))))
  start_step = checkpointer.restore(identity)
  checkpointer.write_identity(identity)
  return checkpointer, start_step
