"""Evaluation: the eval step, a distributed finite pass and the hook running it.

The eval pass uses the same strategy as training and the same definitions of
the loss and the metrics (engine/core/step.py's `forward_sums`). Each replica
returns the sums of its per-example values and its example count; one
`strategy.reduce(SUM)` per batch adds them over all replicas and workers, and
the means divide by the global count of real examples, so a partial last
batch, or a replica with no examples, weighs exactly as on one device.

Keras metric objects keep a state per replica (engine/core/metric_states.py):
each pass starts them at zero and sums them across replicas and workers
once, at its end.

Each worker decodes only its own replicas' rows of every global batch, as in
training (engine/core/inputs.py's `EvalData`): N workers each decode 1/N of
the evaluation images, with the one-replica results.
"""
import contextlib
import math
from typing import Callable, ContextManager, Dict, Optional, Sequence

from absl import logging
import tensorflow as tf

from engine.core import inputs, iterators, metric_states
from engine.core.objective import Objective
from engine.hooks import Hook, every
from engine.core.step import batch_size, forward_sums, output_spec
from engine.distribute import hang

_SUM = tf.distribute.ReduceOp.SUM


def make_replica_eval_step(objective: Objective, model,
                           states: Optional[metric_states.Replicas] = None
                           ) -> Callable:
  """(features, labels) -> [loss sum, count, column sums...] of a replica;
  the batch is added to the replica's metric objects' `states`.

  A replica with no examples (its share of a partial batch, or a worker
  whose FILE-sharded data ran out) runs no model and adds zeros: oneDNN's
  Conv2D computes empty batches wrong (docs/design/onednn.md). Inference
  has no collective in the model, so skipping it is safe on every strategy.
  """
  def forward(features, labels):
    sums, outputs = forward_sums(objective, model, features, labels,
                                 training=False)
    if not states:
      return sums
    with tf.control_dependencies([states.update(labels, outputs)]):
      return tf.identity(sums)

  def eval_step(features, labels):
    rows = batch_size(features, labels)
    sums = tf.cond(rows > 0, lambda: forward(features, labels),
                   lambda: tf.zeros([1 + len(objective.columns)], tf.float32))
    count = tf.cast(rows, tf.float32)
    return tf.concat([sums[:1], [count], sums[1:]], axis=0)
  return eval_step


def make_eval_loop(strategy: tf.distribute.Strategy, eval_step, width: int,
                   until_end: bool,
                   states: Optional[metric_states.Replicas] = None):
  """Compiles one pass over a distributed iterator into one host call.

  Args:
    until_end: read until the data end (a data set each worker reads its
      own share of, FILE sharding) instead of exactly `batches` batches.

  Returns:
    eval_loop(iterator, batches) -> (float32 [width]: the pass's global sums
    (loss, examples, columns...); float32 [states.width]: the metric
    objects' states summed over all replicas, empty without them).
  """
  stateful = states is not None and bool(states)

  def around(run_pass):
    """The pass between resetting and reading the replicas' states."""
    if not stateful:
      return run_pass(), tf.zeros([0], tf.float32)
    strategy.run(states.reset)
    totals = run_pass()
    return totals, strategy.reduce(_SUM, strategy.run(states.read),
                                   axis=None)

  def add(totals, features, labels):
    per_replica = strategy.run(eval_step, args=(features, labels))
    return totals + strategy.reduce(_SUM, per_replica, axis=None)

  # Control flow written out and traced without AutoGraph, as the train loop
  # (engine/core/step.py's `make_train_loop` says why).
  @tf.function(autograph=False)
  def to_the_end(iterator, batches):
    def one(i, more, totals):
      # The pass ends on every worker at the same batch: on multi_worker
      # `has_value` is all-reduced over the workers, and one that has run
      # out gets an empty batch meanwhile, so no worker waits for a
      # collective its peers never join.
      optional = iterator.get_next_as_optional()
      more = optional.has_value()
      return i + 1, more, tf.cond(
          more, lambda: add(totals, *optional.get_value()), lambda: totals)
    return around(lambda: tf.while_loop(
        lambda i, more, _: tf.logical_and(more, i < batches), one,
        (tf.constant(0), tf.constant(True),
         tf.zeros([width], tf.float32)))[2])

  @tf.function(autograph=False)
  def exactly(iterator, batches):
    return around(lambda: tf.while_loop(
        lambda i, _: i < batches,
        lambda i, totals: (i + 1, add(totals, *next(iterator))),
        (tf.constant(0), tf.zeros([width], tf.float32)))[1])

  return to_the_end if until_end else exactly


class Evaluator:
  """Evaluates a model over one finite data set, as often as asked.

  Each worker builds its own replicas' rows of the global batches and
  decodes only those (engine/core/inputs.py's `EvalData`, the split training
  uses). With DATA sharding (every worker reads the same global batches) one
  iterator over the passes repeated serves every pass, each exactly
  ceil(examples / global batch) batches: making a distributed iterator costs
  about 80 ms and 4.5 KB that are never given back (measured: +11 MB over
  2,500 passes), which a long run with frequent evaluations would pay each
  time. With FILE (the task's data set says each worker reads its own
  files) the workers' shares differ in size, so each pass takes a new
  iterator and reads to the end.
  """

  def __init__(self, strategy, objective: Objective, model,
               data: inputs.EvalData, watch=hang.unbounded):
    self.names = ("loss", "examples") + objective.columns
    states = reader = None
    if objective.objects:
      labels_spec = data.element_spec[1]
      outputs_spec = output_spec(model, data.element_spec)
      states = metric_states.Replicas(strategy, objective.task.name,
                                      objective.objects, labels_spec,
                                      outputs_spec)
      reader = metric_states.Reader(objective.task.name, objective.objects,
                                    labels_spec, outputs_spec)
    self._reader = reader
    step = make_replica_eval_step(objective, model, states)
    self._until_end = data.until_end
    self._loop = make_eval_loop(strategy, step, len(self.names),
                                self._until_end, states)
    if self._until_end:
      self._dataset = data.distribute(strategy, repeat=False)
      self._iterator = None
      # An upper bound only; the pass ends when the data do. Each step uses
      # at least one real example somewhere, so n + 1 steps see the end.
      self._batches = tf.constant(data.num_examples + 1, tf.int32)
    else:
      self._iterator = iter(data.distribute(strategy, repeat=True))
      self._batches = tf.constant(data.steps_per_pass, tf.int32)
    self.num_examples = data.num_examples
    self._watch = watch  # engine/distribute/hang.py's bound for a pass

  def evaluate(self) -> Dict[str, float]:
    """One pass: {"eval_loss", "eval_examples", "eval_<metric>", ...}."""
    if self._until_end:
      self._iterator = iter(self._dataset)
    with self._watch("eval", self.num_examples):
      sums, state = self._loop(self._iterator, self._batches)
    sums = sums.numpy()
    if self._until_end:  # this pass's iterator is done with
      iterators.drop_later(self, "_iterator")
    count = int(sums[1])
    # Fewer when the task's pipeline skipped examples it could not read
    # (undecodable images, data/decode.py); never more.
    if count > self.num_examples:
      raise RuntimeError(f"evaluated {count} examples, expected at most "
                         f"{self.num_examples}: the eval split was not read "
                         "exactly once.")
    out = {f"eval_{name}": float(value / count)
           for name, value in zip(self.names, sums)}
    if self._reader is not None:
      out.update({f"eval_{name}": value for name, value in
                  self._reader.results(state.numpy()).items()})
    out["eval_examples"] = count
    return out

  @property
  def traces(self) -> int:
    return self._loop.experimental_get_tracing_count()

  def release(self) -> None:
    """Lets go of the input iterator (engine/core/iterators.py); no pass
    may follow."""
    iterators.drop_later(self, "_iterator")


class EvalHook(Hook):
  """Evaluates every `eval_every` steps (0: each epoch's end) and at the end.

  `on_result(step, metrics)` gets each evaluation (engine.run passes every
  hook's `Hook.on_eval`, this one's too); the last one goes into
  summary.json.
  `weights()` is entered around each pass: with --ema_decay it puts the
  averaged weights in (engine/core/ema.py).
  """

  def __init__(self, evaluator: Optional[Evaluator], eval_every: int,
               total_steps: int,
               on_result: Optional[Callable[[int, dict], None]] = None,
               keys: Sequence[str] = (),
               weights: Callable[[], ContextManager] = contextlib.nullcontext):
    self._evaluator = evaluator
    self._weights = weights
    self._every = eval_every
    self._total = total_steps
    self._on_result = on_result
    # summary.json's eval keys when there is no evaluator (all null).
    self._keys = tuple(keys)
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
    with self._weights():
      metrics = self._evaluator.evaluate()
    self.results.append((step, metrics))
    shown = " | ".join(f"{k[len('eval_'):]} {v:.4f}" for k, v in
                       metrics.items() if k != "eval_examples")
    logging.info("eval at step %d | %s | %d examples", step, shown,
                 metrics["eval_examples"])
    if self._on_result is not None:
      self._on_result(step, metrics)

  def end(self, summary):
    if self._evaluator is None:
      summary.update(dict.fromkeys(self._keys))
      return
    # A resumed run that had nothing left to train still reports its weights.
    if not self.results or self.results[-1][0] != summary["global_step"]:
      self._run(summary["global_step"])
    summary.update(self.results[-1][1])
    self.release()

  def release(self) -> None:
    """Lets go of the evaluation's input iterator, off this thread
    (engine/core/iterators.py): at `end`, or when the run ends by an
    exception (engine/core/run.py). No evaluation may follow."""
    if self._evaluator is not None:
      self._evaluator.release()


def eval_keys(objective: Objective) -> tuple:
  """summary.json's keys for an evaluation of this objective."""
  return ("eval_loss",) + tuple(
      f"eval_{n}" for n in objective.columns + objective.object_names) + (
          "eval_examples",)
