"""Model registry: name -> plain function(num_classes, image_size) -> keras.Model.

Every model returns logits (no softmax), so the loss is computed stably in
float32 by the train step. `create_model` applies what is common to all of
them: the Keras dtype policy (mixed precision) and synchronized BatchNorm.
"""
import contextlib

import keras


def small_cnn(num_classes: int, image_size: int) -> keras.Model:
  """A tiny conv net with no BatchNormalization and no dropout.

  Its result does not depend on how a batch is split across replicas, which
  makes it the model for parity tests.
  """
  layers = keras.layers
  return keras.Sequential([
      keras.Input((image_size, image_size, 3)),
      layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
      layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
      layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
      layers.GlobalAveragePooling2D(),
      # float32 logits: under a mixed policy the softmax stays accurate.
      layers.Dense(num_classes, dtype="float32"),
  ], name="small_cnn")


def mobilenet_v2(num_classes: int, image_size: int) -> keras.Model:
  """The seed's model: keras.applications.MobileNetV2, randomly initialised."""
  return keras.applications.MobileNetV2(
      input_shape=(image_size, image_size, 3), weights=None,
      classes=num_classes, classifier_activation=None)


MODELS = {"small_cnn": small_cnn, "mobilenet_v2": mobilenet_v2}


def create_model(name: str, num_classes: int, image_size: int, *,
                 mixed_precision: str = "none",
                 sync_batchnorm: bool = False) -> keras.Model:
  """Builds a registered model; the caller has checked `name` is in MODELS.

  Args:
    name: a key of MODELS.
    num_classes: logits per example.
    image_size: square input side.
    mixed_precision: "none" or a Keras dtype policy name
      ("mixed_float16", "mixed_bfloat16"): float16/bfloat16 compute with
      float32 variables.
    sync_batchnorm: every BatchNormalization layer normalises with the
      statistics of the global batch (an all-reduce per layer), so the result
      does not depend on how the batch is split across replicas.
  """
  with _dtype_policy(mixed_precision):
    model = MODELS[name](num_classes, image_size)
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    if isinstance(layer, keras.layers.BatchNormalization):
      # Read at call time (BatchNormalization._moments), so setting it on
      # the built layers of keras.applications models is enough.
      layer.synchronized = sync_batchnorm
  return model


@contextlib.contextmanager
def _dtype_policy(mixed_precision: str):
  """The global Keras policy for the layers built inside; restored after.

  keras.applications models take no dtype argument, so the global policy is
  the only way in; restoring it keeps other models in the process float32.
  """
  before = keras.config.dtype_policy()
  keras.config.set_dtype_policy(
      "float32" if mixed_precision == "none" else mixed_precision)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(before)
