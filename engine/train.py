"""The outer loop: set up, run the compiled inner loop, log, write summary.json."""
import atexit
import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import List

from absl import logging
import keras
import numpy as np
import tensorflow as tf

import data
import models
from engine import (checkpoint, cluster, comm, devices, evaluate, hang,
                    memory, preemption, reporting, resources, step)
from engine.config import Config
from engine.errors import flag_error
from engine.optimizers import create_optimizer


@dataclasses.dataclass
class Result:
  """What a run produced; `summary` is also written to summary.json."""
  summary: dict
  losses: np.ndarray         # global mean loss per step
  accuracies: np.ndarray     # global accuracy per step
  weights: List[np.ndarray]  # final trainable weights, replica 0
  traces: int                # times the compiled loop was traced (want 1)
  model: keras.Model = None  # the trained model (export tests compare to it)


def check_model_dir(path: str) -> None:
  """Fails before training, not after it, if results could not be written."""
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, ".write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise flag_error("model_dir", path, f"cannot be written ({e.strerror}); "
                     "pick a directory you can write.") from e


def is_chief(strategy: tf.distribute.Strategy) -> bool:
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or not resolver.cluster_spec().as_dict():
    return True
  return (resolver.task_type in ("chief", None) or
          (resolver.task_type == "worker" and resolver.task_id == 0 and
           "chief" not in resolver.cluster_spec().as_dict()))


def train(config: Config, extra_hooks=()) -> Result:
  """Trains `config.model` on `config.dataset`; see README for the flags.

  Args:
    config: the run's configuration.
    extra_hooks: more `hooks.Hook`s, e.g. a benchmark's timer.

  Raises:
    ConfigError: for bad devices, data sets or output directories.
  """
  if config.model not in models.MODELS:
    raise flag_error("model", config.model,
                     f"unknown; valid: {', '.join(sorted(models.MODELS))}.")
  strategy = devices.make_strategy(config)
  # After the strategy: on multi_worker no op may run before it exists.
  malloc_tuned = config.malloc_tuning and memory.tune_malloc()
  chief = is_chief(strategy)
  # Only the chief writes model_dir; other workers write the same files to a
  # private temporary directory, removed at the end, so no two processes ever
  # write one file.
  output_dir = config.model_dir if chief else tempfile.mkdtemp(
      prefix="tfengine_worker_")
  if not chief:  # also on an error exit (not on SIGKILL)
    atexit.register(shutil.rmtree, output_dir, ignore_errors=True)
  check_model_dir(output_dir)
  replicas = strategy.num_replicas_in_sync
  workers = getattr(strategy.extended, "_num_workers", 1)
  # One optimizer update takes --grad_accum_steps micro-batches per replica.
  global_batch = (config.batch_size_per_replica * config.grad_accum_steps *
                  replicas)
  _, info = data.build_train(config, global_batch)  # lazy: no data read yet
  total_steps = config.train_steps or config.epochs * info.steps_per_epoch
  logging.info(
      "Global batch %d on %d worker(s) = %d per worker = %d per replica "
      "(%d replicas, %s, %s); %d examples, %d steps per epoch, %d steps.",
      global_batch, workers, global_batch // workers,
      global_batch // replicas, replicas, config.strategy,
      devices.describe(strategy), info.num_examples, info.steps_per_epoch,
      total_steps)
  logging.info("Classes (%d): %s", info.num_classes,
               ", ".join(info.class_names))

  keras.utils.set_random_seed(config.seed)
  with strategy.scope():
    model = models.create_model(
        config.model, info.num_classes, config.image_size,
        mixed_precision=config.mixed_precision,
        sync_batchnorm=config.sync_batchnorm)
    optimizer = create_optimizer(config)
    # Built here, in the scope and before the first tf.function call, so the
    # slots are mirrored variables and not created inside the trace.
    optimizer.build(model.trainable_variables)
  # Every worker resumes from the chief's checkpoints (model_dir must be
  # shared storage across hosts) and saves into its own output_dir.
  checkpointer = checkpoint.Checkpointer(
      os.path.join(config.model_dir, "checkpoints"),
      os.path.join(output_dir, "checkpoints"), model, optimizer, config)
  identity = checkpoint.run_identity(config, info.num_classes, replicas,
                                     global_batch)
  start_step = checkpointer.restore(identity)
  checkpointer.write_identity(identity)
  # The pipeline is a pure function of (seed, step): resuming is skipping.
  dataset, _ = data.build_train(config, global_batch, start_step, workers)
  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  train_loop = step.make_train_loop(
      strategy, step.make_replica_step(model, optimizer, config))

  # One thread bounds every call that can wait on peers (engine/hang.py);
  # no collective has a timeout of its own.
  with hang.bounded_calls(
      config.collective_timeout, config.init_timeout,
      peer_messages=cluster.peer_messages(),
      name_stuck=cluster.stuck_peers_line) as watch:
    return _train_and_report(
        config, strategy, model, optimizer, checkpointer, iterator,
        train_loop, info, chief=chief, output_dir=output_dir,
        start_step=start_step, total_steps=total_steps,
        global_batch=global_batch, workers=workers,
        malloc_tuned=malloc_tuned, extra_hooks=extra_hooks, watch=watch)


def _train_and_report(config, strategy, model, optimizer, checkpointer,
                      iterator, train_loop, info, *, chief, output_dir,
                      start_step, total_steps, global_batch, workers,
                      malloc_tuned, extra_hooks, watch) -> Result:
  """Runs the loop with its hooks; writes summary.json, weights, export."""
  replicas = strategy.num_replicas_in_sync
  stop = preemption.StopAgreement(strategy, config, watch)
  ckpt_hook = checkpoint.CheckpointHook(checkpointer, config.checkpoint_every,
                                        stop)
  # Before the checkpoint hook: a stop it asks for is exchanged at once.
  resource_hook = resources.ResourceHook(stop.request_stop)
  report_hooks = reporting.make_hooks(
      config, chief=chief, output_dir=output_dir, optimizer=optimizer,
      start_step=start_step, total_steps=total_steps,
      steps_per_epoch=info.steps_per_epoch)
  eval_hook = evaluate.make_hook(
      config, strategy, model, global_batch, info.steps_per_epoch,
      total_steps, workers, on_result=reporting.eval_writer(report_hooks),
      watch=watch)
  comm_hook = comm.CommHook(config, optimizer, model.trainable_variables,
                            replicas)
  hook_list = [*report_hooks, *extra_hooks, eval_hook, comm_hook,
               resource_hook, ckpt_hook]
  try:
    history, steady_examples, steady_seconds = _run(
        train_loop, iterator, start_step, total_steps, config, hook_list,
        watch)
  finally:
    ckpt_hook.close()
    reporting.close(hook_list)
  cluster.stop_watchdog()  # the last collective is done; peers may now exit
  collectives = comm.collectives_per_step(
      train_loop.get_concrete_function(iterator, tf.constant(1, tf.int32)),
      len(strategy.extended.worker_devices))
  losses, accuracies = history[:, 0], history[:, 1]
  window = accuracies[-config.log_every:]
  last = lambda a: float(a[-1]) if len(a) else None
  summary = {
      "global_step": int(optimizer.iterations.numpy()),
      "start_step": start_step,
      "final_loss": last(losses),
      "final_accuracy": float(np.mean(window)) if len(window) else None,
      "first_loss": float(losses[0]) if len(losses) else None,
      "final_grad_norm": last(history[:, 3]),
      "examples_per_sec": (steady_examples / steady_seconds
                           if steady_seconds > 0 else None),
      "num_replicas": replicas,
      "num_workers": workers,
      "global_batch_size": global_batch,
      "strategy": config.strategy,
      "cross_device_ops": config.cross_device_ops,
      "cross_device_impl": devices.describe(strategy),
      "model": config.model,
      "dataset": info.name,
      "num_classes": info.num_classes,
      "class_names": list(info.class_names),
      "image_size": config.image_size,
      "malloc_tuned": malloc_tuned,
      "collectives_per_step": collectives,
  }
  for h in hook_list:
    h.end(summary)
  with open(os.path.join(output_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  logging.info("Done: %s", json.dumps(summary))
  weights = [np.array(v.numpy()) for v in model.trainable_variables]
  if config.weights_out:
    np.savez(os.path.join(output_dir, config.weights_out), *weights)
  reporting.finish(config, model, chief=chief, output_dir=output_dir)
  if not chief:
    shutil.rmtree(output_dir, ignore_errors=True)
  return Result(summary, losses, accuracies, weights,
                train_loop.experimental_get_tracing_count(), model)


def _run(train_loop, iterator, start_step: int, total_steps: int,
         config: Config, hook_list, watch):
  """Calls the compiled loop until `total_steps`, handing each call to hooks.

  The first call runs a single step: it includes tracing, so it is left out of
  the steady-state throughput. Later calls run `steps_per_loop` steps, ended
  early where a hook needs control at an exact step.
  """
  rows, done = [np.zeros((0, 4), np.float32)], start_step
  steady_examples, steady_seconds = 0.0, 0.0
  while done < total_steps:
    stop = min([total_steps, done + config.steps_per_loop] +
               [h.next_stop(done) for h in hook_list])
    n = 1 if done == start_step else int(stop - done)
    start = time.perf_counter()
    with watch("train", n):
      out = train_loop(iterator, tf.constant(n, tf.int32)).numpy()  # host sync
    seconds = time.perf_counter() - start
    if done > start_step:
      steady_examples += float(out[:, 2].sum())
      steady_seconds += seconds
    # NaN guard: raised before any hook, so no non-finite weights are saved.
    bad = np.flatnonzero(~np.isfinite(out[:, [0, 3]]).all(axis=1))
    if bad.size:
      raise FloatingPointError(
          f"loss {out[bad[0], 0]}, gradient norm {out[bad[0], 3]} at step "
          f"{done + bad[0] + 1}")
    done += n
    for h in hook_list:
      h.after_loop(done, out, seconds)
    rows.append(out)
  return np.concatenate(rows), steady_examples, steady_seconds
