"""Input iterators are dropped on a thread of their own (engine/core/iterators.py).

Destroying a tf.data iterator can wait up to a minute for tf.data's
autotuning thread (measured: 74 s between `Done:` and the exit of a run
pinned to one core); a run hands its iterators to another thread, so
`engine.run` returns at once, and the process's exit joins those threads
(one abandoned inside TensorFlow aborted multi-worker processes at exit).
"""
import threading
import time

from conftest import run_job, tiny_config


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
                             ("_State", "iterator", "DistributedIterator")]
