"""BatchNormalization on the fast kernels, with Keras's results.

Keras 3's `BatchNormalization` computes the batch moments and normalizes with
separate ops (a dozen per layer, forward and backward). In training on 4-D
inputs this module routes each layer to TensorFlow's fused kernel
(`FusedBatchNormV3`: one op forward, one backward; cuDNN's on GPUs), and,
with --sync_batchnorm, packs the three all-reduces Keras makes per layer
(sum, sum of squares, count) into one. Everything else -- inference, masks,
renorm, other ranks -- stays Keras's own `call`.

The replacement is per layer (`layer.call`), after the model is built: no
Keras code is copied, the layer's class, config and saved file are unchanged,
and users' models get it exactly as the built-in ones do.
"""
import contextlib
import functools
import threading

import keras
import tensorflow as tf

# FusedBatchNormV3's data formats, by the channel axis of a 4-D input.
_FORMATS = {3: "NHWC", -1: "NHWC", 1: "NCHW"}
# Per thread: MirroredStrategy traces each replica's step in a thread of its
# own. `present` is set by `padding` while a padded batch is traced.
_TRACING = threading.local()


@contextlib.contextmanager
def padding(present: tf.Tensor):
  """While tracing a model call on a batch the step padded with one row.

  Args:
    present: float32 scalar, 1.0 if the replica's rows are real, 0.0 if its
      batch was empty and the model sees one row of zeros instead
      (engine/core/step.py, `_padded_call`). Synchronized layers then add
      nothing to the global moments, as an empty batch would.
  """
  previous = getattr(_TRACING, "present", None)
  _TRACING.present = present
  try:
    yield
  finally:
    _TRACING.present = previous


def configure(model: keras.Model, synchronized: bool, fused: bool) -> int:
  """Sets every BatchNormalization of `model` for this run.

  Args:
    model: a built Keras model; nested layers included.
    synchronized: moments over the global batch (--sync_batchnorm).
    fused: use the fused kernel / packed all-reduce (--fused_batchnorm);
      False leaves Keras's layer as it is.

  Returns:
    How many BatchNormalization layers were found.
  """
  count = 0
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    if not isinstance(layer, keras.layers.BatchNormalization):
      continue
    count += 1
    # Read at call time (BatchNormalization._moments), so setting it on
    # built layers is enough.
    layer.synchronized = synchronized
    keras_call = type(layer).call.__get__(layer)
    # A subclass with its own `call` computes something else: left alone.
    ours = type(layer).call is keras.layers.BatchNormalization.call
    layer.call = (functools.partial(_fused_call, layer, keras_call)
                  if fused and ours else keras_call)
  return count


def _fused_call(layer, keras_call, inputs, training=None, mask=None):
  """`layer.call` with the fused kernel where it computes the same thing."""
  if not (training and layer.trainable) or mask is not None or layer.renorm:
    return keras_call(inputs, training=training, mask=mask)
  if layer.synchronized:
    # None in a cross-replica context, where Keras uses local moments.
    context = tf.distribute.get_replica_context()
    return (_synchronized(layer, inputs, context) if context is not None
            else keras_call(inputs, training=training, mask=mask))
  fmt = _FORMATS.get(layer.axis) if len(inputs.shape) == 4 else None
  if fmt is None:
    return keras_call(inputs, training=training, mask=mask)
  x = tf.cast(inputs, tf.float32)  # as Keras: statistics in float32
  channels = x.shape[layer.axis]
  ones, zeros = tf.ones([channels]), tf.zeros([channels])
  gamma = layer.gamma if layer.scale else ones
  beta = layer.beta if layer.center else zeros
  y, mean, corrected, _, _, _ = tf.raw_ops.FusedBatchNormV3(
      x=x, scale=tf.cast(gamma, tf.float32), offset=tf.cast(beta, tf.float32),
      mean=zeros, variance=zeros, epsilon=layer.epsilon, data_format=fmt,
      is_training=True)
  # The kernel returns the batch variance Bessel-corrected (n / (n - 1));
  # Keras's moving average, and the normalization itself, use the
  # population variance. n is the examples x pixels behind each channel.
  n = tf.cast(tf.size(x) // channels, tf.float32)
  variance = corrected * tf.math.divide_no_nan(n - 1.0, n)
  _update_moving(layer, mean, variance)
  return tf.cast(y, layer.compute_dtype)


def _synchronized(layer, inputs, context):
  """Keras's synchronized BatchNorm with one all-reduce instead of three."""
  x = tf.cast(inputs, tf.float32)
  axes = [i for i in range(len(x.shape)) if i != layer.axis % len(x.shape)]
  channels = x.shape[layer.axis]
  count = tf.cast(tf.size(x) // channels, tf.float32)
  local = tf.concat([tf.reduce_sum(x, axis=axes),
                     tf.reduce_sum(tf.square(x), axis=axes),
                     count[None]], axis=0)
  present = getattr(_TRACING, "present", None)
  if present is not None:  # a padded empty batch adds nothing (`padding`)
    local = local * present
  # One packed all-reduce per layer (its gradient is one more in the
  # backward pass); Keras's _compute_moments_sync makes three.
  total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
  mean = tf.math.divide_no_nan(total[:channels], total[-1])
  square = tf.math.divide_no_nan(total[channels:2 * channels], total[-1])
  # var = E(x^2) - E(x)^2, clipped at 0 as Keras does.
  variance = tf.maximum(square - tf.square(mean), 0.0)
  _update_moving(layer, mean, variance)
  shape = [1] * len(x.shape)
  shape[layer.axis] = channels
  gamma = tf.reshape(tf.cast(layer.gamma, tf.float32), shape) if layer.scale \
      else None
  beta = tf.reshape(tf.cast(layer.beta, tf.float32), shape) if layer.center \
      else None
  y = tf.nn.batch_normalization(
      x, tf.reshape(mean, shape), tf.reshape(variance, shape), beta, gamma,
      layer.epsilon)
  return tf.cast(y, layer.compute_dtype)


def _update_moving(layer, mean, variance):
  """Keras's moving-average update, from the population moments."""
  m = layer.momentum
  layer.moving_mean.assign(layer.moving_mean * m + mean * (1.0 - m))
  layer.moving_variance.assign(layer.moving_variance * m +
                               variance * (1.0 - m))
