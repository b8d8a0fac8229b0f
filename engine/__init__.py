"""A distributed training loop for TensorFlow: train your task on 1..N replicas
and workers with the guarantees README.md lists (exact partial batches, one
gradient all-reduce per step, exact resume, coordinated preemption).

    import engine

    task = engine.Task(model=make_model, inputs=make_examples,
                       loss=keras.losses.Huber(reduction=None),
                       metrics={"mae": keras.metrics.mean_absolute_error})
    config = engine.Config.create(train_steps=500, cpu_devices=2)
    engine.configure_host(config)                 # before TensorFlow runs ops
    result = engine.run(task, config)

or, as a command line with the engine's flags next to your own:

    if __name__ == "__main__":
      engine.cli.run(lambda config: task)

Importing the engine defines no absl flag, runs no TensorFlow op and sets no
environment variable: TensorFlow's oneDNN rewrites stay as TensorFlow sets
them (on by default on x86 CPUs; engine/onednn.py says where the engine
needs them off).
"""
import os
import sys

# Whether TensorFlow was imported first: the run log and summary.json say so.
_TENSORFLOW_FIRST = "tensorflow" in sys.modules


class _CheckoutRegistries:
  """engine.models and engine.data from a checkout: the folders models/ and
  data/ beside this engine/ (the wheel installs them as engine/models and
  engine/data; docs/design/packaging.md).

  Only these two names, only from this checkout: a run of another checkout
  (PYTHONPATH=/other/tree, as benchmarks' --baseline_tree does) gets that
  tree's registries even when this environment's editable install maps
  another one.
  """
  _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  _FOLDERS = {"engine.models": "models", "engine.data": "data"}

  @classmethod
  def find_spec(cls, fullname, path=None, target=None):
    del path, target
    folder = cls._FOLDERS.get(fullname)
    if folder is None:
      return None
    import importlib.util  # pylint: disable=g-import-not-at-top
    where = os.path.join(cls._ROOT, folder)
    return importlib.util.spec_from_file_location(
        fullname, os.path.join(where, "__init__.py"),
        submodule_search_locations=[where])


if (not os.path.isdir(os.path.join(os.path.dirname(__file__), "models")) and
    os.path.isfile(os.path.join(_CheckoutRegistries._ROOT, "models",  # pylint: disable=protected-access
                                "__init__.py"))):
  sys.meta_path.insert(0, _CheckoutRegistries)

# The public API, imported on first use (PEP 562), so that `import engine`
# and the launcher (`python -m engine.launch`) do not load TensorFlow.
_API = {
    "BatchNormConfig": "engine.config", "CheckpointConfig": "engine.config",
    "Config": "engine.config", "DataConfig": "engine.config",
    "DistributionConfig": "engine.config", "EvaluationConfig": "engine.config",
    "HostConfig": "engine.config", "InitializationConfig": "engine.config",
    "LoopConfig": "engine.config", "OptimizationConfig": "engine.config",
    "RandomnessConfig": "engine.config", "ReportingConfig": "engine.config",
    "ClusterError": "engine.errors", "ConfigError": "engine.errors",
    "Diverged": "engine.errors", "ExitCode": "engine.errors",
    "Preempted": "engine.errors", "ResourceStop": "engine.errors",
    "Hook": "engine.hooks", "Rows": "engine.hooks",
    "Result": "engine.core.run", "run": "engine.core.run",
    "configure_host": "engine.host.cpus",
    "Task": "engine.task",
}
_MODULES = ("classification", "cli")
__all__ = sorted(list(_API) + list(_MODULES))


def __getattr__(name):
  import importlib  # pylint: disable=g-import-not-at-top
  if name in _API:
    return getattr(importlib.import_module(_API[name]), name)
  if name in _MODULES:
    return importlib.import_module(f"engine.{name}")
  raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__():
  return __all__
