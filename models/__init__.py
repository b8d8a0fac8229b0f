"""Model registry: name -> plain function(num_classes, image_size) -> keras.Model.

Every model returns logits (no softmax), so the loss is computed stably in
float32 by the train step. The built-in image task
(engine/tasks/image_classification.py) picks one by `--model`. Keras is
imported when a model is built, so that the registry's names are known
without loading TensorFlow (a bad --model is refused at once).
"""


def small_cnn(num_classes: int, image_size: int):
  """A tiny conv net with no BatchNormalization and no dropout.

  Its result does not depend on how a batch is split across replicas, which
  makes it the model for parity tests.
  """
  import keras  # pylint: disable=g-import-not-at-top
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


def mobilenet_v2(num_classes: int, image_size: int):
  """The seed's model: keras.applications.MobileNetV2, randomly initialised."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.applications.MobileNetV2(
      input_shape=(image_size, image_size, 3), weights=None,
      classes=num_classes, classifier_activation=None)


MODELS = {"small_cnn": small_cnn, "mobilenet_v2": mobilenet_v2}


def create_model(name: str, num_classes: int, image_size: int):
  """Builds a registered model; the caller has checked `name` is in MODELS.

  The engine applies the dtype policy (--mixed_precision) around this call
  and synchronized BatchNorm (--sync_batchnorm) after it, for any model.
  """
  return MODELS[name](num_classes, image_size)
