"""The train step and the compiled inner loop.

This is the one place where `strategy.run` and `tf.function` are applied, and
where gradients are all-reduced. The same code serves OneDevice, Mirrored and
MultiWorkerMirrored strategies: with one replica the all-reduce is an identity.
"""
from typing import Callable, Optional

import tensorflow as tf

from engine.config import Config
from engine.devices import communication_options
from engine.optimizers import uses_loss_scaling

_SUM = tf.distribute.ReduceOp.SUM
# --grad_compression: the dtype gradients have on the wire (None: float32).
WIRE_DTYPES = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}


def make_replica_step(model, optimizer, config: Config) -> Callable:
  """Returns the per-replica step: forward, backward, one all-reduce, update.

  The loss is the mean over the examples actually present in the global batch:
  each replica differentiates the *sum* of its per-example losses, and the
  summed gradient is divided by the global count of examples. That count is
  all-reduced with the gradients, so a partial last batch, or a replica that
  got no examples at all, gives exactly the single-device mean.

  With `--grad_accum_steps=K` each replica's batch holds K micro-batches of
  `--batch_size_per_replica`; their gradient sums are added up locally and
  all-reduced once, so the step equals one step on the K times larger batch.
  """
  options = communication_options(config)
  variables = model.trainable_variables
  loss_scaled = uses_loss_scaling(config)
  wire_dtype = WIRE_DTYPES[config.grad_compression]

  def replica_step(images, labels):
    ctx = tf.distribute.get_replica_context()
    # Read before the update, which may change it (float16 loss scaling).
    scale = (tf.identity(optimizer.dynamic_scale.value) if loss_scaled
             else tf.constant(1.0))
    forward_backward = _forward_backward_fn(model, variables, config)
    local_count = tf.cast(tf.shape(labels)[0], tf.float32)
    # With compression the count needs an all-reduce of its own (see
    # _mean_gradients). It depends only on the batch's shape, so it is issued
    # here, before the forward pass, and its latency hides behind the compute.
    early_count = (ctx.all_reduce(_SUM, local_count, options=options)
                   if wire_dtype is not None else None)
    grads, local_loss_sum, correct = _accumulate(
        forward_backward, variables, images, labels, scale, config)
    nominal_count = float(config.batch_size_per_replica *
                          config.grad_accum_steps * ctx.num_replicas_in_sync)
    grads = _mean_gradients(ctx, grads, local_count, early_count, options,
                            wire_dtype, nominal_count)
    # Applies what it is given (engine/optimizers.py): no second reduction.
    # Under loss scaling it unscales, and skips a step whose reduced
    # gradient is not finite, on every replica alike.
    optimizer.apply(grads, variables)
    # Every replica holds the same reduced gradient, so its norm divided by
    # the replica count sums back to the norm in the SUM reduce of the loop.
    norm_share = (tf.linalg.global_norm(grads) / scale /
                  ctx.num_replicas_in_sync)
    if loss_scaled:  # a skipped overflow step applied nothing
      norm_share = tf.where(tf.math.is_finite(norm_share), norm_share, 0.0)
    return tf.stack([local_loss_sum, correct, local_count, norm_share])

  return replica_step


def _mean_gradients(ctx, grads, local_count, global_count, options,
                    wire_dtype: Optional[tf.DType], nominal_count: float):
  """The gradient all-reduce, exactly once per step, divided by the count.

  The optimizer (engine/optimizers.py) applies what it is given and does not
  reduce again. Without compression the example count rides in the same
  all-reduce as the gradients. With compression the gradients travel as
  float16/bfloat16, pre-divided by the nominal global batch so that their
  sum is about the mean gradient and cannot overflow float16; one multiply
  after the cast back turns that into the mean over the real examples. The
  count (`global_count`, reduced by the caller) stays float32, exact, in a
  4-byte all-reduce of its own: TF concatenates each pack into one tensor,
  which needs one dtype.
  """
  if wire_dtype is None:
    grads, global_count = ctx.all_reduce(_SUM, (grads, local_count),
                                         options=options)
    inverse = 1.0 / tf.maximum(global_count, 1.0)
    return [g * inverse for g in grads]
  wire = [tf.cast(g * (1.0 / nominal_count), wire_dtype) for g in grads]
  wire = ctx.all_reduce(_SUM, wire, options=options)
  factor = nominal_count / tf.maximum(global_count, 1.0)
  return [tf.cast(g, tf.float32) * factor for g in wire]


def _forward_backward_fn(model, variables, config: Config) -> Callable:
  """Gradients of one (micro-)batch's summed loss times the loss scale.

  With `--jit_compile` this part, not the whole step, is compiled by XLA:
  on CPU, XLA has no kernels for the collective all-reduce or the input
  iterator, so the all-reduce and the update stay outside it. Built once
  per replica, so that each replica's trace captures its own variables.
  """
  def forward_backward(images, labels, scale):
    with tf.GradientTape() as tape:
      logits = tf.cast(model(images, training=True), tf.float32)
      per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits)
      loss_sum = tf.reduce_sum(per_example)
      scaled = loss_sum * scale  # 1.0 unless float16 loss scaling
    grads = tape.gradient(scaled, variables)
    correct = tf.reduce_sum(tf.cast(
        tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels),
        tf.float32))
    return grads, loss_sum, correct

  if config.jit_compile:
    return tf.function(forward_backward, jit_compile=True)
  return forward_backward


def _accumulate(forward_backward, variables, images, labels, scale,
                config: Config):
  """Sums gradients, loss and correct counts over the K micro-batches."""
  k, micro = config.grad_accum_steps, config.batch_size_per_replica
  if k == 1:
    return forward_backward(images, labels, scale)

  def one(i, totals):
    part = (images[i * micro:(i + 1) * micro],
            labels[i * micro:(i + 1) * micro])
    if config.sync_batchnorm:  # every replica must join the BN all-reduces
      out = forward_backward(*part, scale)
    else:  # an empty micro-batch (partial batch) would give NaN BN moments
      out = tf.cond(tf.size(part[1]) > 0,
                    lambda: forward_backward(*part, scale),
                    lambda: tf.nest.map_structure(tf.zeros_like, totals))
    return tf.nest.map_structure(tf.add, totals, out)

  totals = ([tf.zeros_like(v) for v in variables], tf.constant(0.0),
            tf.constant(0.0))
  if config.sync_batchnorm:
    # Unrolled: a collective inside a while loop's body would need merge_call
    # in a nested graph, which tf.distribute does not support.
    for i in range(k):
      totals = one(i, totals)
    return totals
  return tf.while_loop(lambda i, _: i < k, lambda i, t: (i + 1, one(i, t)),
                       (tf.constant(0), totals))[1]


def make_train_loop(strategy: tf.distribute.Strategy,
                    replica_step: Callable) -> Callable:
  """Compiles `num_steps` steps into one host call.

  Each step's only collective is the gradient all-reduce in the replica step.
  The per-step metric sums stay on their replicas during the call and are
  summed across all replicas and workers once at its end, in one all-reduce
  of a [num_steps, 4] tensor: a collective per step costs a fixed transport
  overhead and one more point where every worker waits for the slowest.

  Returns:
    train_loop(iterator, num_steps) -> float32 [num_steps, 4] holding, per step,
    the global (loss, accuracy, examples, gradient norm). `num_steps` is a tensor and the loop
    is a `tf.range`, so any step count reuses one trace.
  """
  local_replicas = len(strategy.extended.worker_devices)

  @tf.function
  def train_loop(iterator, num_steps):
    # One array per replica of this worker, written by that replica's step.
    rows = [tf.TensorArray(tf.float32, size=num_steps)
            for _ in range(local_replicas)]
    for i in tf.range(num_steps):
      # One step at a time: overlapping iterations would let the replicas'
      # collectives of two steps interleave and stall each other.
      tf.autograph.experimental.set_loop_options(parallel_iterations=1)
      images, labels = next(iterator)
      per_replica = strategy.run(replica_step, args=(images, labels))
      rows = [r.write(i, v) for r, v in
              zip(rows, strategy.experimental_local_results(per_replica))]
    stacked = [r.stack() for r in rows]
    # Replica ids run worker by worker, so a replica's local index is its id
    # modulo the local count; each replica hands in the rows it wrote.
    per_replica_rows = strategy.experimental_distribute_values_from_function(
        lambda ctx: stacked[ctx.replica_id_in_sync_group % local_replicas])
    sums = strategy.reduce(_SUM, per_replica_rows, axis=None)
    loss_sum, correct, count, grad_norm = tf.unstack(sums, axis=1)
    denominator = tf.maximum(count, 1.0)
    return tf.stack([loss_sum / denominator, correct / denominator, count,
                     grad_norm], axis=1)

  return train_loop


def make_stop_exchange(strategy: tf.distribute.Strategy,
                       config: Config) -> Callable:
  """Compiles the per-host-call exchange of the "stop requested" flag.

  Separate from the train loop and called once per host call, never per step
  (see engine/preemption.py). Every replica contributes its host's flag to
  one SUM all-reduce, so the result is positive on every worker as soon as
  any worker asked to stop. (`ReduceOp` has no MAX; a sum > 0 is the same.)

  Returns:
    exchange(flag) -> float32 scalar: `flag` (0 or 1) summed over all replicas.
  """
  options = communication_options(config)

  def replica_flag(flag):
    # The identity places the replica's copy on its device; the collective
    # refuses a value that lives on no replica device.
    return tf.distribute.get_replica_context().all_reduce(
        _SUM, tf.identity(flag), options=options)

  @tf.function
  def exchange(flag):
    total = strategy.run(replica_flag, args=(flag,))
    return strategy.experimental_local_results(total)[0]

  return exchange
