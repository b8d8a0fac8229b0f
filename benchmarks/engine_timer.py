"""The engine's throughput as the benchmarks time it: `engine.run` with a
hook that counts the examples of the steps after the warm-up, end to end
(benchmarks.throughput, benchmarks.in_process, benchmarks.families).
Defines no flags."""
import atexit
import shutil
import tempfile
import time


def scratch_dir(prefix: str) -> str:
  """A new folder in the temporary directory for a timed run's model_dir,
  removed when this (variant's) process exits."""
  path = tempfile.mkdtemp(prefix=prefix)
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


def engine_rate(fields: dict, warmup: int, steps: int) -> float:
  """Examples/s of steps warmup+1 .. warmup+steps of the built-in job made
  from `fields` (flag names); host calls stop at both marks."""
  from engine.tasks import image_classification as ic  # pylint: disable=g-import-not-at-top
  config, image = ic.configs(**fields)
  return task_rate(ic.ImageClassification(image, seed=config.randomness.seed),
                   config, warmup, steps)


def task_rate(task, config, warmup: int, steps: int) -> float:
  """Examples/s of steps warmup+1 .. warmup+steps of `engine.run(task,
  config)`; host calls stop at both marks."""
  examples, seconds, _ = task_timing(task, config, warmup, steps)
  return examples / seconds


def task_timing(task, config, warmup: int, steps: int):
  """(examples, wall seconds, CPU seconds of this process) of steps
  warmup+1 .. warmup+steps of `engine.run(task, config)`."""
  import engine  # pylint: disable=g-import-not-at-top
  from engine import hooks  # pylint: disable=g-import-not-at-top

  class Timer(hooks.Hook):
    def __init__(self):
      self.start, self.stop, self.examples = None, None, 0.0

    def next_stop(self, step):
      for mark in (warmup, warmup + steps):
        if step < mark:
          return mark
      return super().next_stop(step)

    def after_loop(self, step, rows, seconds):
      if self.start is not None and step <= warmup + steps:
        self.examples += float(rows["examples"].sum())
        self.stop = (time.perf_counter(), time.process_time())
      if step == warmup:
        self.start = (time.perf_counter(), time.process_time())

  timer = Timer()
  engine.run(task, config, hooks=[timer])
  return (timer.examples, timer.stop[0] - timer.start[0],
          timer.stop[1] - timer.start[1])
