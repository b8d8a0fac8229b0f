"""Keras callbacks at host-call boundaries (`engine.run(..., callbacks=[...])`).

The compiled loop runs `--steps_per_loop` steps per host call, so callbacks
are called between host calls, as Keras `fit` calls them with
`steps_per_execution`:

  on_train_begin         before the first host call
  on_epoch_begin(e)      at the start and after each epoch's end
  on_train_batch_end(b)  once per host call; b is the index in its epoch of
                         the call's last step, logs that step's values
  on_test_end            after each evaluation; logs {"loss", "accuracy", ...}
  on_epoch_end(e)        after the host call holding the epoch's last step;
                         logs the epoch's means over its steps trained in
                         this run (exact: the rows hold every step), plus
                         "val_<name>" of an evaluation at that step
  on_train_end           at the end; logs the final summary's values

Callbacks do not choose where host calls end: the schedule of host calls
must be the same on every worker, and a worker's callbacks are its own.

Every worker calls its callbacks (Keras `fit` does the same under
MultiWorkerMirroredStrategy), with the same values: the rows and evaluation
results are all-reduced. A callback that sets `model.stop_training` on any
worker votes to finish (engine/core/preemption.py): the vote rides the next
host call's all-reduce, and at its end every worker stops at the same step,
then saves, exports and writes summary.json as at a normal end. With one
worker the vote is acted on at the same point, so 1 and N workers agree.
"""
import math
from typing import Optional, Sequence

import keras

from engine.hooks import Hook


def check(callbacks: Sequence) -> list:
  """The callbacks as a list; a TypeError names one that is not a Callback."""
  out = list(callbacks)
  for c in out:
    if not isinstance(c, keras.callbacks.Callback):
      raise TypeError(f"callbacks: {type(c).__name__} is not a "
                      "keras.callbacks.Callback.")
  return out


class CallbackHook(Hook):
  """Calls Keras callbacks with the loop's metrics by name."""

  def __init__(self, callbacks: Sequence, model: keras.Model, *, stop,
               start_step: int, total_steps: int, steps_per_epoch: int):
    self._callbacks = list(callbacks)
    self._model = model
    self._stop = stop  # engine/core/preemption.StopAgreement
    self._total = total_steps
    self._per_epoch = steps_per_epoch
    self._start = start_step
    self._epoch_sums = {}
    self._epoch_steps = 0
    self._eval = None  # (step, metrics) of the latest evaluation
    self._running = {}  # metric objects' values at the last call's end
    params = {"epochs": math.ceil(total_steps / steps_per_epoch),
              "steps": steps_per_epoch, "verbose": 0}
    for c in self._callbacks:
      c.set_model(model)
      c.set_params(params)

  def _call(self, method: str, *args, step: int) -> None:
    for c in self._callbacks:
      getattr(c, method)(*args)
    if self._model.stop_training:
      self._stop.request_finish(
          f"a callback set model.stop_training at step {step}")

  def begin(self, step: int) -> None:
    self._model.stop_training = False
    self._call("on_train_begin", {}, step=step)
    self._call("on_epoch_begin", step // self._per_epoch, {}, step=step)

  def on_eval(self, step: int, metrics: dict) -> None:
    self._eval = (step, metrics)
    logs = {k[len("eval_"):]: v for k, v in metrics.items()
            if k.startswith("eval_") and k != "eval_examples"}
    self._call("on_test_end", logs, step=step)

  def after_loop(self, step, rows, seconds):
    names = rows.metrics()
    means = [n for n in names if n not in rows.running]
    first = step - len(rows) + 1
    # A metric object's value is over the epoch so far at the call's end,
    # which is an epoch's end when one ends (metric_states.BoundaryHook).
    self._running = {n: float(rows[n][-1]) for n in rows.running}
    for k in range(len(rows)):
      for name in means:
        self._epoch_sums[name] = (self._epoch_sums.get(name, 0.0) +
                                  float(rows[name][k]))
      self._epoch_steps += 1
      if first + k < step and (first + k) % self._per_epoch == 0:
        self._end_epoch(first + k)  # an epoch ended inside the host call
    self._call("on_train_batch_end", (step - 1) % self._per_epoch,
               {name: float(rows[name][-1]) for name in names}, step=step)
    if step % self._per_epoch == 0 or step == self._total:
      self._end_epoch(step)

  def _end_epoch(self, step: int) -> None:
    epoch = (step - 1) // self._per_epoch
    logs = {k: v / self._epoch_steps for k, v in self._epoch_sums.items()}
    logs.update(self._running)
    logs.update(self._val_logs(step))
    self._call("on_epoch_end", epoch, logs, step=step)
    self._epoch_sums, self._epoch_steps = {}, 0
    if step < self._total:
      self._call("on_epoch_begin", epoch + 1, {}, step=step)

  def _val_logs(self, step: int) -> dict:
    if self._eval is None or self._eval[0] != step:
      return {}
    return {"val_" + k[len("eval_"):]: v for k, v in self._eval[1].items()
            if k.startswith("eval_") and k != "eval_examples"}

  def end(self, summary):
    logs = {k[len("final_"):]: v for k, v in summary.items()
            if k.startswith("final_") and v is not None}
    logs.update(self._val_logs(summary["global_step"]))
    for c in self._callbacks:
      c.on_train_end(logs)


def make_hook(callbacks: Sequence, model, *, stop, start_step: int,
              total_steps: int, steps_per_epoch: int) -> Optional[Hook]:
  """The CallbackHook, or None without callbacks."""
  if not callbacks:
    return None
  return CallbackHook(callbacks, model, stop=stop, start_step=start_step,
                      total_steps=total_steps,
                      steps_per_epoch=steps_per_epoch)
