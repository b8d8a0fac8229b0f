"""`engine.run(task, config)`: the outer loop from set-up to the summary.

In order, each part in its own module:
  roles.set_up          the strategy, this process's role and where it writes;
  state.build_state     data, model, optimizer, checkpoint restore, input
                        iterator, the compiled train loop;
  run_hooks.make_hooks  reporting, evaluation, best, callbacks, checkpoints,
                        host guards (engine/hooks.py's protocol);
  host_loop.train       host calls of the compiled loop until the last step,
                        or until every worker agreed to stop early;
then summary.json (summary.py), the final weights and the export.
--mode=eval runs engine/core/eval_only.py instead.
"""
import dataclasses
import json
import os
from typing import Dict, List, Sequence

from absl import logging
import keras
import numpy as np

from engine import hooks as hooks_lib
from engine.config import Config
from engine.core import callbacks as callbacks_lib
from engine.core import ema as ema_lib
from engine.core import eval_only, host_loop, iterators, preemption, roles
from engine.core import pace, run_hooks
from engine.core import summary as summary_lib
from engine.core.roles import Setup
from engine.core.state import State, build_state
from engine.distribute import cluster, hang
from engine.report import reporting
from engine.task import Task


@dataclasses.dataclass
class Result:
  """What a run produced; `summary` is also written to summary.json
  (--mode=eval: eval.json).

  `history` holds one value per step trained in this run, for the last
  65,536 steps (engine/core/host_loop.py's History), for "loss",
  "examples", "grad_norm", "learning_rate" and each task metric (4 bytes
  per value).
  """
  summary: dict
  history: Dict[str, np.ndarray]
  weights: List[np.ndarray]  # final trainable weights, replica 0
  traces: int                # times the compiled loop was traced (want 1)
  model: keras.Model = None  # the trained model
  averages: List[np.ndarray] = None  # --ema_decay: the averaged weights

  @property
  def losses(self) -> np.ndarray:
    return self.history["loss"]


def run(task: Task, config: Config, *, hooks: Sequence[hooks_lib.Hook] = (),
        callbacks: Sequence[keras.callbacks.Callback] = ()) -> Result:
  """Trains `task` as `config` says; evaluates, checkpoints, exports.

  Call it after the host is set up (`engine.cli.run` does both; in Python,
  `engine.configure_host(config)` before TensorFlow runs any op).
  With --mode=eval it only evaluates a checkpoint (engine/core/eval_only.py).

  Args:
    task: what to train.
    config: how to train it.
    hooks: more `Hook`s (engine/hooks.py declares their events): after
      every host call, after each evaluation (`on_eval`), at the end.
    callbacks: Keras callbacks, called at host-call boundaries
      (engine/core/callbacks.py).

  Raises (engine/errors.py; the CLI's exit code in brackets):
    ConfigError: a bad device, data set, output directory or task mistake,
      found before training [2].
    ClusterError: a lost peer or a stuck collective [3].
    Diverged: the loss or gradient norm became NaN or infinite [4].
    ResourceStop: a host resource nearly ran out; checkpoint saved [5].
    Preempted: SIGTERM/SIGINT on a worker; checkpoint saved [75].
  """
  callbacks = callbacks_lib.check(callbacks)
  if config.evaluation.mode == "eval":
    path = eval_only.find_checkpoint(  # before set-up
        config.evaluation.checkpoint, config.checkpoints.model_dir)
    return Result(*eval_only.evaluate_checkpoint(
        task, config, roles.set_up(config), path))
  setup = roles.set_up(config)
  state = build_state(task, config, setup)
  try:
    return _train(task, config, setup, state, hooks, callbacks)
  except BaseException as error:
    iterators.release_frames(error)  # before the iterator is dropped
    raise
  finally:
    # Not on this thread: dropping the input iterator can wait up to a
    # minute for tf.data's autotuning thread (engine/core/iterators.py).
    iterators.drop_later(state, "iterator")


def _train(task: Task, config: Config, setup: Setup, state: State,
           hooks: Sequence[hooks_lib.Hook], callbacks) -> Result:
  """From the built state to the Result: the host loop with its hooks."""
  if (state.start_step >= state.total_steps or
      _stopped_early(config.evaluation.early_stopping_patience, state)):
    return _nothing_to_train(config, setup, state)
  # One thread bounds every call that can wait on peers; no collective has a
  # timeout of its own (engine/distribute/hang.py).
  with hang.bounded_calls(
      config.distribution.collective_timeout,
      config.distribution.init_timeout,
      peer_messages=cluster.peer_messages(),
      name_stuck=cluster.stuck_peers_line) as watch:
    stop = preemption.StopAgreement(exchanged=roles.exchanges_votes(
        config.checkpoints.preemption_sync, setup))
    state.callbacks = callbacks
    hook_list = run_hooks.make_hooks(task, config, setup, state, watch, hooks,
                                     stop)
    try:
      loop_pace = pace.Pace(config.loop.steps_per_loop)
      with hooks_lib.closing(hook_list):
        history, steady, stopped = host_loop.train(
            state, loop_pace, hook_list, watch, stop)
      cluster.stop_watchdog()  # the last collective is done; peers may exit
      summary = summary_lib.training(task, config, setup, state, history,
                                     steady)
      summary.update(stopped)
      summary.update(steps_per_loop=loop_pace.steps,
                     steps_per_loop_auto=loop_pace.auto,
                     host_calls=loop_pace.calls)
      for h in hook_list:
        h.end(summary)
    except BaseException as error:
      # The frames of the call that raised let go of the iterators first,
      # so that the evaluation's goes off this thread (engine/core/
      # iterators.py), as the training one does in `run`.
      iterators.release_frames(error)
      run_hooks.release_inputs(hook_list)
      raise
  return _finish(task, config, setup, state, summary, history.columns())


def _nothing_to_train(config: Config, setup: Setup, state: State) -> Result:
  """A finished run started again: says so, writes nothing, trains nothing.

  Every worker resumed from the same checkpoint, so all of them return here,
  and no collective runs. The Result holds the earlier summary.json.
  """
  model_dir = config.checkpoints.model_dir
  if state.start_step < state.total_steps:
    logging.warning(
        "nothing to train: %s stopped early at step %d of %d, after %d "
        "evaluations without improvement; start over with a new "
        "--model_dir, or train further with a larger "
        "--early_stopping_patience.", model_dir, state.start_step,
        state.total_steps, int(state.best_state.since.numpy()))
  else:
    logging.warning(
        "nothing to train: %s already holds step %d of %d; start over with "
        "a new --model_dir, or train further with a larger --train_steps or "
        "--epochs.", model_dir, state.start_step, state.total_steps)
  cluster.stop_watchdog()
  summary = {}
  path = os.path.join(model_dir, summary_lib.TRAINING_FILE)
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
  roles.leave(setup)
  return Result(summary, {n: np.zeros(0, np.float32) for n in state.names},
                [np.array(v.numpy()) for v in state.model.trainable_variables],
                0, state.model, state.ema and state.ema.values())


def _stopped_early(patience: int, state: State) -> bool:
  """Whether the checkpoint resumed from is where early stopping ended."""
  return bool(patience and state.best_state is not None and
              int(state.best_state.since.numpy()) >= patience)


def _finish(task, config, setup, state, summary, history) -> Result:
  """Writes summary.json and the weights, exports; returns the Result."""
  summary_lib.write(setup.output_dir, summary_lib.TRAINING_FILE, summary)
  weights = [np.array(v.numpy()) for v in state.model.trainable_variables]
  if config.checkpoints.weights_out:
    np.savez(os.path.join(setup.output_dir, config.checkpoints.weights_out),
             *weights)
  if config.reporting.export:  # (the features' spec builds a pipeline)
    with ema_lib.swapped(state.ema):  # the export serves the averages
      reporting.finish(config.reporting, task, state.model,
                       state.data.features_spec, chief=setup.chief,
                       output_dir=setup.output_dir)
  roles.leave(setup)
  # Last: once it is printed, everything is written (the command line exits
  # right after it, engine/ending.py).
  summary_lib.announce(summary)
  return Result(summary, history, weights,
                state.train_loop.experimental_get_tracing_count(), state.model,
                state.ema and state.ema.values())
