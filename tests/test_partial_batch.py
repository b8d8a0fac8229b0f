"""Partial last batches: every step is the mean over the examples present.

37 examples in global batches of 8 give epochs of 8, 8, 8, 8, 5. With 4
replicas the batch of 5 splits 2, 1, 1, 1; on 2 workers it splits 3, 2. The
losses and weights must equal those of one device, and those of a plain,
undistributed loop that averages each batch over its real examples.
"""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import read_scalars, run_job, tiny_config, train_batches
from engine import models
from engine.data import tfds_data, to_tfds
from test_eval import keras_evaluate
from test_multi_worker import (check_two_worker_run, launch,
                               start_from_checkpoint, tiny_flags)

EXAMPLES, GLOBAL_BATCH, STEPS, LR = 37, 8, 10, 0.05
CLASSES = ("cat", "dog", "fox")


def config_for(replicas, tmp_path, **kw):
  return tiny_config(
      strategy="mirrored" if replicas else "one_device", cpu_devices=replicas,
      optimizer="sgd", learning_rate=LR, synthetic_examples=EXAMPLES,
      batch_size_per_replica=GLOBAL_BATCH // max(replicas, 1),
      train_steps=STEPS, steps_per_loop=4, model_dir=str(tmp_path), **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  # Its checkpoint of step 3 is where the 2-worker test resumes.
  model_dir = tmp_path_factory.mktemp("one_device")
  result = run_job(config_for(0, model_dir, eval_split="train",
                              checkpoint_every=3))
  result.model_dir = model_dir
  return result


def plain_loop(config):
  """The same steps with no tf.distribute: mean loss per batch, SGD."""
  keras.utils.set_random_seed(config.seed)
  model = models.create_model(config.model, config.num_classes,
                              config.image_size)
  dataset, _ = train_batches(config, GLOBAL_BATCH)
  losses, counts = [], []
  for images, labels in dataset.take(STEPS):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=model(images, training=True)))
    grads = tape.gradient(loss, model.trainable_variables)
    for v, g in zip(model.trainable_variables, grads):
      v.assign_sub(LR * g)
    losses.append(float(loss))
    counts.append(int(labels.shape[0]))
  weights = [v.numpy() for v in model.trainable_variables]
  return np.array(losses), counts, weights


def assert_same(losses, weights, ref, tol=1e-5):
  np.testing.assert_allclose(losses, ref.losses, rtol=tol, atol=tol)
  for got, want in zip(weights, ref.weights):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_one_device_is_the_mean_over_real_examples(reference, tmp_path):
  losses, counts, weights = plain_loop(config_for(0, tmp_path))
  assert counts == [8, 8, 8, 8, 5] * 2
  assert_same(losses, weights, reference)
  assert reference.summary["global_step"] == STEPS


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_replicas_match_one_device_with_partial_batches(reference, tmp_path,
                                                        replicas):
  """Mirrored, "auto" all-reduce, sgd: also test_parity's sgd cases with
  "auto" on 1 and 2 replicas (N replicas == 1, one reduction), which it does
  not run again."""
  result = run_job(config_for(replicas, tmp_path, eval_split="train"))
  assert result.summary["num_replicas"] == replicas
  assert_same(result.losses, result.weights, reference)
  np.testing.assert_allclose(result.summary["eval_loss"],
                             reference.summary["eval_loss"], rtol=1e-5)
  assert result.summary["eval_examples"] == EXAMPLES


def test_two_workers_match_one_device_with_partial_batches(reference,
                                                           tmp_path):
  """Also test_multi_worker's sgd/ring case of 2 workers matching one
  replica (with --strategy=multi_worker given to the launcher, accepted),
  with host calls of --steps_per_loop=auto (the chief's choice on both),
  each worker pinned to a core of its own (--cpu_pinning), where tf.data's
  threads once kept finished workers alive: the launcher must end within
  5 s of the last `Done:` line (engine/ending.py).

  The workers resume from the one-replica reference's checkpoint of step 3
  (no flag needed: the global batch is the same) and train steps 4-10, the
  partial batches of steps 5 and 10 among them, as the reference did.
  """
  # Eval over 33 examples: the last batch holds 1, so one worker has none.
  eval_split = "train[:33]"
  start_from_checkpoint(reference.model_dir, tmp_path / "mw", 3)
  out = launch(tiny_flags(
      optimizer="sgd", learning_rate=LR, synthetic_examples=EXAMPLES,
      batch_size_per_replica=GLOBAL_BATCH // 2, train_steps=STEPS,
      steps_per_loop="auto", model_dir=str(tmp_path / "mw"),
      cross_device_ops="ring", weights_out="weights.npz") + [
          f"--eval_split={eval_split}", "--eval_every=5",
          "--strategy=multi_worker", "--summary_every=1"], timeout=240,
      cpu_pinning=True)
  summary = check_two_worker_run(out, tmp_path / "mw", STEPS, GLOBAL_BATCH,
                                 entries=["eval"])
  assert summary["start_step"] == 3
  losses = read_scalars(tmp_path / "mw" / "train")["loss"]
  assert sorted(losses) == list(range(4, STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in range(4, STEPS + 1)],
                             reference.losses[3:], rtol=1e-5, atol=1e-5)
  assert out.done_to_exit is not None and out.done_to_exit < 5.0, (
      out.done_to_exit)
  assert summary["steps_per_loop_auto"] is True
  assert "AutoShardPolicy" not in out.stdout + out.stderr
  got = np.load(tmp_path / "mw" / "weights.npz")
  assert len(got.files) == len(reference.weights)
  for k, want in enumerate(reference.weights):
    np.testing.assert_allclose(got[f"arr_{k}"], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(summary["final_loss"], reference.losses[-1],
                             rtol=1e-5)
  # A wrong reduction would move weights by far more than the tolerance.
  diff = max(np.abs(got[f"arr_{k}"] - w).max()
             for k, w in enumerate(reference.weights))
  assert diff < 1e-5
  config = config_for(0, tmp_path / "k", eval_split=eval_split)
  loss, accuracy, count = keras_evaluate(config, reference.weights,
                                         GLOBAL_BATCH)
  assert summary["eval_examples"] == count == 33
  np.testing.assert_allclose(summary["eval_loss"], loss, rtol=1e-5)
  np.testing.assert_allclose(summary["eval_accuracy"], accuracy, atol=1e-5)
  evals = [l for l in (out.stdout + out.stderr).splitlines()
           if "eval at step" in l]
  # Steps 5 and 10, logged by the chief only (other workers log warnings).
  assert [l.split("eval at step ")[1].split()[0] for l in evals] == [
      "5", "10"] and all(l.startswith("[worker 0]") for l in evals), evals


def test_two_workers_file_sharded_eval_counts_every_example_once(tmp_path):
  """3 files on 2 workers: FILE sharding, so the workers get 8 and 4 eval
  examples, 2 batches and 1; the pass still ends together and counts 12."""
  root = to_tfds.write_sample_folder(str(tmp_path / "pets"), CLASSES, 16)
  to_tfds.write(f"folder:{root}", "pets_files", str(tmp_path / "tfds"),
               num_shards=3, eval_fraction=0.25)
  config = tiny_config(dataset="pets_files", data_dir=str(tmp_path / "tfds"),
                       eval_split="test", model_dir=str(tmp_path / "k"))
  file_policy = tf.data.experimental.AutoShardPolicy.FILE
  def policy(workers):
    return tfds_data.source(config.image, "test", "eval_split", seed=7,
                            training=False, num_workers=workers)[3]
  assert policy(2) == file_policy
  assert policy(4) != file_policy  # more workers than files: DATA
  out = launch(tiny_flags(
      train_steps=4, batch_size_per_replica=4, model_dir=str(tmp_path / "mw"),
      weights_out="weights.npz") + [
          "--dataset=pets_files", f"--data_dir={tmp_path / 'tfds'}",
          "--eval_split=test"], timeout=240)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  for warning in ("AutoShardPolicy", "assert_cardinality"):
    assert warning not in out.stdout + out.stderr
  summary = json.loads((tmp_path / "mw" / "summary.json").read_text())
  assert summary["class_names"] == list(CLASSES)
  got = np.load(tmp_path / "mw" / "weights.npz")
  loss, accuracy, count = keras_evaluate(
      config, [got[f"arr_{k}"] for k in range(len(got.files))], GLOBAL_BATCH,
      num_classes=len(CLASSES))
  assert summary["eval_examples"] == count == 12
  np.testing.assert_allclose(summary["eval_loss"], loss, rtol=1e-5)
  np.testing.assert_allclose(summary["eval_accuracy"], accuracy, atol=1e-5)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_gradients_are_the_mean_over_real_examples(
    reference, tmp_path, compression):
  """With compression the example count has an all-reduce of its own, issued
  before the forward pass; the batch of 5 on 4 replicas (2, 1, 1, 1) must
  still be divided by 5, not by the nominal 8."""
  result = run_job(config_for(4, tmp_path, grad_compression=compression))
  # Measured against float32: losses within 9e-6 (fp16) and 7e-5 (bf16),
  # weights within 1e-4 and 2e-4. Dividing by the nominal 8 instead gives
  # 3.0e-3 and 4.1e-3: both bounds below fail it.
  np.testing.assert_allclose(result.losses, reference.losses, atol=5e-4)
  for got, want in zip(result.weights, reference.weights):
    np.testing.assert_allclose(got, want, atol=1e-3)
