"""What to train: a `Task` supplies the model, the data, the loss and metrics.

The engine owns everything else: the strategy, batching, the step, the
all-reduce, checkpoints, evaluation, summaries and export. Pass the pieces,

    task = engine.Task(
        model=lambda: my_keras_model(),
        inputs=lambda split, context: my_examples(split),  # (features, labels)
        loss=keras.losses.Huber(reduction=None),             # one per example
        metrics={"mae": keras.metrics.mean_absolute_error})

or subclass and override the `build_*` methods (as TF Model Garden's
official/core `Task` does), e.g. when the pieces share state.

Contract (checked before training, each mistake a one-line error):
  * `build_inputs(split, context)` returns a finite `tf.data.Dataset` of
    single, unbatched examples `(features, labels)` in a fixed order, or None
    when the task has no data for `split` ("train" or "eval"). Features may
    be a tensor or a dict of tensors; labels any structure the loss accepts.
    Return the whole split on every worker: the engine shuffles, batches by
    the global batch and gives each worker its share of every batch, which
    is what keeps results the same for any number of replicas and workers.
    `context` (a `tf.distribute.InputContext`) says how many workers there
    are and which one this is.
  * `per_example_loss(labels, outputs)` returns one float per example
    (shape [batch]); the engine sums it on each replica and divides by the
    number of examples in the global batch. Keras losses made with
    `reduction=None` fit as they are. A model with several outputs (a dict
    or list) may instead take a loss per output, `loss={"class": ...,
    "value": ...}` with `loss_weights={"value": 0.5}` (`build_loss`), its
    labels of the same structure.
  * `build_metrics()` returns named metrics: functions `(labels, outputs) ->
    one value per example`, each reported as its mean over the examples (of a
    step, of an evaluation), and Keras metric objects (`keras.metrics.AUC()`,
    ...), whose states the engine sums across replicas and workers (training:
    over the epoch so far; evaluation: over the pass). With a loss per
    output, an entry keyed by an output name holds that output's metrics and
    any other applies to each output, reported as "OUTPUT/NAME".
  * `model.losses` (kernel and activity regularizers) are added by the
    engine, once per step for the global batch.
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, Callable, Dict, Mapping, Optional,
                    Sequence, Union)


if TYPE_CHECKING:  # this module loads without TensorFlow (fast CLI errors)
  import keras
  import tensorflow as tf

MetricFn = Callable[[object, "tf.Tensor"], "tf.Tensor"]
# A per-example function or a keras.metrics.Metric; with several outputs an
# entry keyed by an output name may hold a list or dict of them.
Metrics = Union[Mapping[str, object], Sequence[object]]
Losses = Union[Callable, Mapping[str, Callable], Sequence[Callable]]
SPLITS = ("train", "eval")
# Names the engine reports itself; a task's metric may not take them.
RESERVED = ("loss", "examples", "grad_norm", "learning_rate",
            "examples_per_sec", "steps_per_sec")


class Task:
  """What to train; see the module docstring for the contract.

  Args:
    model: () -> keras.Model, called inside the strategy's scope.
    inputs: (split, tf.distribute.InputContext) -> tf.data.Dataset or None.
    loss: (labels, outputs) -> per-example losses; or, for a model with
      several outputs, {output: loss} or [loss, ...] (an output without a
      loss needs no label).
    loss_weights: {output: weight} or [weight, ...] with a loss per output
      (default 1.0 each); "loss" is the weighted sum.
    metrics: {name: metric} or [metric, (name, metric), ...], a metric being
      a per-example function or a Keras metric object; a name defaults to
      the metric's `name` (or `__name__`).
    name: for logs and for the checkpoint's run identity (default: the
      class name).
  """
  # The exported SavedModel's input name when the features are one tensor.
  serving_input_name = "features"
  # Whether tf.data converts this task's own `preprocess_batch`,
  # `augment_batch` and the `map` functions of its `build_inputs` with
  # AutoGraph, as it converts every `map` function: a Python `if` or `for`
  # on a tensor's value becomes a graph branch or loop. Set it False when
  # they branch on Python values only (the built-in image task does): the
  # engine then builds all of the task's data sets without AutoGraph, and
  # the run's start skips it (benchmarks/RESULTS.md, "Exit at `Done:` and
  # start-up").
  autograph = True

  def __init__(self, *, model: Optional[Callable[[], keras.Model]] = None,
               inputs: Optional[Callable] = None,
               loss: Optional[Losses] = None,
               loss_weights=None,
               metrics: Optional[Metrics] = None,
               name: Optional[str] = None):
    self._model_fn = model
    self._inputs_fn = inputs
    self._loss_fn = loss
    self._loss_weights = loss_weights
    self._metrics = metrics
    self.name = name or type(self).__name__

  def build_model(self) -> keras.Model:
    """The model to train; built inside the strategy's scope."""
    if self._model_fn is None:
      raise NotImplementedError(f"{self.name}: pass model= or override "
                                "build_model().")
    return self._model_fn()

  def build_inputs(self, split: str, context: tf.distribute.InputContext
                   ) -> Optional[tf.data.Dataset]:
    """Unbatched `(features, labels)` examples of `split`, or None."""
    if self._inputs_fn is None:
      raise NotImplementedError(f"{self.name}: pass inputs= or override "
                                "build_inputs().")
    return self._inputs_fn(split, context)

  def per_example_loss(self, labels, outputs) -> tf.Tensor:
    """One loss value per example, shape [batch]."""
    if self._loss_fn is None:
      raise NotImplementedError(f"{self.name}: pass loss= or override "
                                "per_example_loss().")
    if isinstance(self._loss_fn, (Mapping, list, tuple)):
      raise NotImplementedError(
          f"{self.name}: a loss per output is summed by the engine "
          "(engine/core/objective.py), not by per_example_loss().")
    return self._loss_fn(labels, outputs)

  def build_loss(self) -> Losses:
    """The loss: `per_example_loss`, or the loss per output given as
    `loss=` (a dict or list)."""
    if isinstance(self._loss_fn, (Mapping, list, tuple)):
      return self._loss_fn
    return self.per_example_loss

  def build_loss_weights(self):
    """{output: weight} (or a list) for a loss per output; None: 1.0 each."""
    return self._loss_weights

  def num_examples(self, split: str) -> Optional[int]:
    """The split's size if known without reading it (e.g. from metadata).

    None (the default): the engine takes the data set's cardinality, or
    counts the examples in one pass when the data set does not know it.
    """
    del split
    return None

  def build_metrics(self) -> Metrics:
    """Named metrics (per-example functions, Keras metric objects); none by
    default."""
    return self._metrics or {}

  def preprocess_batch(self, features, labels, training: bool):
    """Vectorised work on a batch after batching, e.g. decoding images.

    The engine calls it on each replica's rows of every global batch, on
    the worker that trains them (engine/core/inputs.py), so that work done
    here (the built-in task decodes its images here) is split 1/N among N
    workers; treat rows independently. Returns `(features, labels)`, or
    `(features, labels, keep)` with `keep` a bool [rows] vector: the rows
    that are False (an image that cannot be read) are dropped after
    `augment_batch`, and the step's loss is the mean over the rows left.
    Identity by default.
    """
    del training
    return features, labels

  def augment_batch(self, features, labels, step: tf.Tensor,
                    positions: tf.Tensor):
    """Training only, after `preprocess_batch`: random changes to the rows
    (the built-in image task's --augment). `step` is the int64 index of the
    step the rows train (0 for the first); `positions` (int64 [rows]) is
    each row's index in its global batch. Keep each row's randomness a
    pure function of (your seed, step, its position), e.g.
    tf.random.stateless_* seeded from (seed, step) and drawn for positions
    0..max, then gathered at `positions`: resuming then sees the same
    batches, and so do any number of replicas and workers. Identity by
    default."""
    del step, positions
    return features, labels

  def describe(self) -> Dict[str, object]:
    """JSON facts about the task for logs, summary.json and run.json.

    A checkpoint is only resumed by a run whose task describes itself the
    same way, so include what would make resuming wrong if it changed.
    """
    return {"task": self.name}

  def serving_features(self):
    """What the exported SavedModel takes, when not the features the input
    pipeline makes: `(signature, preprocess)`, `signature` a
    `tf.TensorSpec` (or a dict of them) with a free batch dimension and
    `preprocess` a Keras layer (or any trackable callable) that maps such
    inputs to the model's features, e.g. a `TextVectorization` layer taking
    raw strings. None (the default): the features as the pipeline makes
    them."""
    return None

  def serving_outputs(self, outputs) -> Dict[str, tf.Tensor]:
    """What the exported SavedModel's `serving_default` returns: a dict of
    outputs as it is, a list by `output_0`, `output_1`..., else
    `{"outputs": outputs}`."""
    if isinstance(outputs, Mapping):
      return dict(outputs)
    if isinstance(outputs, (list, tuple)):
      return {f"output_{i}": t for i, t in enumerate(outputs)}
    return {"outputs": outputs}
