"""This process's place in the run: the strategy, chief or not, where it writes.

Only the chief writes model_dir; every other worker writes the same files
(checkpoints, export) to a private temporary directory, removed at the end,
so every worker runs the same code (saving is collective-safe) and no two
processes ever write one file. A worker holds a lock on its directory while
it lives: one whose process is gone (SIGKILLed, so it could not remove it)
is removed by the next worker that starts on the host.
"""
import dataclasses
import fcntl
import os
import re
import shutil
import tempfile

import tensorflow as tf

from engine import ending, onednn
from engine.config import Config
from engine.distribute import strategy as strategy_lib
from engine.errors import flag_error
from engine.host import memory


@dataclasses.dataclass
class Setup:
  """The strategy and this process's place in the run."""
  strategy: tf.distribute.Strategy
  chief: bool
  output_dir: str  # model_dir on the chief, a private temp dir elsewhere
  replicas: int
  workers: int
  global_batch: int
  malloc_tuned: bool


def set_up(config: Config) -> Setup:
  """Makes the strategy and finds this process's role and output directory.

  Raises:
    ConfigError: a device, cluster or output directory that cannot be used.
  """
  strategy = strategy_lib.make_strategy(config.distribution)
  # After the strategy: on multi_worker no op may run before it exists.
  malloc_tuned = config.host.malloc_tuning and memory.tune_malloc()
  chief = is_chief(strategy)
  output_dir = config.checkpoints.model_dir if chief else _worker_dir()
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
  return Setup(strategy, chief, output_dir, replicas,
               getattr(strategy.extended, "_num_workers", 1), global_batch,
               malloc_tuned)


_PREFIX = "tfengine_worker_"  # then the pid, "_" and mkdtemp's letters
_WORKER_DIR = re.compile(_PREFIX + r"\d+_[a-z0-9_]+")
_LOCK = ".lock"
_held = []  # this process's locks on its own directories, held to its end


def _worker_dir() -> str:
  """A non-chief worker's private output directory, locked while this
  process lives; first removes those of workers that are gone."""
  remove_orphans(tempfile.gettempdir())
  path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}_")
  # Locked before it takes its name, so a lock file found is always held.
  new = os.path.join(path, _LOCK + ".new")
  lock = os.open(new, os.O_CREAT | os.O_RDWR, 0o600)
  fcntl.flock(lock, fcntl.LOCK_EX)
  os.rename(new, os.path.join(path, _LOCK))
  _held.append(lock)
  return path


def remove_orphans(parent: str) -> list:
  """Removes the worker directories in `parent` whose process has ended;
  returns their paths.

  A worker holds an flock on its directory's lock file while it lives; the
  kernel releases it when the process ends, however it ends. So a lock that
  can be taken is a dead worker's, also one of another PID namespace (a
  container sharing the directory), where the pid in the name would say
  nothing. A directory without a lock file (being made) is left alone.
  """
  removed = []
  try:
    names = os.listdir(parent)
  except OSError:
    return removed
  for name in names:
    if not _WORKER_DIR.fullmatch(name):
      continue
    path = os.path.join(parent, name)
    try:
      lock = os.open(os.path.join(path, _LOCK), os.O_RDONLY)
    except OSError:  # no lock file yet, or not ours to read
      continue
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its worker lives
      continue
    else:
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
    finally:
      os.close(lock)
  return removed


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


def profile_dir(model_dir: str, setup: Setup) -> str:
  """Where --profile_steps traces go: model_dir on the chief, and on worker
  k > 0 (with --profile_all_workers) model_dir/worker_k, its own folder
  (TensorBoard shows it as the run "worker_k"), so that a slow worker can be
  told apart from a slow network."""
  if setup.chief:
    return setup.output_dir
  resolver = setup.strategy.cluster_resolver
  return os.path.join(model_dir, f"{resolver.task_type}_{resolver.task_id}")


def exchanges_votes(preemption_sync: bool, setup: Setup) -> bool:
  """Whether host calls sum the workers' stop votes (engine/core/
  preemption.py): with --preemption_sync on more than one worker."""
  return preemption_sync and setup.workers > 1


def leave(setup: Setup) -> None:
  """Removes a non-chief worker's private output directory (at the end)."""
  if not setup.chief:
    shutil.rmtree(setup.output_dir, ignore_errors=True)
