"""Input iterators are dropped on a thread of their own (engine/core/iterators.py).

Destroying a tf.data iterator can wait up to a minute for tf.data's
autotuning thread (measured: 74 s between `Done:` and the exit of a run
pinned to one core); a run hands its iterators to another thread, so
`engine.run` returns at once, and an ordinary process exit joins those
threads (one abandoned inside TensorFlow aborted multi-worker processes at
exit). The command line instead ends with `engine.ending.end`: flushed,
cleaned up, `os._exit` (tests/test_partial_batch.py times a 2-worker
launch's exit; tests/test_exits.py its codes).

A run that ends by an exception hands them over too: nothing of them is
left to the garbage collector, which would destroy them (and wait) in
whatever thread it next runs, in the middle of a later run.
"""
import gc
import subprocess
import sys
import threading
import time

import engine
import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.ops import iterator_ops
from tensorflow.python.data.ops import multi_device_iterator_ops

from conftest import ROOT, run_job, tiny_config


class _Witness:
  """Records the thread that drops the last reference to it."""

  def __init__(self, log, seconds=0.0):
    self._log = log
    self._seconds = seconds  # how long its destructor takes

  def __del__(self):
    time.sleep(self._seconds)
    self._log.append(threading.current_thread().name)


class _Owner:
  pass


def test_the_last_reference_is_dropped_on_another_thread():
  from engine.core import iterators  # pylint: disable=g-import-not-at-top
  log, owner = [], _Owner()
  owner.iterator = _Witness(log)
  iterators.drop_later(owner, "iterator")
  assert owner.iterator is None
  for t in threading.enumerate():
    if t.name == "tfengine_drop_iterator":
      t.join(10)
  assert log == ["tfengine_drop_iterator"]
  iterators.drop_later(owner, "iterator")  # None: nothing to drop, no thread
  assert log == ["tfengine_drop_iterator"]


def test_the_exit_handler_waits_for_every_drop():
  from engine.core import iterators  # pylint: disable=g-import-not-at-top
  log, owner = [], _Owner()
  owner.iterator = _Witness(log, seconds=1.0)
  start = time.monotonic()
  iterators.drop_later(owner, "iterator")
  assert time.monotonic() - start < 0.5 and not log  # the caller goes on
  iterators._join_drops()  # pylint: disable=protected-access
  assert log == ["tfengine_drop_iterator"]


def test_a_run_hands_its_training_and_eval_iterators_over(monkeypatch,
                                                          tmp_path):
  from engine.core import iterators  # pylint: disable=g-import-not-at-top
  dropped, drop = [], iterators.drop_later

  def record(owner, name):
    dropped.append((type(owner).__name__, name,
                    type(getattr(owner, name)).__name__))
    drop(owner, name)

  monkeypatch.setattr(iterators, "drop_later", record)
  result = run_job(tiny_config(cpu_devices=2, eval_split="train[:32]",
                               eval_every=3, model_dir=str(tmp_path)))
  assert result.summary["global_step"] == 6
  assert result.summary["eval_examples"] == 32
  # One Evaluator iterator (every pass reads it) and the training one, each
  # a live distributed iterator when it is handed over.
  assert sorted(dropped) == [("Evaluator", "_iterator", "DistributedIterator"),
                             ("State", "iterator", "DistributedIterator")]


def test_the_command_line_ends_without_waiting_at_exit(tmp_path):
  """`ending.end(code)`: buffered output and the engine's clean-ups come
  first; atexit handlers (where the iterator threads are joined) never run,
  so a handler that would wait 60 s costs nothing. No TensorFlow here."""
  script = tmp_path / "end.py"
  script.write_text(
      "import atexit, shutil, sys, time\n"
      "from engine import ending\n"
      f"ending.at_exit(shutil.rmtree, {str(tmp_path / 'scratch')!r})\n"
      "atexit.register(time.sleep, 60)\n"
      "sys.stdout.write('written before the exit')\n"
      "ending.end(75)\n")
  (tmp_path / "scratch").mkdir()
  start = time.monotonic()
  out = subprocess.run([sys.executable, str(script)], cwd=ROOT,
                       capture_output=True, text=True, timeout=30,
                       env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
  assert time.monotonic() - start < 20
  assert out.returncode == 75, out.stderr
  assert out.stdout == "written before the exit"
  assert not (tmp_path / "scratch").exists()


# tf.data's iterators, each owning a resource whose destructor can wait
# (symbolic copies live in the traced functions and own nothing).
_ITERATORS = (iterator_ops.OwnedIterator,
              multi_device_iterator_ops.OwnedMultiDeviceIterator)


def _live_iterators():
  """ids of the tf.data iterators alive now that own an eager resource."""
  def resource(o):
    for name in ("_iterator_resource", "_multi_device_iterator_resource"):
      if getattr(o, name, None) is not None:
        return getattr(o, name)
    return None
  return {id(o) for o in gc.get_objects() if isinstance(o, _ITERATORS) and
          isinstance(resource(o), tf.__internal__.EagerTensor)}


class _StopAfterEvaluating(engine.Hook):
  def on_eval(self, step, metrics):
    raise RuntimeError(f"stopped after the evaluation at step {step}")


def _labels_task(bad_splits=("train", "eval")):
  """32 rows; in `bad_splits` the labels are outside the model's 3 classes,
  so a step fails inside the compiled call."""
  x = np.random.default_rng(0).normal(size=(32, 5)).astype(np.float32)
  return engine.Task(
      model=lambda: keras.Sequential([keras.Input((5,)),
                                      keras.layers.Dense(3)]),
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          (x, np.full(32, 5 if split in bad_splits else 1, np.int32))),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=None),
      name="labels")


@pytest.mark.parametrize("ending", ["a hook raises", "the first step fails",
                                    "evaluating a checkpoint fails"])
def test_a_run_that_raises_leaves_no_iterator_to_the_collector(tmp_path,
                                                               ending):
  """With the exception still held (as a caller or a debugger holds it),
  the run's training and evaluation iterators are already gone, dropped on
  the run's own thread for them; also when the run is its process's
  first (its first import of tensorflow_datasets leaves a reference cycle
  of frames that reaches the engine's: engine/core/state.py)."""
  from engine.core import iterators  # pylint: disable=g-import-not-at-top
  gc.collect()
  gc.disable()  # what is left must be left by the run, not collected late
  try:
    before = _live_iterators()
    if ending == "a hook raises":
      j = tiny_config(cpu_devices=2, eval_split="train[:32]", eval_every=3,
                      model_dir=str(tmp_path))
      with pytest.raises(RuntimeError, match="at step 3") as caught:
        engine.run(j.task(), j.config, hooks=[_StopAfterEvaluating()])
    else:
      config = dict(cpu_devices=2, batch_size_per_replica=8, train_steps=2,
                    steps_per_loop=1, export=False, progress=False,
                    model_dir=str(tmp_path))
      if ending == "the first step fails":
        # On 2 replicas too the line names the kernel's error, not "2 root
        # error(s) found." (engine/core/host_loop.py).
        with pytest.raises(engine.ConfigError,
                           match="the first training step failed: Received "
                           "a label value of 5 which is outside") as caught:
          engine.run(_labels_task(), engine.Config.create(**config))
      else:  # --mode=eval of a checkpoint the good labels trained
        engine.run(_labels_task(bad_splits=()), engine.Config.create(**config))
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="label value of 5") as caught:
          engine.run(_labels_task(bad_splits=("eval",)),
                     engine.Config.create(mode="eval", **config))
    iterators._join_drops()  # pylint: disable=protected-access
    left = _live_iterators() - before
    assert caught.value is not None and not left, (
        f"{len(left)} iterator(s) still held after the run raised")
  finally:
    gc.enable()
