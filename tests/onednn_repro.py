"""oneDNN's Conv2D on an empty batch, in plain TensorFlow (no engine code).

    TF_ENABLE_ONEDNN_OPTS=1 python tests/onednn_repro.py   # prints the fault
    TF_ENABLE_ONEDNN_OPTS=0 python tests/onednn_repro.py   # all correct

With TensorFlow's oneDNN rewrites on (TF 2.21's default on CPUs with
AVX-512), Conv2D with an empty batch returns a tensor of its INPUT's shape
((0, 32, 32, 3) for a 3 -> 16 channel convolution) instead of (0, 16, 16, 16).
The next layer then fails ("input depth must be evenly divisible by filter
depth: 3 vs 16") or, if the shapes happen to fit, computes on the wrong
shape. In tf.distribute a replica gets an empty batch whenever a partial
last batch has fewer examples than there are replicas: below, 37 examples
in batches of 8 on 4 replicas; the last batch of 5 leaves one replica none.

Prints one JSON line: {"onednn": ..., "onednn_active": ...,
"empty_conv_shape": [...], "mirrored_partial_batch": "ok" | the error};
exit code 0 when both are right, 1 otherwise.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf


def empty_conv_shape():
  x = tf.zeros((0, 32, 32, 3))
  return list(tf.nn.conv2d(x, tf.ones((3, 3, 3, 16)), 2, "SAME").shape)


def mirrored_partial_batch(replicas=4):
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(replicas)])
  rng = np.random.default_rng(0)
  images = rng.normal(size=(37, 32, 32, 3)).astype(np.float32)
  data = tf.data.Dataset.from_tensor_slices(images).batch(8)
  with strategy.scope():
    w1 = tf.Variable(rng.normal(size=(3, 3, 3, 16)).astype(np.float32))
    w2 = tf.Variable(rng.normal(size=(3, 3, 16, 32)).astype(np.float32))

  @tf.function
  def step(iterator):
    def replica(x):
      h = tf.nn.relu(tf.nn.conv2d(x, w1, 2, "SAME"))
      return tf.reduce_sum(tf.nn.conv2d(h, w2, 2, "SAME"))
    return strategy.run(replica, (next(iterator),))

  iterator = iter(strategy.experimental_distribute_dataset(data))
  try:
    for _ in range(5):  # the fifth batch is the partial one
      step(iterator)
  except tf.errors.InvalidArgumentError as e:
    lines = [l.strip() for l in e.message.splitlines() if "INVALID" in l]
    return (lines or [e.message.strip()])[0][:120]
  return "ok"


def main():
  # Before any op runs: the logical devices are set in mirrored_partial_batch.
  from tensorflow.python.util import _pywrap_util_port as port  # pylint: disable=g-import-not-at-top
  result = {"onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "(TF default)"),
            "onednn_active": bool(port.IsMklEnabled())}
  result["mirrored_partial_batch"] = mirrored_partial_batch()
  result["empty_conv_shape"] = empty_conv_shape()
  print(json.dumps(result))
  ok = (result["empty_conv_shape"] == [0, 16, 16, 16] and
        result["mirrored_partial_batch"] == "ok")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
