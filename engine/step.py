"""The train step and the compiled inner loop.

This is the one place where `strategy.run` and `tf.function` are applied, and
where gradients are all-reduced. The same code serves OneDevice, Mirrored and
MultiWorkerMirrored strategies: with one replica the all-reduce is an identity.
"""
from typing import Callable

import tensorflow as tf

from engine.config import Config
from engine.devices import communication_options

_SUM = tf.distribute.ReduceOp.SUM


def make_replica_step(model, optimizer, config: Config) -> Callable:
  """Returns the per-replica step: forward, backward, one all-reduce, update.

  The loss is the mean over the examples actually present in the global batch:
  each replica differentiates the *sum* of its per-example losses, and the
  summed gradient is divided by the global count of examples. That count is
  all-reduced in the same call as the gradients, so a partial last batch, or a
  replica that got no examples at all, gives exactly the single-device mean.
  """
  options = communication_options(config)
  variables = model.trainable_variables

  def replica_step(images, labels):
    with tf.GradientTape() as tape:
      logits = tf.cast(model(images, training=True), tf.float32)
      per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits)
      local_loss_sum = tf.reduce_sum(per_example)
    grads = tape.gradient(local_loss_sum, variables)
    local_count = tf.cast(tf.shape(labels)[0], tf.float32)
    # The gradient all-reduce, exactly once per step: the optimizer from
    # engine/optimizers.py applies what it is given and does not reduce again.
    ctx = tf.distribute.get_replica_context()
    grads, global_count = ctx.all_reduce(_SUM, (grads, local_count),
                                         options=options)
    scale = 1.0 / tf.maximum(global_count, 1.0)
    grads = [g * scale for g in grads]
    optimizer.apply(grads, variables)
    correct = tf.reduce_sum(tf.cast(
        tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels),
        tf.float32))
    # Every replica holds the same reduced gradient, so its norm divided by
    # the replica count sums back to the norm in the SUM reduce below.
    norm_share = tf.linalg.global_norm(grads) / ctx.num_replicas_in_sync
    return tf.stack([local_loss_sum, correct, local_count, norm_share])

  return replica_step


def make_train_loop(strategy: tf.distribute.Strategy,
                    replica_step: Callable) -> Callable:
  """Compiles `num_steps` steps into one host call.

  Returns:
    train_loop(iterator, num_steps) -> float32 [num_steps, 4] holding, per step,
    the global (loss, accuracy, examples, gradient norm). `num_steps` is a tensor and the loop
    is a `tf.range`, so any step count reuses one trace.
  """
  @tf.function
  def train_loop(iterator, num_steps):
    history = tf.TensorArray(tf.float32, size=num_steps)
    for i in tf.range(num_steps):
      # One step at a time: overlapping iterations would let the replicas'
      # collectives of two steps interleave and stall each other.
      tf.autograph.experimental.set_loop_options(parallel_iterations=1)
      images, labels = next(iterator)
      per_replica = strategy.run(replica_step, args=(images, labels))
      # Loss and metric sums over all replicas; one tiny reduce per step.
      loss_sum, correct, count, grad_norm = tf.unstack(
          strategy.reduce(_SUM, per_replica, axis=None))
      history = history.write(i, tf.stack([
          loss_sum / tf.maximum(count, 1.0), correct / tf.maximum(count, 1.0),
          count, grad_norm]))
    return history.stack()

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
