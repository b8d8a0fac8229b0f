"""--init_weights and --freeze: what is loaded, what stays, what is refused."""
import os
import re

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import forkserver
from conftest import ROOT, engine_cmd, run_job, tiny_config
import engine
from engine import models
from engine.core import init_weights
from engine.errors import ConfigError
from engine.tasks import image_classification

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
EVAL = dict(eval_split="train[:32]", synthetic_examples=64)


def _error_line(proc):
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  return lines[0]


def test_init_from_a_runs_export_or_checkpoint_continues_its_eval_loss(
    tmp_path):
  first = run_job(tiny_config(model_dir=str(tmp_path / "a"), export=True,
                              learning_rate=0.03, train_steps=4, **EVAL))
  last_eval = first.summary["eval_loss"]
  for source in (tmp_path / "a" / "export" / "model.keras", tmp_path / "a"):
    # One step with a negligible learning rate: the first evaluation sees
    # the loaded weights.
    then = run_job(tiny_config(
        model_dir=str(tmp_path / f"b_{source.name}"), init_weights=str(source),
        optimizer="sgd", learning_rate=1e-9, train_steps=1, eval_every=1,
        cpu_devices=2, **EVAL))  # loaded into mirrored variables
    assert then.summary["eval_loss"] == pytest.approx(last_eval, rel=1e-6)
  fresh = run_job(tiny_config(model_dir=str(tmp_path / "c"),
                              optimizer="sgd", learning_rate=1e-9,
                              train_steps=1, eval_every=1, **EVAL))
  assert abs(fresh.summary["eval_loss"] - last_eval) > 1e-3


def _bn_task():
  """Conv + BN twice; the first pair (`frozen_*`) is frozen by the test."""
  def model():
    layers = keras.layers
    return keras.Sequential([
        keras.Input((8, 8, 3)),
        layers.Conv2D(4, 3, name="frozen_conv"),
        layers.BatchNormalization(name="frozen_bn"),
        layers.Conv2D(4, 3, name="conv"),
        layers.BatchNormalization(name="bn"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(3, name="head")])

  def inputs(split, context):
    del split, context
    rng = np.random.default_rng(0)
    return tf.data.Dataset.from_tensor_slices(
        (rng.normal(2.0, 1.0, (48, 8, 8, 3)).astype(np.float32),
         rng.integers(0, 3, 48).astype(np.int32)))

  return engine.Task(model=model, inputs=inputs,
                     loss=keras.losses.SparseCategoricalCrossentropy(
                         from_logits=True, reduction=None))


def test_frozen_layers_keep_weights_and_batchnorm_statistics(tmp_path):
  start = _bn_task().build_model()
  start.set_weights([np.random.default_rng(i).normal(size=w.shape)
                     .astype(np.float32) * 0.3 + (1.0 if "variance" in w.path
                                                 else 0.0)
                     for i, w in enumerate(start.weights)])
  path = str(tmp_path / "start.weights.h5")
  start.save_weights(path)
  before = {w.path.split("/", 1)[1]: w.numpy() for w in start.weights}
  result = engine.run(_bn_task(), engine.Config.create(
      init_weights=path, freeze="^frozen_", cpu_devices=2,
      batch_size_per_replica=8, train_steps=4, steps_per_loop=2,
      optimizer="sgd", learning_rate=0.1, export=False,
      model_dir=str(tmp_path / "run")))
  after = {w.path.split("/", 1)[1]: w.numpy() for w in result.model.weights}
  assert len(result.model.trainable_weights) == 6  # conv, bn, head
  for name, value in after.items():
    if name.startswith("frozen_"):
      np.testing.assert_array_equal(value, before[name], err_msg=name)
    elif name != "conv/bias":  # trained or moving statistics updated;
      # a bias right before a BatchNormalization has no gradient.
      assert np.abs(value - before[name]).max() > 1e-4, name


def test_one_mismatching_shape_is_one_line_naming_the_variable(tmp_path):
  """Found by the run, before training: one ConfigError line (the command
  line prints it as that line, exit 2, as for the bad paths below;
  in-process here, without a TensorFlow start)."""
  model = models.create_model("small_cnn", 3, 32)  # the run has 4 classes
  path = str(tmp_path / "three.weights.h5")
  model.save_weights(path)
  with pytest.raises(ConfigError) as caught:
    run_job(tiny_config(num_classes=4, synthetic_examples=64,
                        batch_size_per_replica=8, train_steps=2,
                        model_dir=str(tmp_path / "run"), init_weights=path))
  line = f"error: {caught.value}"
  # (Keras numbers a layer's name when this process already made one of
  # that name: dense_2 here, dense in a fresh command line.)
  assert "\n" not in line and re.match(
      re.escape(f"error: --init_weights={path}: variable ") +
      r"small_cnn/dense(_\d+)?/kernel has shape \[32, 3\] in the file but "
      r"\[32, 4\] in the model", line), line
  assert not os.path.exists(tmp_path / "run" / "checkpoints" / "checkpoint")


@pytest.mark.parametrize("flag,message", [
    ("--init_weights=/nonexistent/w.weights.h5", "does not exist"),
    ("--freeze=(", "is not a regular expression"),
])
def test_bad_paths_and_regexes_fail_before_tensorflow(flag, message):
  proc = forkserver.run(engine_cmd(flag), cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=60,
                        check=False)
  line = _error_line(proc)
  assert line.startswith(f"error: {flag}:") and message in line


def test_freeze_matching_no_layer_or_unreadable_file_is_refused(tmp_path):
  with pytest.raises(ConfigError, match=r"^--freeze=\^nothing: matches no "
                     "layer of model small_cnn"):
    run_job(tiny_config(freeze="^nothing", model_dir=str(tmp_path / "a")))
  junk = tmp_path / "junk.weights.h5"
  junk.write_bytes(b"not hdf5")
  with pytest.raises(ConfigError, match=r"junk.weights.h5: cannot be read"):
    run_job(tiny_config(init_weights=str(junk),
                        model_dir=str(tmp_path / "b")))
  other = keras.Sequential([keras.Input((3,)),
                            keras.layers.LayerNormalization()])
  other.save_weights(str(tmp_path / "other.weights.h5"))
  with pytest.raises(ConfigError, match="no variable of the model matches"):
    run_job(tiny_config(init_weights=str(tmp_path / "other.weights.h5"),
                        model_dir=str(tmp_path / "c")))


def _write_legacy_imagenet_file(path):
  """A random MobileNetV2 without top in the layout of Keras's ImageNet
  files (Keras 2 `save_weights` to .h5): one group per layer name, weight
  names as Keras 2 spelled them."""
  model = keras.applications.MobileNetV2(
      input_shape=(32, 32, 3), include_top=False, weights=None)
  values = {}
  with h5py.File(path, "w") as f:
    f.attrs["layer_names"] = [l.name.encode() for l in model.layers]
    f.attrs["backend"], f.attrs["keras_version"] = b"tensorflow", b"2.2.4"
    for layer in model.layers:
      group = f.create_group(layer.name)
      weights = layer.trainable_weights + layer.non_trainable_weights
      names = []
      for w in weights:
        kind = ("depthwise_kernel" if "depthwise" in layer.name and
                w.name == "kernel" else w.name)
        names.append(f"{layer.name}/{kind}:0".encode())
        group.create_dataset(names[-1].decode(), data=w.numpy())
        values[f"{layer.name}/{w.name}"] = w.numpy()
      group.attrs["weight_names"] = names
  return values


def test_mobilenet_v2_takes_keras_imagenet_file_and_signed_inputs(tmp_path):
  path = str(tmp_path / "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_"
             "1.0_224_no_top.h5")
  values = _write_legacy_imagenet_file(path)
  config, image = image_classification.configs(
      model="mobilenet_v2", image_size=32, synthetic_examples=16,
      init_weights=path)
  task = image_classification.ImageClassification(
      image, seed=config.randomness.seed,
      init_weights=config.initialization.init_weights)
  model = task.build_model()
  loaded = init_weights.load(model, path)
  assert len(loaded["matched"]) == len(values) == 260
  assert sorted(loaded["missing"]) == ["predictions/bias",
                                       "predictions/kernel"]
  for w in model.weights:
    if not w.path.endswith(("predictions/kernel", "predictions/bias")):
      np.testing.assert_array_equal(w.numpy(), values[w.path])
  # What those weights expect: inputs in [-1, 1], not [0, 1].
  assert task.describe()["input_range"] == [-1, 1]
  task.build_inputs("train", tf.distribute.InputContext())
  images, _ = task.preprocess_batch(tf.range(16, dtype=tf.int64), None, True)
  assert images.numpy().min() < -0.5 and images.numpy().max() <= 1.0
  plain = image_classification.ImageClassification(image)
  assert plain.describe()["input_range"] == [0, 1]
