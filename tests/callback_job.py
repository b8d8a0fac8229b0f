"""The built-in job with a callback that stops training (the launcher test's
script, and the callback the in-process tests use).

    python tests/callback_job.py --stop_after=6 --stop_on_worker=1 [flags]

`--stop_on_worker=K` gives the callback to worker K only, so the others stop
only because the vote reaches them (engine/core/preemption.py).
"""
from absl import flags
import keras

from engine import cli
from engine.tasks import image_classification


class StopAfter(keras.callbacks.Callback):
  """Sets model.stop_training at the host call that reaches `step`."""

  def __init__(self, step: int):
    super().__init__()
    self._step = step
    self._epoch = 0
    self.steps = []  # the global step of each on_train_batch_end

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    step = self._epoch * self.params["steps"] + batch + 1
    self.steps.append(step)
    if self._step and step >= self._step:
      self.model.stop_training = True


def callbacks(config):
  wanted = flags.FLAGS.stop_on_worker
  if wanted >= 0 and wanted != config.distribution.task_index:
    return []
  return [StopAfter(flags.FLAGS.stop_after)]


if __name__ == "__main__":
  flags.DEFINE_integer("stop_after", 0, "Stop at this step (0: never).")
  flags.DEFINE_integer("stop_on_worker", -1,
                       "Only this worker has the callback (-1: every one).")
  module = cli.caller_module(depth=1)
  image_classification.define_flags(module_name=module)
  cli.define_flags(module_name=module)
  cli.run(image_classification.from_flags, callbacks=callbacks)
