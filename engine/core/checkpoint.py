"""Checkpoints that resume exactly, refuse foreign runs, and survive kills.

A checkpoint holds the model, the optimizer (its `iterations` is the global
step) and, when the run has them, the weight averages ("ema", --ema_decay)
and the --keep_best comparison ("best"); nothing else: the input pipelines
are pure functions of the seed and the step (engine/core/inputs.py's
`TrainData.distribute(strategy, start_step)`), so the data position is the
global step. Next to the checkpoints, `run.json` records what the run was
(model, data, replicas, workers, global batch); a resume of another task
description is refused.

Another number of replicas or workers resumes as it is when the global batch
is unchanged: the global batches, their order and each row's randomness do
not depend on how many replicas share them (engine/core/inputs.py), so the
resumed run trains as an uninterrupted run on either count would. Refused
unless --allow_resume_change, each with its reason: another global batch
(the step, the data position and the learning-rate schedule all count
global batches), and --shard_files with another worker count or turned on
or off (each worker then reads its own files, so the order depends on the
worker count).

TensorFlow writes each checkpoint under a temporary name and only then
atomically rewrites the `checkpoint` index file, so a process killed while
saving leaves the previous checkpoint as the latest.
"""
import json
import os

from absl import logging
import tensorflow as tf

from engine.hooks import Hook, every
from engine.errors import ExitCode, Preempted, ResourceStop, flag_error

# run.json keys that describe how the run was spread, not what it is.
_SHAPE_KEYS = ("num_replicas", "num_workers", "global_batch_size",
               "shard_files")


def run_identity(described: dict, replicas: int, global_batch: int,
                 workers: int = 1, shard_files: bool = False) -> dict:
  """What a run is (the task's own description) and its shape."""
  return {**described, "num_replicas": replicas, "num_workers": workers,
          "global_batch_size": global_batch, "shard_files": shard_files}


def resume_change(saved: dict, identity: dict):
  """Why resuming `saved` as `identity` would change the results, or None.

  A run.json from an earlier engine version lacks num_workers and
  shard_files: such a run had no --shard_files (or recorded the workers).
  """
  before, now = saved.get("global_batch_size"), identity["global_batch_size"]
  if before != now:
    return (f"was trained with a global batch of {before}, this run has "
            f"{now}: the step, the position in the data and the learning-"
            "rate schedule all count global batches, so resuming would train "
            f"other examples at other rates. Resume with a global batch of "
            f"{before} (any number of replicas or workers), or pass "
            "--allow_resume_change to accept that.")
  sharded = (bool(saved.get("shard_files")), identity["shard_files"])
  workers = (saved.get("num_workers"), identity["num_workers"])
  if sharded[0] != sharded[1] or (any(sharded) and workers[0] != workers[1]):
    return (f"was trained {'with' if sharded[0] else 'without'} "
            f"--shard_files on {workers[0]} worker(s), this run is "
            f"{'with' if sharded[1] else 'without'} it on {workers[1]}: with "
            "--shard_files each worker reads its own files, so the order of "
            "the examples depends on the number of workers. Resume as the "
            "run was, or pass --allow_resume_change to accept another "
            "order.")
  return None


class Checkpointer:
  """Owns the CheckpointManager of one run directory.

  Args:
    restore_dir: where the latest checkpoint is read (the chief's).
    save_dir: where this process saves.
    model, optimizer: what a checkpoint holds.
    model_dir: --model_dir, named in errors.
    keep: checkpoints kept (--keep_checkpoints).
    allow_resume_change: resume even where the results would change
      (`resume_change`).
    extras: more trackables by key: "ema" (required in a checkpoint it
      resumes from) and "best" (optional: a run that starts keeping the
      best starts its comparison afresh).
  """

  def __init__(self, restore_dir: str, save_dir: str, model, optimizer, *,
               model_dir: str, keep: int, allow_resume_change: bool,
               extras=None):
    self._restore_dir = restore_dir
    self.directory = save_dir
    self._model_dir = model_dir
    self._allow_change = allow_resume_change
    self._core = dict(model=model, optimizer=optimizer)
    self._extras = dict(extras or {})
    self._ckpt = tf.train.Checkpoint(**self._core, **self._extras)
    self._manager = tf.train.CheckpointManager(self._ckpt, save_dir,
                                               max_to_keep=keep)
    self._best_manager = None
    self._optimizer = optimizer

  def restore(self, identity: dict) -> int:
    """Restores the latest checkpoint if there is one; returns its step.

    Raises:
      ConfigError: the directory belongs to another run or cannot be read.
    """
    meta_path = os.path.join(self._restore_dir, "run.json")
    latest = tf.train.latest_checkpoint(self._restore_dir)
    if latest is None:
      return 0
    try:
      with open(meta_path) as f:
        saved = json.load(f)
    except (OSError, ValueError) as e:
      raise flag_error("model_dir", self._model_dir,
                       f"holds checkpoint {latest} without a readable "
                       "run.json; use a new --model_dir.") from e
    # Keys the saved run recorded: a run.json from an earlier engine version
    # lacks the newer ones.
    for key in identity:
      if key in _SHAPE_KEYS or key not in saved:
        continue
      if saved[key] != identity[key]:
        raise flag_error(
            "model_dir", self._model_dir,
            f"holds a checkpoint of another run ({key}={saved.get(key)!r}, "
            f"this run has {identity[key]!r}); use a new --model_dir.")
    change = resume_change(saved, identity)
    if change and not self._allow_change:
      raise flag_error("model_dir", self._model_dir, change)
    if not change and any(saved.get(k) != identity[k] for k in (
        "num_replicas", "num_workers") if k in saved):
      logging.info(
          "Resuming a run of %s replica(s) on %s worker(s) with %d replica(s) "
          "on %d worker(s): the global batch (%d) and its order are "
          "unchanged, so it trains on as an uninterrupted run would.",
          saved.get("num_replicas"), saved.get("num_workers", "?"),
          identity["num_replicas"], identity["num_workers"],
          identity["global_batch_size"])
    try:
      restore(latest, self._core, self._extras, optional=("best",))
    except (tf.errors.OpError, AssertionError, ValueError) as e:
      raise flag_error("model_dir", self._model_dir,
                       f"checkpoint {latest} cannot be restored "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                       "; nothing was overwritten.") from e
    step = int(self._optimizer.iterations.numpy())
    logging.info("Resumed from %s at step %d.", latest, step)
    return step

  def write_identity(self, identity: dict) -> None:
    os.makedirs(self.directory, exist_ok=True)
    tmp = os.path.join(self.directory, "run.json.tmp")
    with open(tmp, "w") as f:
      json.dump(identity, f, indent=2)
    os.replace(tmp, os.path.join(self.directory, "run.json"))

  def save(self, step: int) -> str:
    path = self._manager.save(checkpoint_number=step)
    logging.info("Saved checkpoint %s.", path)
    return path

  def save_best(self, directory: str, step: int) -> str:
    """Saves the same objects into `directory`, keeping only the newest."""
    if self._best_manager is None:
      self._best_manager = tf.train.CheckpointManager(self._ckpt, directory,
                                                      max_to_keep=1)
    path = self._best_manager.save(checkpoint_number=step)
    logging.info("Saved best checkpoint %s.", path)
    return path


def saved_keys(path: str) -> set:
  """The top-level objects a checkpoint holds ("model", "optimizer", ...)."""
  return {name.split("/", 1)[0] for name, _ in tf.train.list_variables(path)}


def restore(path: str, core: dict, extras: dict, optional=()) -> None:
  """Restores `core` and `extras` from `path`, each key checked on its own.

  Raises:
    AssertionError: a key of `core`, or of `extras` outside `optional`, is
      missing or does not match.
    tf.errors.OpError, ValueError: the checkpoint cannot be read.
  """
  tf.train.Checkpoint(**core).restore(path).assert_existing_objects_matched(
  ).expect_partial()
  present = saved_keys(path)
  for key, trackable in extras.items():
    if key not in present:
      if key in optional:
        continue
      raise AssertionError(f"it holds no {key!r} (the run was trained "
                           f"without it); use a new --model_dir")
    tf.train.Checkpoint(**{key: trackable}).restore(
        path).assert_existing_objects_matched()


class CheckpointHook(Hook):
  """Saves every `--checkpoint_every` steps, at the end, and on preemption.

  Preemption (SIGTERM/SIGINT on any worker) is decided by `stop`, an
  `engine.core.preemption.StopAgreement`, after every host call on every
  worker, so all workers save at the same step.
  """

  def __init__(self, checkpointer: Checkpointer, every_steps: int, stop):
    self._checkpointer = checkpointer
    self._every = every_steps
    self._stop = stop
    self._last_saved = None

  def next_stop(self, step):
    return every(self._every, step)

  def after_loop(self, step, rows, seconds):
    reason = self._stop.should_stop(step, rows.votes)
    if (self._every and step % self._every == 0) or reason:
      self._save(step)
    if reason and self._stop.for_resource:
      raise ResourceStop(f"{reason}; checkpoint saved at step {step}. Rerun "
                         "the same command to resume.")
    if reason:
      raise Preempted(f"{reason} at step {step}; checkpoint saved, exit code "
                      f"{int(ExitCode.PREEMPTED)}.")

  def end(self, summary):
    if self._last_saved != summary["global_step"]:
      self._save(summary["global_step"])

  def _save(self, step):
    self._checkpointer.save(step)
    self._last_saved = step

  def close(self):
    self._stop.close()
