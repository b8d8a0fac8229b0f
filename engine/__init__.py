"""A distributed training loop for TensorFlow: train your task on 1..N replicas
and workers with the guarantees README.md describes (exact partial batches, one
gradient all-reduce per step, exact resume, coordinated preemption).

    import engine

    task = engine.Task(model=make_model, inputs=make_examples,
                       loss=keras.losses.Huber(reduction=None),
                       metrics={"mae": keras.metrics.mean_absolute_error})
    engine.configure_host(cpu_devices=2)          # before TensorFlow runs ops
    result = engine.run(task, engine.Config.create(train_steps=500,
                                                   cpu_devices=2))

or, as a command line with the engine's flags next to your own:

    if __name__ == "__main__":
      engine.cli.run(lambda config: task)

Importing the engine defines no absl flag, runs no TensorFlow op and sets no
environment variable: TensorFlow's oneDNN rewrites stay as TensorFlow sets
them (on by default on x86 CPUs; engine/onednn.py says where the engine
needs them off).
"""
import sys

# Whether TensorFlow was imported first: the run log and summary.json say so.
_TENSORFLOW_FIRST = "tensorflow" in sys.modules

# The public API, imported on first use (PEP 562), so that `import engine`
# and the launcher (`python -m engine.launch`) do not load TensorFlow.
_API = {
    "CheckpointConfig": "engine.config", "Config": "engine.config",
    "DataConfig": "engine.config", "DistributionConfig": "engine.config",
    "LoopConfig": "engine.config", "OptimizationConfig": "engine.config",
    "ReportingConfig": "engine.config",
    "InitializationConfig": "engine.config",
    "ClusterError": "engine.errors", "ConfigError": "engine.errors",
    "Hook": "engine.core.hooks", "Rows": "engine.core.hooks",
    "Result": "engine.core.run", "run": "engine.core.run",
    "configure_host": "engine.distribute.devices",
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
