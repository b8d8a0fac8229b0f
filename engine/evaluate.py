"""Evaluation: the eval step, a distributed finite pass and the hook running it.

The eval pass uses the same strategy as training. Each replica returns the sums
of its per-example losses and correct predictions and its example count; one
`strategy.reduce(SUM)` per batch adds them over all replicas and workers, and
the means divide by the global count of real examples, so a partial last batch,
or a replica with no examples, weighs exactly as on one device.
"""
import math
from typing import Callable, Optional

from absl import logging
import tensorflow as tf

import data
from engine import hang
from engine.config import Config
from engine.hooks import Hook, every

_SUM = tf.distribute.ReduceOp.SUM


def make_replica_eval_step(model):
  """(images, labels) -> [loss sum, correct, count] of this replica's slice."""
  def eval_step(images, labels):
    logits = tf.cast(model(images, training=False), tf.float32)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    correct = tf.cast(
        tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels),
        tf.float32)
    return tf.stack([tf.reduce_sum(per_example), tf.reduce_sum(correct),
                     tf.cast(tf.shape(labels)[0], tf.float32)])
  return eval_step


def make_eval_loop(strategy: tf.distribute.Strategy, eval_step):
  """Compiles one pass over a distributed iterator into one host call.

  Returns:
    eval_loop(iterator, max_batches) -> float32 [3]: the global loss sum,
    correct count and example count of the pass.
  """
  @tf.function
  def eval_loop(iterator, max_batches):
    totals = tf.zeros([3], tf.float32)
    for _ in tf.range(max_batches):
      # The pass ends on every worker at the same batch: on multi_worker
      # `has_value` is all-reduced over the workers, and one that has run out
      # gets an empty batch meanwhile, so no worker waits for a collective
      # its peers never join.
      optional = iterator.get_next_as_optional()
      if not optional.has_value():
        break
      images, labels = optional.get_value()
      per_replica = strategy.run(eval_step, args=(images, labels))
      totals += strategy.reduce(_SUM, per_replica, axis=None)
    return totals
  return eval_loop


class Evaluator:
  """Evaluates a model over one finite data set, as often as asked."""

  def __init__(self, strategy, model, dataset: tf.data.Dataset,
               num_examples: int, watch=hang.unbounded):
    self._dataset = strategy.experimental_distribute_dataset(dataset)
    self._loop = make_eval_loop(strategy, make_replica_eval_step(model))
    # An upper bound only; the pass ends when the data do. Each step uses at
    # least one real example somewhere, even when FILE sharding gives the
    # workers different numbers of batches, so n + 1 steps always see the end.
    self._max_batches = tf.constant(num_examples + 1, tf.int32)
    self.num_examples = num_examples
    self._watch = watch  # engine/hang.py's bound for a pass

  def evaluate(self) -> dict:
    """One pass: {"eval_loss", "eval_accuracy", "eval_examples"}."""
    with self._watch("eval", self.num_examples):
      loss_sum, correct, count = self._loop(
          iter(self._dataset), self._max_batches).numpy()
    if int(count) != self.num_examples:
      raise RuntimeError(f"evaluated {int(count)} examples, expected "
                         f"{self.num_examples}: the eval split was not read "
                         "exactly once.")
    return {"eval_loss": float(loss_sum / count),
            "eval_accuracy": float(correct / count),
            "eval_examples": int(count)}

  @property
  def traces(self) -> int:
    return self._loop.experimental_get_tracing_count()


class EvalHook(Hook):
  """Evaluates every `eval_every` steps (0: each epoch's end) and at the end.

  `results` keeps (step, metrics) per evaluation, for anything that reports
  them later (e.g. summaries); the last one goes into summary.json.
  """

  def __init__(self, evaluator, eval_every: int, total_steps: int,
               on_result: Optional[Callable[[int, dict], None]] = None):
    self._evaluator = evaluator
    self._every = eval_every
    self._total = total_steps
    self._on_result = on_result  # e.g. the TensorBoard eval writer
    self.results = []

  def next_stop(self, step):
    if self._evaluator is None:
      return math.inf
    return min(every(self._every, step), self._total)

  def after_loop(self, step, rows, seconds):
    if self._evaluator is not None and (
        step % self._every == 0 or step == self._total):
      self._run(step)

  def _run(self, step):
    metrics = self._evaluator.evaluate()
    self.results.append((step, metrics))
    logging.info("eval at step %d | loss %.4f | accuracy %.4f | %d examples",
                 step, metrics["eval_loss"], metrics["eval_accuracy"],
                 metrics["eval_examples"])
    if self._on_result is not None:
      self._on_result(step, metrics)

  def end(self, summary):
    keys = ("eval_loss", "eval_accuracy", "eval_examples")
    if self._evaluator is None:
      summary.update(dict.fromkeys(keys))
      return
    # A resumed run that had nothing left to train still reports its weights.
    if not self.results or self.results[-1][0] != summary["global_step"]:
      self._run(summary["global_step"])
    summary.update({k: self.results[-1][1][k] for k in keys})


def make_hook(config: Config, strategy, model, global_batch: int,
              steps_per_epoch: int, total_steps: int,
              num_workers: int = 1, on_result=None,
              watch=hang.unbounded) -> EvalHook:
  """The run's EvalHook; it does nothing when --eval_split is empty.

  `on_result(step, metrics)` is called after each evaluation.

  Raises:
    ConfigError: an unknown eval split or bad images, before training starts.
  """
  built = data.build_eval(config, global_batch, num_workers)
  if built is None:
    return EvalHook(None, 0, total_steps)
  dataset, num_examples = built
  logging.info("Evaluating on %s %s (%d examples) every %s.", config.dataset,
               config.eval_split, num_examples,
               f"{config.eval_every} steps" if config.eval_every else
               f"epoch ({steps_per_epoch} steps)")
  evaluator = Evaluator(strategy, model, dataset, num_examples, watch)
  return EvalHook(evaluator, config.eval_every or steps_per_epoch,
                  total_steps, on_result)

