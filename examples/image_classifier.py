"""Your own image classifier on the engine: a Keras model with weight decay
(a kernel regularizer) and focal cross-entropy, on a folder of images.

    python examples/image_classifier.py --image_dir=/data/pets \
        --cpu_devices=2 --train_steps=300 --model_dir=/tmp/pets
    python -m engine.launch --num_workers=2 --script=examples/image_classifier.py \
        -- --image_dir=/data/pets --train_steps=300 --model_dir=/tmp/pets

--image_dir holds one sub-directory of JPEG/PNG files per class; the last
--eval_percent of each class's files (sorted) are held out for evaluation.
Every engine flag works here too (--helpfull lists them).
"""
import os

from absl import flags
import keras
import tensorflow as tf

import engine

flags.DEFINE_string("image_dir", None, "One sub-directory of images per class.")
flags.DEFINE_integer("image_size", 64, "Images are resized to this side.")
flags.DEFINE_float("weight_decay", 1e-4, "L2 penalty on the kernels.")
flags.DEFINE_float("focal_gamma", 2.0, "Focal loss focusing parameter.")
flags.DEFINE_integer("eval_percent", 20, "Files per class held out, in %.")
FLAGS = flags.FLAGS


def list_files(image_dir: str, eval_percent: int):
  """{"train": (paths, labels), "eval": (paths, labels)} and class names."""
  classes = sorted(d for d in os.listdir(image_dir)
                   if os.path.isdir(os.path.join(image_dir, d)))
  splits = {"train": ([], []), "eval": ([], [])}
  for label, name in enumerate(classes):
    files = sorted(os.listdir(os.path.join(image_dir, name)))
    cut = len(files) - len(files) * eval_percent // 100
    for k, f in enumerate(files):
      paths, labels = splits["train" if k < cut else "eval"]
      paths.append(os.path.join(image_dir, name, f))
      labels.append(label)
  return splits, classes


def build_model(num_classes: int, image_size: int, weight_decay: float):
  l2 = keras.regularizers.L2(weight_decay)
  inputs = keras.Input((image_size, image_size, 3), name="images")
  x = inputs
  for filters in (16, 32, 64):
    x = keras.layers.Conv2D(filters, 3, strides=2, padding="same",
                            activation="relu", kernel_regularizer=l2)(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  logits = keras.layers.Dense(num_classes, kernel_regularizer=l2)(x)
  return keras.Model(inputs, logits, name="folder_cnn")


def focal_cross_entropy(gamma: float):
  """Per-example focal loss (Lin et al. 2017) on logits and integer labels."""
  def loss(labels, logits):
    log_p = tf.nn.log_softmax(logits)
    log_pt = tf.gather(log_p, tf.cast(labels, tf.int32), batch_dims=1)
    return -((1.0 - tf.exp(log_pt)) ** gamma) * log_pt
  return loss


class FolderClassifier(engine.Task):
  """Images from a folder, resized; the engine batches and distributes them."""
  serving_input_name = "images"

  def __init__(self, image_dir, image_size, weight_decay, gamma,
               eval_percent):
    super().__init__(name="folder_classifier")
    self.splits, self.classes = list_files(image_dir, eval_percent)
    self.image_size, self.weight_decay = image_size, weight_decay
    self.loss = focal_cross_entropy(gamma)

  def build_model(self):
    return build_model(len(self.classes), self.image_size, self.weight_decay)

  def build_inputs(self, split, context):
    paths, labels = self.splits[split]
    if not paths:
      return None
    size = self.image_size

    def load(path, label):
      image = tf.io.decode_image(tf.io.read_file(path), channels=3,
                                 expand_animations=False)
      return tf.image.resize(image, [size, size]) / 255.0, label
    return tf.data.Dataset.from_tensor_slices((paths, labels)).map(
        load, num_parallel_calls=tf.data.AUTOTUNE)

  def per_example_loss(self, labels, outputs):
    return self.loss(labels, outputs)

  def build_metrics(self):
    return engine.classification.metrics(len(self.classes))

  def describe(self):
    return {"classes": self.classes, "image_size": self.image_size}

  def serving_outputs(self, outputs):
    return engine.classification.serving_outputs(outputs)


def make_task(config: engine.Config) -> engine.Task:
  del config  # the engine's flags; this task reads its own
  if not FLAGS.image_dir:
    raise engine.ConfigError("--image_dir is required: a folder with one "
                             "sub-directory of images per class.")
  return FolderClassifier(FLAGS.image_dir, FLAGS.image_size,
                          FLAGS.weight_decay, FLAGS.focal_gamma,
                          FLAGS.eval_percent)


if __name__ == "__main__":
  engine.cli.run(make_task)
