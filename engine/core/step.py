"""The train step and the compiled inner loop.

This is the one place where `strategy.run` and `tf.function` are applied, and
where gradients are all-reduced. The same code serves OneDevice, Mirrored and
MultiWorkerMirrored strategies: with one replica the all-reduce is an identity.

A step reports named sums, one row per step: "loss" (the summed per-example
loss, regularization included), "examples" (how many examples the step
really had), "grad_norm" (of the mean gradient, before --clip_global_norm),
"learning_rate" (what the step's update used), and the objective's columns
(each output's own loss, the metric functions) summed over its examples.
`make_train_loop` turns the sums into means over the examples of the global
batch. Keras metric objects update a state per replica instead
(engine/core/metric_states.py), summed in the host call's all-reduce.
"""
import contextlib
from typing import Callable, Optional, Sequence

import keras
import tensorflow as tf

from engine.config import BatchNormConfig, DistributionConfig
from engine.config import OptimizationConfig
from engine.core import batchnorm, metric_states
from engine.core import objective as objective_lib
from engine.core.objective import Objective
from engine.distribute import instance_keys
from engine.distribute.comm import WIRE_DTYPES
from engine.distribute.devices import communication_options

_SUM = tf.distribute.ReduceOp.SUM
# The engine's own columns of a step's row; the task's metrics follow.
TRAIN_COLUMNS = ("loss", "examples", "grad_norm", "learning_rate")
# Columns that are not sums over examples (see `means`).
_NOT_SUMS = ("examples", "grad_norm", "learning_rate")


def sum_names(objective: Objective) -> tuple:
  """The columns the compiled loop returns per step, in order."""
  return TRAIN_COLUMNS + objective.columns


def row_names(objective: Objective) -> tuple:
  """The names of a train step's row as hooks see it (engine/hooks.py's
  Rows): the compiled loop's columns, then the metric objects' results
  (engine/core/host_loop.py adds them)."""
  return sum_names(objective) + objective.object_names


def batch_size(features, labels) -> tf.Tensor:
  """Examples in a (micro-)batch: the leading dimension of its first tensor."""
  first = tf.nest.flatten((labels, features))[0]
  return tf.shape(first)[0]


def forward_sums(objective: Objective, model, features, labels,
                 training: bool, pad_empty: bool = False, rows=None,
                 randomness=None):
  """([loss sum, column sums...], outputs) of one (micro-)batch: the step's
  objective (engine/core/objective.py) and the outputs, float32.

  The loss sum is the task's per-example losses summed, plus the model's
  own losses (`model.losses`: kernel and activity regularizers) times the
  number of examples. Divided by the global count of examples (after the
  all-reduce), that gives the mean loss plus the regularization exactly
  once, whatever the number of replicas or the split of a partial batch:
  weight penalties are the same on every replica and sum back to n times
  themselves; Keras's activity penalties are means over the replica's
  examples, so n times each is their share of the global mean.

  `pad_empty`: the model never sees an empty batch (`_padded_call`).
  `rows` and `randomness` (training): the model's random draws are keyed
  by each row's (step, position) (engine/core/randomness.py).
  """
  count_rows = batch_size(features, labels)
  keyed = (randomness.rows(rows, model) if randomness is not None
           else contextlib.nullcontext())
  with keyed:
    if pad_empty:
      outputs = _padded_call(model, features, count_rows, training)
    else:
      outputs = model(features, training=training)
  # float32 for the loss and metrics, also under a mixed precision policy.
  outputs = tf.nest.map_structure(
      lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t, outputs)
  count = tf.cast(count_rows, tf.float32)
  sums = objective.sums(labels, outputs)
  if model.losses:
    penalty = count * tf.cast(tf.add_n(model.losses), tf.float32)
    sums = tf.concat([sums[:1] + penalty, sums[1:]], axis=0)
  return sums, outputs


def _padded_call(model, features, count, training):
  """The model's outputs for `count` rows, run on at least one row.

  For synchronized BatchNorm (fused path), where a replica with no examples
  cannot skip the model: it must join every layer's all-reduce. It runs on
  one row of zeros instead, which its BatchNorm layers leave out of the
  global moments (`batchnorm.padding`), and whose outputs are cut off
  before the loss: the results are those of the empty batch, and no
  convolution ever runs on an empty batch (oneDNN's Conv2D computes those
  wrong; docs/design/onednn.md).
  """
  pad = tf.cast(tf.equal(count, 0), tf.int32)
  padded = tf.nest.map_structure(
      lambda t: tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)),
      features)
  with batchnorm.padding(tf.cast(count > 0, tf.float32)):
    outputs = model(padded, training=training)
  return tf.nest.map_structure(lambda t: t[:count], outputs)


def output_spec(model, element_spec):
  """The model's outputs' specs (float32 where floating) for a batch of
  `element_spec`, from Keras (`compute_output_spec`: free for functional
  models, one symbolic call for subclassed ones, which creates their
  variables here, in the strategy's scope, before the optimizer is built
  for them)."""
  symbolic = tf.nest.map_structure(
      lambda s: keras.KerasTensor(s.shape, dtype=s.dtype.name),
      element_spec[0])
  return tf.nest.map_structure(
      lambda t: tf.TensorSpec(t.shape, tf.float32 if "float" in t.dtype
                              else t.dtype),
      model.compute_output_spec(symbolic))


def resolve(task, model, element_spec) -> Objective:
  """The task's loss and metrics resolved against the model's outputs for
  batches of `element_spec` ((features, labels, ...); engine/core/
  objective.py)."""
  return objective_lib.build(task, model, output_spec(model, element_spec),
                             element_spec[1])


def check_forward(objective: Objective, outputs_spec, element_spec) -> None:
  """Traces the loss and the metrics once on the shapes of the model's
  outputs and the labels, outside any replica, so a task's mistake is found
  before training.

  Tracing inside `strategy.run` would find it too, but MirroredStrategy's
  replica threads log the traceback before the error reaches the caller;
  here only the one-line ConfigError of engine/task.py comes out.

  Raises:
    ConfigError: the loss or a metric failed, or returned the wrong shape.
  """
  # Without AutoGraph, as the step calls them (see `make_train_loop`).
  tf.function(objective.sums, autograph=False).get_concrete_function(
      element_spec[1], outputs_spec)


def make_replica_step(objective: Objective, model, optimizer, *,
                      distribution: DistributionConfig,
                      optimization: OptimizationConfig,
                      batchnorm: BatchNormConfig,
                      batch_size_per_replica: int, ema=None,
                      randomness=None,
                      states: Optional[metric_states.Replicas] = None
                      ) -> Callable:
  """Returns the per-replica step: forward, backward, one all-reduce, update.

  The loss is the mean over the examples actually present in the global batch:
  each replica differentiates the *sum* of its per-example losses, and the
  summed gradient is divided by the global count of examples. That count is
  all-reduced with the gradients, so a partial last batch, or a replica that
  got no examples at all, gives exactly the single-device mean.

  With `--grad_accum_steps=K` each replica's batch holds K micro-batches of
  `--batch_size_per_replica`; their gradient sums are added up locally and
  all-reduced once, so the step equals one step on the K times larger batch.

  `--clip_global_norm` clips the all-reduced mean gradient, which every
  replica holds alike, so every replica applies the same clipped update:
  what one device with the whole global batch would do
  (docs/design/recipes.md).

  `ema` (engine/core/ema.py), if given, is updated after every update.
  `randomness` (engine/core/randomness.RowRandomness) keys the model's
  random draws by row. `states`: the metric objects' per-replica states
  (engine/core/metric_states.py), updated with each (micro-)batch.
  """
  options = communication_options(distribution)
  variables = model.trainable_variables
  loss_scaled = optimization.loss_scaling
  wire_dtype = WIRE_DTYPES[distribution.grad_compression]
  accum = optimization.grad_accum_steps
  clip = optimization.clip_global_norm
  # Synchronized BatchNorm: an empty replica runs the model on a padded row
  # (the fused path masks it out); Keras's own layer (--nofused_batchnorm)
  # counts rows itself, so it gets the empty batch (engine/onednn.py).
  pad_empty = batchnorm.sync_batchnorm and batchnorm.fused_batchnorm

  def replica_step(features, labels, rows):
    ctx = tf.distribute.get_replica_context()
    # Read before the update, which may change it (float16 loss scaling).
    scale = (tf.identity(optimizer.dynamic_scale.value) if loss_scaled
             else tf.constant(1.0))
    # The rate this update uses: the schedule at the update count before it
    # (engine/core/schedules.py), read before `apply` advances the count.
    # Only replica 0 reports it, so the loop's SUM of rows returns it exactly.
    rate = tf.where(tf.equal(ctx.replica_id_in_sync_group, 0),
                    tf.cast(optimizer.learning_rate, tf.float32), 0.0)
    forward_backward = _forward_backward_fn(
        objective, model, variables, optimization.jit_compile, pad_empty,
        randomness)
    local_count = tf.cast(batch_size(features, labels), tf.float32)
    # With compression the count needs an all-reduce of its own (see
    # _mean_gradients). It depends only on the batch's shape, so it is issued
    # here, before the forward pass, and its latency hides behind the compute.
    early_count = None
    if wire_dtype is not None:
      with instance_keys.fixed():  # one shape in every call
        early_count = ctx.all_reduce(_SUM, local_count, options=options)
    grads, sums = _accumulate(forward_backward, variables,
                              (features, labels, rows), scale, accum,
                              batch_size_per_replica,
                              batchnorm.sync_batchnorm,
                              len(objective.columns), states)
    nominal_count = float(batch_size_per_replica * accum *
                          ctx.num_replicas_in_sync)
    grads = _mean_gradients(ctx, grads, local_count, early_count, options,
                            wire_dtype, nominal_count)
    norm = tf.linalg.global_norm(grads)  # times `scale`, as the gradients
    if clip:
      grads = _clip(grads, norm, clip * scale)
    # Applies what it is given (engine/core/optimizers.py): no second
    # reduction. Under loss scaling it unscales, and skips a step whose
    # reduced gradient is not finite, on every replica alike.
    optimizer.apply(grads, variables)
    if ema is not None:
      # No collective: every replica's weights are the same after the update.
      ema.update(tf.cast(optimizer.iterations, tf.int64))
    # Every replica holds the same reduced gradient, so its norm divided by
    # the replica count sums back to the norm in the SUM reduce of the loop.
    norm_share = norm / scale / ctx.num_replicas_in_sync
    if loss_scaled:  # a skipped overflow step applied nothing
      norm_share = tf.where(tf.math.is_finite(norm_share), norm_share, 0.0)
    return tf.concat([sums[:1], [local_count, norm_share, rate], sums[1:]],
                     axis=0)

  return replica_step


def _mean_gradients(ctx, grads, local_count, global_count, options,
                    wire_dtype: Optional[tf.DType], nominal_count: float):
  """The gradient all-reduce, exactly once per step, divided by the count.

  The optimizer (engine/core/optimizers.py) applies what it is given and does
  not reduce again. Every gradient is dense here, an embedding's too
  (`_forward_backward_fn`): TensorFlow keys a collective's state by its
  instance and the host call, so a collective inside the compiled loop must
  have the same shape in every step of a call, and a sparse gradient's
  all-gather changes shape with the batch (a partial batch on N replicas
  failed with "Shape mismatch in the collective instance"). Dense, it rides
  in the one all-reduce with the rest, at vocabulary x width floats per
  step (docs/design/step.md, "Sparse gradients"). Without compression the example count rides in the same
  all-reduce as the gradients. With compression the gradients travel as
  float16/bfloat16, pre-divided by the nominal global batch so that their
  sum is about the mean gradient and cannot overflow float16; one multiply
  after the cast back turns that into the mean over the real examples. The
  count (`global_count`, reduced by the caller) stays float32, exact, in a
  4-byte all-reduce of its own: TF concatenates each pack into one tensor,
  which needs one dtype. Their shapes are the same in every step of every
  call, so their instance keys are fixed when the step is traced
  (engine/distribute/instance_keys.py): no record per host call.
  """
  if wire_dtype is None:
    with instance_keys.fixed():
      grads, global_count = ctx.all_reduce(_SUM, (grads, local_count),
                                           options=options)
    inverse = 1.0 / tf.maximum(global_count, 1.0)
    return [g * inverse for g in grads]
  wire = [tf.cast(g * (1.0 / nominal_count), wire_dtype) for g in grads]
  with instance_keys.fixed():
    wire = ctx.all_reduce(_SUM, wire, options=options)
  factor = nominal_count / tf.maximum(global_count, 1.0)
  return [tf.cast(g, tf.float32) * factor for g in wire]


def _clip(grads, norm, limit):
  """Scales the gradients to global norm `limit` when `norm` exceeds it.

  Exactly the given gradients when it does not (a factor of 1.0, not
  limit / limit). Under float16 loss scaling `norm` and `limit` are both
  times the loss scale, so the unscaled gradient is clipped to
  --clip_global_norm. A non-finite norm leaves the gradients non-finite
  (inf * 0 is NaN), so the loss-scale optimizer still skips the update and
  the NaN guard still sees it.
  """
  factor = tf.where(norm > limit, limit / norm, 1.0)
  return [g * factor for g in grads]


def _forward_backward_fn(objective: Objective, model, variables,
                         jit_compile: bool, pad_empty: bool,
                         randomness) -> Callable:
  """Gradients of one (micro-)batch's summed loss times the loss scale.

  With `--jit_compile` this part, not the whole step, is compiled by XLA:
  on CPU, XLA has no kernels for the collective all-reduce or the input
  iterator, so the all-reduce and the update stay outside it. Built once
  per replica, so that each replica's trace captures its own variables.

  Returns:
    forward_backward(features, labels, rows, scale) -> (gradients, sums,
    outputs), sums being [loss sum, column sums...] (see `forward_sums`); a
    variable the loss does not reach gets a zero gradient.
  """
  def forward_backward(features, labels, rows, scale):
    with tf.GradientTape() as tape:
      sums, outputs = forward_sums(
          objective, model, features, labels, training=True,
          pad_empty=pad_empty, rows=rows, randomness=randomness)
      scaled = sums[0] * scale  # 1.0 unless float16 loss scaling
    grads = tape.gradient(scaled, variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    # Dense, an embedding's IndexedSlices too: each collective of the
    # compiled loop must have one shape in every step (see `_mean_gradients`).
    return [tf.convert_to_tensor(g) for g in grads], sums, outputs

  if jit_compile:
    return tf.function(forward_backward, jit_compile=True, autograph=False)
  return forward_backward


def _accumulate(forward_backward, variables, batch, scale, k: int,
                micro: int, sync_batchnorm: bool, num_columns: int, states):
  """Sums gradients and the row's sums over the K micro-batches of `batch`
  = (features, labels, rows), and adds each micro-batch to `states` (the
  metric objects', engine/core/metric_states.py).

  A replica's empty (micro-)batch -- its share of a partial batch, or rows
  its task could not read -- computes nothing and adds zeros: an empty
  batch would give NaN BatchNorm moments on that replica, and oneDNN's
  Conv2D returns the wrong shape for it (docs/design/onednn.md). With
  --sync_batchnorm every replica must join the BatchNorm all-reduces, so
  there the model runs (on a padded row, `forward_sums`).
  """
  zeros = ([tf.zeros_like(v) for v in variables],
           tf.zeros([1 + num_columns], tf.float32))

  def compute(part):
    grads, sums, outputs = forward_backward(*part, scale)
    if not states:
      return grads, sums
    with tf.control_dependencies([states.update(part[1], outputs)]):
      return [tf.identity(g) for g in grads], tf.identity(sums)

  def one(part):
    if sync_batchnorm:
      return compute(part)
    return tf.cond(batch_size(*part[:2]) > 0, lambda: compute(part),
                   lambda: zeros)

  if k == 1:
    return one(batch)

  def add(i, totals):
    part = tf.nest.map_structure(lambda t: t[i * micro:(i + 1) * micro],
                                 batch)
    return tf.nest.map_structure(tf.add, totals, one(part))

  if sync_batchnorm:
    # Unrolled: a collective inside a while loop's body would need merge_call
    # in a nested graph, which tf.distribute does not support.
    totals = zeros
    for i in range(k):
      totals = add(i, totals)
    return totals
  return tf.while_loop(lambda i, _: i < k, lambda i, t: (i + 1, add(i, t)),
                       (tf.constant(0), zeros))[1]


def means(sums: tf.Tensor, names: Sequence[str]) -> tf.Tensor:
  """Rows of global sums -> means over the examples, per step.

  "examples" stays a count, "grad_norm" is already the global norm and
  "learning_rate" the rate (see the replica step); every other column is a
  sum over examples.
  """
  # A division, not a multiplication by 1 / count: Eigen's vectorised
  # reciprocal is not exact, so the result would depend on the row count.
  denominator = tf.maximum(sums[:, names.index("examples")], 1.0)
  columns = [sums[:, k] if name in _NOT_SUMS else
             sums[:, k] / denominator for k, name in enumerate(names)]
  return tf.stack(columns, axis=1)


def make_train_loop(strategy: tf.distribute.Strategy, replica_step: Callable,
                    names: Sequence[str], exchange_votes: bool,
                    states: Optional[metric_states.Replicas] = None
                    ) -> Callable:
  """Compiles `num_steps` steps into one host call.

  Each step's only collective is the gradient all-reduce in the replica step.
  The per-step rows of sums stay on their replicas during the call and are
  summed across all replicas and workers once at its end, in one all-reduce
  of a [num_steps + 1, len(names)] tensor: a collective per step costs a
  fixed transport overhead and one more point where every worker waits for
  the slowest. The extra row carries each replica's stop vote (its host's
  SIGTERM/SIGINT or resource flag, engine/core/preemption.py) when
  `exchange_votes`, and replica 0's proposal for the length of the next
  host call (engine/core/pace.py; replica 0 is on the chief): the agreements
  ride in the same all-reduce, so a host call is one collective tf.function
  call (TensorFlow 2.21 keeps about 1.6 KB per such call; docs/design/host.md).

  Returns:
    train_loop(iterator, num_steps, vote) -> (float32 [num_steps,
    len(names)]: per step, the global means of `names` over the step's
    examples (the example count and gradient norm as they are); float32
    [2]: the stop votes summed over all replicas (or this worker's own,
    `vote[0]`, without `exchange_votes`) and replica 0's `vote[1]`).
    `vote` is float32 [2]: this worker's stop vote and its proposed
    length of the next call. `num_steps` is a tensor and the loop is a
    `tf.while_loop`, so any step count reuses one trace.

  The loop's control flow is written out (`tf.while_loop`, `tf.cond` in the
  step) and traced without AutoGraph, as Keras traces `fit`'s step:
  converting the engine's and the task's functions took seconds of a small
  job's start-up (benchmarks/RESULTS.md, "Start-up"). The task's model,
  loss and metrics run as traced Python, as under `fit`.
  """
  local_replicas = len(strategy.extended.worker_devices)
  width = len(names)
  stateful = states is not None and bool(states)

  def one_step(iterator, i, rows):
    # (features, labels, rows): engine/core/inputs.py
    per_replica = strategy.run(replica_step, args=next(iterator))
    return i + 1, [r.write(i, v) for r, v in
                   zip(rows, strategy.experimental_local_results(per_replica))]

  @tf.function(autograph=False)
  def train_loop(iterator, num_steps, vote):
    if stateful:
      strategy.run(states.reset)
    # One array per replica of this worker, written by that replica's step.
    rows = [tf.TensorArray(tf.float32, size=num_steps,
                           element_shape=[width])
            for _ in range(local_replicas)]
    # One step at a time: overlapping iterations would let the replicas'
    # collectives of two steps interleave and stall each other.
    _, rows = tf.while_loop(
        lambda i, _: i < num_steps,
        lambda i, rows: one_step(iterator, i, rows),
        (tf.constant(0), rows), parallel_iterations=1)
    stacked = [r.stack() for r in rows]
    # The extra row: [stop vote, proposal, 0, ...]; replica 0 alone adds
    # its proposal, so the sum is its own.
    extra = [tf.pad(vote * [1.0, 0.0], [[0, width - 2]])[None],
             tf.pad(vote, [[0, width - 2]])[None]]
    # Read in replica context: each replica's own state.
    local_states = (strategy.experimental_local_results(
        strategy.run(states.read)) if stateful else None)

    def replica_part(ctx):
      # Replica ids run worker by worker, so a replica's local index is its
      # id modulo the local count; each replica hands in the rows it wrote.
      local = ctx.replica_id_in_sync_group % local_replicas
      part = tf.concat([stacked[local],
                        extra[int(ctx.replica_id_in_sync_group == 0)]],
                       axis=0)
      if not stateful:
        return part
      return tf.concat([tf.reshape(part, [-1]), local_states[local]], 0)
    sums = strategy.reduce(
        _SUM, strategy.experimental_distribute_values_from_function(
            replica_part), axis=None)
    state_sums = tf.zeros([0], tf.float32)
    if stateful:
      state_sums = sums[-states.width:]
      sums = tf.reshape(sums[:-states.width], [-1, width])
    votes = tf.stack([sums[-1, 0] if exchange_votes else vote[0],
                      sums[-1, 1]])
    return means(sums[:-1], names), votes, state_sums

  return train_loop
