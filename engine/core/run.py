"""`engine.run(task, config)`: set-up, state, hooks, the host loop, the summary.

The outer loop in four parts, each a small function:
  _set_up        the strategy, this process's role and where it writes;
  _build_state   model, optimizer, checkpoint restore, input pipeline and the
                 compiled train loop;
  _make_hooks    checkpoints, evaluation, the best evaluation, callbacks,
                 reporting, resources, preemption;
  host_loop      host calls of the compiled loop until the last step, or
                 until every worker agreed to stop early (host_loop.py);
and then the summary (summary.json), final weights and the export.
--mode=eval runs engine/core/eval_only.py instead.
"""
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from typing import Dict, List, Sequence

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from engine import ending, onednn
from engine.config import Config
from engine.core import batchnorm, best, checkpoint, eval_only, evaluate, inputs
from engine.core import callbacks as callbacks_lib
from engine.core import ema as ema_lib
from engine.core import host_loop, init_weights, iterators, pace, preemption
from engine.core import randomness, schedules, step
from engine.core.hooks import Hook
from engine.core.optimizers import create_optimizer
from engine.distribute import cluster, comm, devices, hang, memory, resources
from engine.errors import ConfigError, flag_error
from engine.report import export as export_lib
from engine.report import reporting
from engine.task import Task, metric_fns


@dataclasses.dataclass
class Result:
  """What a run produced; `summary` is also written to summary.json.

  `history` holds one value per step trained in this run for "loss",
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


@dataclasses.dataclass
class _Setup:
  """The strategy and this process's place in the run."""
  strategy: tf.distribute.Strategy
  chief: bool
  output_dir: str  # model_dir on the chief, a private temp dir elsewhere
  replicas: int
  workers: int
  global_batch: int
  malloc_tuned: bool


@dataclasses.dataclass
class _State:
  """What the loop trains, positioned at `start_step`."""
  model: keras.Model
  optimizer: keras.optimizers.Optimizer
  checkpointer: checkpoint.Checkpointer
  metrics: tuple  # ((name, fn), ...)
  names: tuple    # the columns of a step's row
  data: inputs.TrainData
  iterator: object
  train_loop: object
  start_step: int
  total_steps: int
  ema: object = None         # engine/core/ema.EMA with --ema_decay
  best_state: object = None  # engine/core/best.BestState when one is kept
  randomness: object = None  # engine/core/randomness.RowRandomness
  callbacks: list = dataclasses.field(default_factory=list)  # Keras's


def check_model_dir(path: str, flag: str = "model_dir") -> None:
  """Fails before training, not after it, if results could not be written."""
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, ".write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise flag_error(flag, path, f"cannot be written ({e.strerror}); "
                     "pick a directory you can write.") from e


def is_chief(strategy: tf.distribute.Strategy) -> bool:
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or not resolver.cluster_spec().as_dict():
    return True
  return (resolver.task_type in ("chief", None) or
          (resolver.task_type == "worker" and resolver.task_id == 0 and
           "chief" not in resolver.cluster_spec().as_dict()))


def _profile_dir(config: Config, setup: _Setup) -> str:
  """Where --profile_steps traces go: model_dir on the chief, and on worker
  k > 0 model_dir/worker_k, its own folder (TensorBoard shows it as the run
  "worker_k"), so that a slow worker can be told apart from a slow network."""
  if setup.chief:
    return setup.output_dir
  resolver = setup.strategy.cluster_resolver
  return os.path.join(config.checkpoints.model_dir,
                      f"{resolver.task_type}_{resolver.task_id}")


def run(task: Task, config: Config, *, hooks: Sequence[Hook] = (),
        callbacks: Sequence[keras.callbacks.Callback] = ()) -> Result:
  """Trains `task` as `config` says; evaluates, checkpoints, exports.

  Call it after the host is set up (`engine.cli.run` does both; in Python,
  `engine.configure_host(cpu_devices)` before TensorFlow runs any op).
  With --mode=eval it only evaluates a checkpoint (engine/core/eval_only.py).

  Args:
    task: what to train.
    config: how to train it.
    hooks: more `Hook`s, called after every host call (e.g. a timer).
    callbacks: Keras callbacks, called at host-call boundaries
      (engine/core/callbacks.py).

  Raises:
    ConfigError: a bad device, data set, output directory or task mistake,
      found before training.
    ClusterError: a lost peer or a stuck collective (engine/distribute/hang.py).
    FloatingPointError: the loss or gradient norm became NaN or infinite.
  """
  callbacks = callbacks_lib.check(callbacks)
  if config.loop.mode == "eval":
    path = eval_only.find_checkpoint(config.checkpoints)  # before set-up
    return Result(*eval_only.evaluate_checkpoint(
        task, config, _set_up(config), path, build_model))
  setup = _set_up(config)
  state = _build_state(task, config, setup)
  try:
    return _train(task, config, setup, state, hooks, callbacks)
  finally:
    # Not on this thread: dropping the input iterator can wait up to a
    # minute for tf.data's autotuning thread (engine/core/iterators.py).
    iterators.drop_later(state, "iterator")


def _train(task: Task, config: Config, setup: _Setup, state: _State,
           hooks: Sequence[Hook], callbacks) -> Result:
  """From the built state to the Result: the host loop with its hooks."""
  if (state.start_step >= state.total_steps or
      _stopped_early(config.loop.early_stopping_patience, state)):
    return _nothing_to_train(config, setup, state)
  # One thread bounds every call that can wait on peers; no collective has a
  # timeout of its own (engine/distribute/hang.py).
  with hang.bounded_calls(
      config.distribution.collective_timeout,
      config.distribution.init_timeout,
      peer_messages=cluster.peer_messages(),
      name_stuck=cluster.stuck_peers_line) as watch:
    stop = preemption.StopAgreement(exchanged=_exchanged(config, setup))
    state.callbacks = callbacks
    hook_list, closers = _make_hooks(task, config, setup, state, watch, hooks,
                                     stop)
    loop_pace = pace.Pace(config.loop.steps_per_loop)
    try:
      history, steady, stopped = host_loop.train(
          state, loop_pace, hook_list, watch, stop)
    finally:
      for close in closers:
        close()
    cluster.stop_watchdog()  # the last collective is done; peers may exit
    summary = _summarize(task, config, setup, state, history, steady)
    summary.update(stopped)
    summary.update(steps_per_loop=loop_pace.steps,
                   steps_per_loop_auto=loop_pace.auto,
                   host_calls=loop_pace.calls)
    for h in hook_list:
      h.end(summary)
  return _finish(task, config, setup, state, summary, history)


def _nothing_to_train(config: Config, setup: _Setup, state: _State) -> Result:
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
  path = os.path.join(model_dir, "summary.json")
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
  if not setup.chief:
    shutil.rmtree(setup.output_dir, ignore_errors=True)
  return Result(summary, {n: np.zeros(0, np.float32) for n in state.names},
                [np.array(v.numpy()) for v in state.model.trainable_variables],
                0, state.model, state.ema and state.ema.values())


def _stopped_early(patience: int, state: _State) -> bool:
  """Whether the checkpoint resumed from is where early stopping ended."""
  return bool(patience and state.best_state is not None and
              int(state.best_state.since.numpy()) >= patience)


def _set_up(config: Config) -> _Setup:
  dist = config.distribution
  strategy = devices.make_strategy(dist)
  # After the strategy: on multi_worker no op may run before it exists.
  malloc_tuned = config.loop.malloc_tuning and memory.tune_malloc()
  chief = is_chief(strategy)
  # Only the chief writes model_dir; other workers write the same files to a
  # private temporary directory, removed at the end, so no two processes ever
  # write one file.
  output_dir = config.checkpoints.model_dir if chief else tempfile.mkdtemp(
      prefix="tfengine_worker_")
  if not chief:  # also on an error exit (not on SIGKILL)
    ending.at_exit(shutil.rmtree, output_dir, ignore_errors=True)
  check_model_dir(output_dir)
  if chief and config.reporting.export and config.reporting.export_dir:
    check_model_dir(config.reporting.export_dir, "export_dir")
  replicas = strategy.num_replicas_in_sync
  onednn.check(config, strategy.extended.worker_devices)
  # One optimizer update takes --grad_accum_steps micro-batches per replica.
  global_batch = (config.data.batch_size_per_replica *
                  config.optimization.grad_accum_steps * replicas)
  return _Setup(strategy, chief, output_dir, replicas,
                getattr(strategy.extended, "_num_workers", 1), global_batch,
                malloc_tuned)


def _build_state(task: Task, config: Config, setup: _Setup) -> _State:
  strategy = setup.strategy
  metrics = metric_fns(task)
  best.check_metric(config.checkpoints.keep_best, evaluate.eval_keys(metrics))
  context = inputs.input_context(strategy)
  keras.utils.set_random_seed(config.loop.seed)
  data = inputs.TrainData(task, context, config.data, setup.global_batch,
                          config.loop.seed)
  total_steps = (config.loop.train_steps or
                 config.loop.epochs * data.steps_per_epoch)
  logging.info(
      "Global batch %d on %d worker(s) = %d per worker = %d per replica "
      "(%d replicas, %s, %s); %d examples, %d steps per epoch, %d steps.",
      setup.global_batch, setup.workers, setup.global_batch // setup.workers,
      setup.global_batch // setup.replicas, setup.replicas,
      config.distribution.strategy, devices.describe(strategy),
      data.num_examples, data.steps_per_epoch, total_steps)
  described = task.describe()
  logging.info("Task %s: %s", task.name, json.dumps(described))
  onednn_state = _onednn_state()
  logging.info("oneDNN %s: %s.", "on" if onednn_state["onednn"] else "off",
               onednn_state["onednn_source"])
  with strategy.scope():
    model = build_model(task, config)
    step.check_forward(task, model, metrics, data.batches().element_spec)
    optimizer = create_optimizer(
        config.optimization, total_steps=total_steps,
        steps_per_epoch=data.steps_per_epoch, global_batch=setup.global_batch)
    # Built here, in the scope and before the first tf.function call, so the
    # slots are mirrored variables and not created inside the trace; the
    # averages and the best evaluation's record likewise.
    optimizer.build(model.trainable_variables)
    ema = (ema_lib.EMA(model.trainable_variables, config.loop.ema_decay)
           if config.loop.ema_decay else None)
    best_state = (best.BestState() if best.tracked_metric(
        config.checkpoints.keep_best, config.loop.early_stopping_patience)
                  else None)
  extras = {k: v.trackable() for k, v in (("ema", ema), ("best", best_state))
            if v is not None}
  # Every worker resumes from the chief's checkpoints (model_dir must be
  # shared storage across hosts) and saves into its own output_dir.
  ckpt = config.checkpoints
  checkpointer = checkpoint.Checkpointer(
      os.path.join(ckpt.model_dir, "checkpoints"),
      os.path.join(setup.output_dir, "checkpoints"), model, optimizer,
      model_dir=ckpt.model_dir, keep=ckpt.keep_checkpoints,
      allow_resume_change=ckpt.allow_resume_change, extras=extras)
  identity = checkpoint.run_identity(described, setup.replicas,
                                     setup.global_batch, setup.workers,
                                     config.data.shard_files)
  init_weights.initialize(model, config.initialization, resuming=bool(
      tf.train.latest_checkpoint(os.path.join(ckpt.model_dir, "checkpoints"))))
  start_step = checkpointer.restore(identity)
  checkpointer.write_identity(identity)
  # The pipeline is a pure function of (seed, step): resuming is skipping.
  # Each worker decodes only its own rows (engine/core/inputs.py).
  iterator = data.distribute(strategy, start_step)
  names = step.row_names(metrics)
  row_randomness = randomness.RowRandomness(
      config.loop.seed, config.data.batch_size_per_replica *
      config.optimization.grad_accum_steps)
  train_loop = step.make_train_loop(
      strategy, step.make_replica_step(
          task, model, optimizer, metrics,
          distribution=config.distribution,
          optimization=config.optimization,
          batch_size_per_replica=config.data.batch_size_per_replica,
          ema=ema, randomness=row_randomness),
      names, exchange_votes=_exchanged(config, setup))
  return _State(model, optimizer, checkpointer, metrics, names, data,
                iterator, train_loop, start_step, total_steps, ema,
                best_state, row_randomness)


def build_model(task: Task, config: Config) -> keras.Model:
  """The task's model under the run's dtype policy, its BatchNorm set
  (fused, synchronized) and --freeze's layers frozen."""
  with _dtype_policy(config.optimization.mixed_precision):
    model = task.build_model()
  if not isinstance(model, keras.Model):
    raise ConfigError(f"task {task.name}: build_model() returned "
                      f"{type(model).__name__}, not a keras.Model.")
  batchnorm.configure(model, synchronized=config.distribution.sync_batchnorm,
                      fused=config.optimization.fused_batchnorm)
  if config.initialization.freeze:  # before the optimizer takes the variables
    init_weights.freeze(model, config.initialization.freeze)
  return model


def _onednn_state() -> dict:
  """{"onednn": on?, "onednn_source": who chose} (engine/onednn.py)."""
  import engine  # pylint: disable=g-import-not-at-top,protected-access
  return onednn.state(engine._TENSORFLOW_FIRST)


@contextlib.contextmanager
def _dtype_policy(mixed_precision: str):
  """The global Keras policy for the layers built inside; restored after.

  keras.applications models take no dtype argument, so the global policy is
  the only way in; restoring it keeps other models in the process float32.
  """
  before = keras.config.dtype_policy()
  keras.config.set_dtype_policy(
      "float32" if mixed_precision == "none" else mixed_precision)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(before)


def _exchanged(config: Config, setup: _Setup) -> bool:
  """Whether host calls sum the workers' stop votes (engine/core/preemption)."""
  return config.checkpoints.preemption_sync and setup.workers > 1


def _make_hooks(task: Task, config: Config, setup: _Setup, state: _State,
                watch, extra: Sequence[Hook], stop):
  """The run's hooks in the order they act, and what to close at the end."""
  ckpt_hook = checkpoint.CheckpointHook(
      state.checkpointer, config.checkpoints.checkpoint_every, stop)
  # Before the checkpoint hook: on one worker a stop it asks for is acted on
  # at once; on several, the next host call carries it.
  resource_hook = resources.ResourceHook(stop.request_stop)
  report_hooks = reporting.make_hooks(
      config.reporting, chief=setup.chief, output_dir=setup.output_dir,
      profile_dir=_profile_dir(config, setup), start_step=state.start_step,
      total_steps=state.total_steps,
      steps_per_epoch=state.data.steps_per_epoch, names=state.names)
  after_eval = [reporting.eval_writer(report_hooks)]
  eval_hook = _eval_hook(task, config, setup, state, watch,
                         lambda s, m: [f(s, m) for f in after_eval])
  best_hook = _best_hook(task, config, setup, state)
  callback_hook = callbacks_lib.make_hook(
      state.callbacks, state.model, stop=stop, start_step=state.start_step,
      total_steps=state.total_steps,
      steps_per_epoch=state.data.steps_per_epoch)
  # After the eval hook, which hands them each evaluation.
  loop_hooks = [h for h in (best_hook, callback_hook) if h is not None]
  after_eval += [h.on_eval for h in loop_hooks]
  comm_hook = comm.CommHook(config.distribution, config.optimization,
                            config.data.batch_size_per_replica,
                            state.optimizer, state.model.trainable_variables,
                            setup.replicas)
  hook_list = [*report_hooks, *extra, eval_hook, *loop_hooks, comm_hook,
               memory.TrimHook(setup.malloc_tuned), resource_hook, ckpt_hook]
  return hook_list, [ckpt_hook.close, lambda: reporting.close(hook_list)]


def _eval_hook(task, config, setup, state, watch, on_result):
  """The EvalHook; it does nothing when the task has no eval data.

  Raises:
    ConfigError: --eval_every without evaluation data.
  """
  built = inputs.eval_inputs(task, inputs.input_context(setup.strategy),
                             setup.global_batch)
  keys = evaluate.eval_keys(state.metrics)
  every = config.loop.eval_every
  if built is None or config.loop.mode == "train":
    needs = [(f, v) for f, v in (
        ("eval_every", every), ("keep_best", config.checkpoints.keep_best),
        ("early_stopping_patience", config.loop.early_stopping_patience))
             if v]
    if built is None and needs:
      raise flag_error(*needs[0], f"task {task.name} has no evaluation data "
                       "(build_inputs('eval') returned None).")
    return evaluate.EvalHook(None, 0, state.total_steps, keys=keys)
  logging.info("Evaluating on %d examples every %s.", built.num_examples,
               f"{every} steps" if every else
               f"epoch ({state.data.steps_per_epoch} steps)")
  evaluator = evaluate.Evaluator(setup.strategy, task, state.model,
                                 state.metrics, built, watch)
  return evaluate.EvalHook(evaluator, every or state.data.steps_per_epoch,
                           state.total_steps, on_result, keys=keys,
                           weights=lambda: ema_lib.swapped(state.ema))


def _best_hook(task, config, setup, state):
  """--keep_best / --early_stopping_patience's hook, or None."""
  metric = best.tracked_metric(config.checkpoints.keep_best,
                               config.loop.early_stopping_patience)
  if not metric or config.loop.mode == "train":
    return None
  on_best = None
  if config.checkpoints.keep_best:
    best_dir = os.path.join(setup.output_dir, "best")

    def export(path):
      with ema_lib.swapped(state.ema):
        export_lib.export(state.model, path, task, state.data.features_spec)
    on_best = best.best_saver(
        best_dir,
        lambda s: state.checkpointer.save_best(
            os.path.join(best_dir, "checkpoints"), s),
        export if config.reporting.export else None)
  return best.BestHook(metric, config.loop.early_stopping_patience,
                       state.best_state, on_best)


def _summarize(task, config, setup, state, history, steady) -> dict:
  """summary.json's keys; hooks add theirs in `end`."""
  reporting_config = config.reporting
  collectives = comm.collectives_per_step(
      state.train_loop.get_concrete_function(
          state.iterator, tf.constant(1, tf.int32), tf.constant([0.0, 0.0])),
      len(setup.strategy.extended.worker_devices))
  loss = history["loss"]
  last = lambda a: float(a[-1]) if len(a) else None
  summary = {
      "global_step": int(state.optimizer.iterations.numpy()),
      "start_step": state.start_step,
      "final_loss": last(loss),
  }
  # A metric's final value is its mean over the last --log_every steps.
  for name, _ in state.metrics:
    window = history[name][-reporting_config.log_every:]
    summary[f"final_{name}"] = float(np.mean(window)) if len(window) else None
  steady_examples, steady_seconds = steady
  # Examples the task's pipeline dropped (undecodable images): the batches
  # as made minus the all-reduced count of examples the steps really had.
  expected = state.data.expected_examples(state.start_step, len(loss))
  summary.update({
      "skipped_images": int(expected.sum() - history["examples"].sum()),
      "first_loss": float(loss[0]) if len(loss) else None,
      "final_grad_norm": last(history["grad_norm"]),
      "lr_schedule": config.optimization.lr_schedule,
      "peak_learning_rate": schedules.plan(
          config.optimization, total_steps=state.total_steps,
          steps_per_epoch=state.data.steps_per_epoch,
          global_batch=setup.global_batch).peak,
      "final_learning_rate": last(history["learning_rate"]),
      "examples_per_sec": (steady_examples / steady_seconds
                           if steady_seconds > 0 else None),
      "num_replicas": setup.replicas,
      "num_workers": setup.workers,
      "global_batch_size": setup.global_batch,
      "strategy": config.distribution.strategy,
      "cross_device_ops": config.distribution.cross_device_ops,
      "cross_device_impl": devices.describe(setup.strategy),
      "task": task.name,
      **task.describe(),
      "malloc_tuned": setup.malloc_tuned,
      **_onednn_state(),
      "collectives_per_step": collectives,
      # Layers whose random draws depend on the replica count
      # (engine/core/randomness.py); [] when every draw is keyed by row.
      "replica_dependent_randomness": state.randomness.summary(),
      "mode": config.loop.mode,
      "ema_decay": config.loop.ema_decay,
  })
  return summary


def _finish(task, config, setup, state, summary, history) -> Result:
  """Writes summary.json and the weights, exports; returns the Result."""
  with open(os.path.join(setup.output_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  weights = [np.array(v.numpy()) for v in state.model.trainable_variables]
  if config.checkpoints.weights_out:
    np.savez(os.path.join(setup.output_dir, config.checkpoints.weights_out),
             *weights)
  if config.reporting.export:  # (the features' spec builds a pipeline)
    with ema_lib.swapped(state.ema):  # the export serves the averages
      reporting.finish(config.reporting, task, state.model,
                       state.data.features_spec, chief=setup.chief,
                       output_dir=setup.output_dir)
  if not setup.chief:
    shutil.rmtree(setup.output_dir, ignore_errors=True)
  # Last: once it is printed, everything is written (the command line exits
  # right after it, engine/ending.py).
  logging.info("Done: %s", json.dumps(summary))
  return Result(summary, history, weights,
                state.train_loop.experimental_get_tracing_count(), state.model,
                state.ema and state.ema.values())

