"""A training run's hooks, in the order they act (engine/hooks.py's protocol).

Reporting (progress, TensorBoard, profiler), the user's hooks, evaluation,
the best evaluation (--keep_best, --early_stopping_patience), Keras
callbacks, the all-reduce report, host memory and resources, and last the
checkpoints (which act on a stop the hooks before them asked for). Each
evaluation goes to every hook's `on_eval`, the user's included.
"""
import os
from typing import List, Sequence

from absl import logging

from engine import hooks as hooks_lib
from engine.config import Config
from engine.core import best, checkpoint, evaluate, inputs, metric_states
from engine.core import callbacks as callbacks_lib
from engine.core import ema as ema_lib
from engine.core.roles import Setup, profile_dir
from engine.core.state import State
from engine.distribute import comm
from engine.errors import flag_error
from engine.host import memory, resources
from engine.report import export as export_lib
from engine.report import reporting
from engine.task import Task


def make_hooks(task: Task, config: Config, setup: Setup, state: State,
               watch, extra: Sequence[hooks_lib.Hook], stop
               ) -> List[hooks_lib.Hook]:
  """The run's hooks in the order they act.

  Args:
    watch: engine/distribute/hang.py's bound for a call (evaluation passes).
    extra: the hooks passed to engine.run.
    stop: the run's engine/core/preemption.StopAgreement.

  Raises:
    ConfigError: --eval_every, --keep_best or --early_stopping_patience
      without evaluation data.
  """
  hook_list = []  # filled below; the evaluation hook calls their on_eval
  ckpt_hook = checkpoint.CheckpointHook(
      state.checkpointer, config.checkpoints.checkpoint_every, stop)
  # Before the checkpoint hook: on one worker a stop it asks for is acted on
  # at once; on several, the next host call carries it.
  resource_hook = resources.ResourceHook(stop.request_stop)
  report_hooks = reporting.make_hooks(
      config.reporting, chief=setup.chief, output_dir=setup.output_dir,
      profile_dir=profile_dir(config.checkpoints.model_dir, setup),
      start_step=state.start_step, total_steps=state.total_steps,
      steps_per_epoch=state.data.steps_per_epoch, names=state.names)
  eval_hook = _eval_hook(task, config, setup, state, watch,
                         hooks_lib.eval_listeners(hook_list))
  best_hook = _best_hook(task, config, setup, state)
  callback_hook = callbacks_lib.make_hook(
      state.callbacks, state.model, stop=stop, start_step=state.start_step,
      total_steps=state.total_steps,
      steps_per_epoch=state.data.steps_per_epoch)
  loop_hooks = [h for h in (best_hook, callback_hook) if h is not None]
  if state.objective.objects:
    loop_hooks.append(metric_states.BoundaryHook(
        state.data.steps_per_epoch, config.reporting.log_every,
        config.reporting.summary_every))
  comm_hook = comm.CommHook(config.distribution, config.optimization,
                            config.data.batch_size_per_replica,
                            state.optimizer, state.model.trainable_variables,
                            setup.replicas, config.batchnorm.sync_batchnorm)
  hook_list.extend([*report_hooks, *extra, eval_hook, *loop_hooks, comm_hook,
                    memory.TrimHook(setup.malloc_tuned), resource_hook,
                    ckpt_hook])
  return hook_list


def _eval_hook(task, config, setup, state, watch, on_result):
  """The EvalHook; it does nothing when the task has no eval data.

  Raises:
    ConfigError: --eval_every without evaluation data.
  """
  evaluation = config.evaluation
  built = inputs.eval_inputs(task, inputs.input_context(setup.strategy),
                             setup.global_batch)
  keys = evaluate.eval_keys(state.objective)
  every = evaluation.eval_every
  if built is None or evaluation.mode == "train":
    needs = [(f, v) for f, v in (
        ("eval_every", every), ("keep_best", evaluation.keep_best),
        ("early_stopping_patience", evaluation.early_stopping_patience))
             if v]
    if built is None and needs:
      raise flag_error(*needs[0], f"task {task.name} has no evaluation data "
                       "(build_inputs('eval') returned None).")
    return evaluate.EvalHook(None, 0, state.total_steps, keys=keys)
  logging.info("Evaluating on %d examples every %s.", built.num_examples,
               f"{every} steps" if every else
               f"epoch ({state.data.steps_per_epoch} steps)")
  evaluator = evaluate.Evaluator(setup.strategy, state.objective,
                                 state.model, built, watch)
  return evaluate.EvalHook(evaluator, every or state.data.steps_per_epoch,
                           state.total_steps, on_result, keys=keys,
                           weights=lambda: ema_lib.swapped(state.ema))


def _best_hook(task, config, setup, state):
  """--keep_best / --early_stopping_patience's hook, or None."""
  evaluation = config.evaluation
  metric = best.tracked_metric(evaluation.keep_best,
                               evaluation.early_stopping_patience)
  if not metric or evaluation.mode == "train":
    return None
  on_best = None
  if evaluation.keep_best:
    best_dir = os.path.join(setup.output_dir, "best")

    def export(path):
      with ema_lib.swapped(state.ema):
        export_lib.export(state.model, path, task, state.data.features_spec)
    on_best = best.best_saver(
        best_dir,
        lambda s: state.checkpointer.save_best(
            os.path.join(best_dir, "checkpoints"), s),
        export if config.reporting.export else None)
  return best.BestHook(metric, evaluation.early_stopping_patience,
                       state.best_state, on_best)


def release_inputs(hook_list: Sequence[hooks_lib.Hook]) -> None:
  """A run that ends by an exception lets go of its evaluation's input
  iterator here (a finished one does at the evaluation hook's `end`).
  Otherwise the hook holds it until the exception and its traceback are
  collected as garbage, and the iterator's destructor, which waits for
  tf.data's autotuning thread (up to a minute, engine/core/iterators.py),
  runs wherever the collector happens to run: in the next run of the same
  process, measured as stalls of 30-45 s in the test suite."""
  for hook in hook_list:
    if isinstance(hook, evaluate.EvalHook):
      hook.release()
