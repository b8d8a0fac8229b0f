"""The trained model for users: Keras native format and a SavedModel to serve.

`keras.saving.load_model(".../model.keras")` loads the first where the
model's layers are stock Keras or registered (`keras.saving.
register_keras_serializable`); `tf.saved_model.load(".../saved_model")` loads
the second without any Python code of the model. Its `serving_default`
signature takes the features the model is trained on (one batch, as the
input pipeline makes them: a tensor named by the task's `serving_input_name`,
or a dict of named tensors), or what the task's `serving_features` says (raw
strings, say, that its preprocessing layer turns into features), and returns
what the task's `serving_outputs` says (the built-in image task: float32
`images` [N, S, S, 3] in [0, 1] in, `logits` and `probabilities` out; a
model with a dict of outputs: each of them).
"""
import os

from absl import logging
import keras
import tensorflow as tf

KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"


def serving_signature(task, features_spec):
  """The serving input: the features spec with a free batch dimension."""
  def free(spec: tf.TensorSpec, name: str) -> tf.TensorSpec:
    return tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype,
                         name=name)
  if isinstance(features_spec, dict):
    return {k: free(v, k) for k, v in features_spec.items()}
  return free(features_spec, getattr(task, "serving_input_name", "features"))


def export(model: keras.Model, export_dir: str, task, features_spec) -> None:
  """Writes export_dir/model.keras and export_dir/saved_model.

  Every worker calls this (non-chief workers into a temporary directory), as
  TensorFlow asks of saving under MultiWorkerMirroredStrategy: one code path.
  """
  os.makedirs(export_dir, exist_ok=True)
  model.save(os.path.join(export_dir, KERAS_FILE))
  archive = keras.export.ExportArchive()
  archive.track(model)
  raw = task.serving_features()
  preprocess = None
  if raw is not None:
    signature, preprocess = raw
    if isinstance(preprocess, (keras.layers.Layer, tf.Module)):
      archive.track(preprocess)  # its lookup tables and weights
  else:
    signature = serving_signature(task, features_spec)

  def serve(features):
    if preprocess is not None:
      features = preprocess(features)
    outputs = model(features, training=False)
    outputs = tf.nest.map_structure(
        lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t,
        outputs)
    return task.serving_outputs(outputs)

  archive.add_endpoint("serving_default", serve,
                       input_signature=[signature])
  archive.write_out(os.path.join(export_dir, SAVED_MODEL_DIR), verbose=False)
  logging.info("Exported %s and %s/ to %s.", KERAS_FILE, SAVED_MODEL_DIR,
               export_dir)
