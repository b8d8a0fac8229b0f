"""--mode=eval: evaluate one checkpoint, write TensorBoard and eval.json.

eval.json, not summary.json: evaluating a run's own model_dir leaves that
run's training summary as it was.

The model is built as for training (the task's, in the strategy's scope) and
the checkpoint's weights restored into it; of the optimizer only its update
count is read, the step the evaluation is filed under (so the checkpoint of
any optimizer evaluates, whatever --optimizer says now). A checkpoint
that holds weight averages (a run with --ema_decay) is evaluated with them,
as that run's own evaluations were. The pass is engine/core/evaluate.py's,
on any strategy and replica count, so it reproduces the training run's
evaluation up to float32 summation order.
"""
import os

from absl import logging
import numpy as np
import tensorflow as tf

from engine.config import Config
from engine.core import checkpoint, evaluate, inputs, iterators, step
from engine.core import objective as objective_lib
from engine.core import ema as ema_lib
from engine.core import summary as summary_lib
from engine.core.model_building import build_model
from engine.core.roles import Setup
from engine.distribute import cluster, hang
from engine.errors import flag_error
from engine.report import tensorboard
from engine.task import Task


# The optimizer's update count in a checkpoint written by engine.run.
_ITERATIONS = "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"


def find_checkpoint(path: str, model_dir: str) -> str:
  """The checkpoint --mode=eval evaluates: --checkpoint's `path`, else the
  latest in `model_dir`.

  Raises:
    ConfigError: there is none (one line, before anything is built).
  """
  if not path:
    directory = os.path.join(model_dir, "checkpoints")
    latest = tf.train.latest_checkpoint(directory)
    if latest is None:
      raise flag_error("mode", "eval",
                       f"no checkpoint in {directory} to evaluate; train "
                       "there first, or pass --checkpoint=PATH.")
    return latest
  if tf.io.gfile.isdir(path):
    latest = tf.train.latest_checkpoint(path)
    if latest is None:
      raise flag_error("checkpoint", path, "holds no checkpoint.")
    return latest
  if not tf.io.gfile.exists(path + ".index"):
    raise flag_error("checkpoint", path,
                     "is not a checkpoint (no .index file); give a ckpt-N "
                     "path or a directory of checkpoints.")
  return path


def evaluate_checkpoint(task: Task, config: Config, setup: Setup,
                        path: str):
  """Evaluates checkpoint `path`; returns Result's fields.

  Raises:
    ConfigError: the task has no evaluation data, or the checkpoint is not
      one of this task's model.
  """
  strategy = setup.strategy
  built = inputs.eval_inputs(task, inputs.input_context(strategy),
                             setup.global_batch)
  if built is None:
    raise flag_error("mode", "eval", f"task {task.name} has no evaluation "
                     "data (build_inputs('eval') returned None).")
  saved = checkpoint.saved_keys(path)
  with strategy.scope():
    model = build_model(
        task, mixed_precision=config.optimization.mixed_precision,
        batchnorm=config.batchnorm, freeze=config.initialization.freeze)
    outputs_spec = step.output_spec(model, built.element_spec)
    objective = objective_lib.build(task, model, outputs_spec,
                                    built.element_spec[1])
    step.check_forward(objective, outputs_spec, built.element_spec)
    averages = (ema_lib.EMA(model.trainable_variables, 0.5)
                if "ema" in saved else None)
  try:
    checkpoint.restore(path, {"model": model},
                       {"ema": averages.trackable()} if averages else {})
    global_step = int(tf.train.load_variable(path, _ITERATIONS))
  except (tf.errors.OpError, AssertionError, ValueError) as e:
    raise flag_error("checkpoint", path,
                     f"cannot be restored into task {task.name}'s model "
                     f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                     ".") from e
  logging.info("Evaluating %s (step %d%s) on %d examples.", path,
               global_step, ", weight averages" if averages else "",
               built.num_examples)
  with hang.bounded_calls(
      config.distribution.collective_timeout,
      config.distribution.init_timeout,
      peer_messages=cluster.peer_messages(),
      name_stuck=cluster.stuck_peers_line) as watch:
    evaluator = evaluate.Evaluator(strategy, objective, model, built, watch)
    try:
      with ema_lib.swapped(averages):
        results = evaluator.evaluate()
    except BaseException as error:  # as engine/core/run.py's training
      iterators.release_frames(error)
      raise
    finally:  # off this thread, also on an exception
      evaluator.release()
    cluster.stop_watchdog()
  writer = tensorboard.SummaryHook(setup.output_dir, (),
                                   enabled=setup.chief, every=0)
  writer.on_eval(global_step, results)
  summary = summary_lib.evaluation(
      task, config, setup, checkpoint=path, global_step=global_step,
      ema=averages is not None, results=results)
  summary_lib.write(setup.output_dir, summary_lib.EVALUATION_FILE, summary)
  summary_lib.announce(summary)
  weights = [np.array(v.numpy()) for v in model.trainable_variables]
  return (summary, {}, weights, evaluator.traces, model,
          averages and averages.values())
