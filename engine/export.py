"""The trained model for users: Keras native format and a SavedModel to serve.

Both load without this package: `keras.saving.load_model(".../model.keras")`
(the models are built from stock Keras layers) and
`tf.saved_model.load(".../saved_model")`, whose `serving_default` signature
takes float32 `images` [N, S, S, 3] in [0, 1] and returns `logits` and
`probabilities`.
"""
import os

from absl import logging
import keras
import tensorflow as tf

KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"


def export(model: keras.Model, export_dir: str, image_size: int) -> None:
  """Writes export_dir/model.keras and export_dir/saved_model.

  Every worker calls this (non-chief workers into a temporary directory), as
  TensorFlow asks of saving under MultiWorkerMirroredStrategy: one code path.
  """
  os.makedirs(export_dir, exist_ok=True)
  model.save(os.path.join(export_dir, KERAS_FILE))
  archive = keras.export.ExportArchive()
  archive.track(model)

  def serve(images):
    logits = tf.cast(model(images, training=False), tf.float32)
    return {"logits": logits, "probabilities": tf.nn.softmax(logits)}

  archive.add_endpoint(
      "serving_default", serve, input_signature=[tf.TensorSpec(
          [None, image_size, image_size, 3], tf.float32, name="images")])
  archive.write_out(os.path.join(export_dir, SAVED_MODEL_DIR), verbose=False)
  logging.info("Exported %s and %s/ to %s.", KERAS_FILE, SAVED_MODEL_DIR,
               export_dir)
