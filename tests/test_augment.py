"""--augment and --label_smoothing: seeded per (seed, step, position),
independent of the replica count, resumed exactly, training only; and the
whole recipe (schedule, AdamW, clipping, EMA, augmentation) resumed exactly."""
import numpy as np
import pytest
import tensorflow as tf

from conftest import eval_batches, run_job, tiny_config, train_batches
from engine.data import augment
from engine.errors import ConfigError
import test_multi_worker as mw

AUG = dict(augment="flip,crop", eval_split="train[:40]")


def _images(ds, n):
  return [batch[0].numpy() for batch in ds.take(n)]


def test_training_batches_are_a_function_of_seed_and_step():
  j = tiny_config(**AUG)
  first, _ = train_batches(j, 16)
  again, _ = train_batches(j, 16)
  resumed, _ = train_batches(j, 16, start_step=2)
  a, b, r = _images(first, 4), _images(again, 4), _images(resumed, 2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(a[2], r[0])
  np.testing.assert_array_equal(a[3], r[1])
  plain, _ = train_batches(tiny_config(eval_split="train[:40]"), 16)
  for x, y in zip(a, _images(plain, 4)):
    assert np.abs(x - y).max() > 0.1  # augmentation changed the images
  # Evaluation is never augmented.
  aug_eval, n = eval_batches(j, 16)
  plain_eval, m = eval_batches(tiny_config(eval_split="train[:40]"), 16)
  assert n == m == 40
  for x, y in zip(aug_eval, plain_eval):
    np.testing.assert_array_equal(x[0].numpy(), y[0].numpy())


def _aug(images, step, ops, positions=None):
  if positions is None:
    positions = tf.range(tf.shape(images)[0], dtype=tf.int64)
  return augment.augment(images, step, positions, 7, ops).numpy()


def test_flip_and_crop_change_pixels_as_documented():
  images = tf.random.stateless_uniform([64, 32, 32, 3], [1, 2]) + 0.5
  flipped = _aug(images, 3, ["flip"])
  mirror = images.numpy()[:, :, ::-1]
  is_flipped = [np.array_equal(f, m) for f, m in zip(flipped, mirror)]
  kept = [np.array_equal(f, i) for f, i in zip(flipped, images.numpy())]
  assert all(f or k for f, k in zip(is_flipped, kept))
  assert 16 < sum(is_flipped) < 48  # about half, per example
  again = _aug(images, 3, ["flip"])
  other_step = _aug(images, 4, ["flip"])
  np.testing.assert_array_equal(flipped, again)
  assert not np.array_equal(flipped, other_step)
  # 32 px: pad 4 with zeros, crop back; pixels copied exactly.
  cropped = _aug(images, 3, ["crop"])
  zeros = (cropped == 0).all(axis=-1)
  assert zeros.any() and zeros.mean() < 0.3
  inside = cropped[~zeros]
  assert np.isin(inside[:, 0], images.numpy()[..., 0]).all()
  assert not np.array_equal(cropped, _aug(images, 4, ["crop"]))
  # Larger images: a random resized crop, no padding.
  big = tf.image.resize(images[:4], [96, 96])
  crop = _aug(big, 3, ["crop"])
  assert crop.shape == (4, 96, 96, 3) and crop.min() > 0.4
  assert np.abs(crop - big.numpy()).max() > 0.05


def test_a_rows_change_depends_on_its_position_not_on_the_split():
  """Pieces of a global batch, augmented apart with their positions, equal
  the whole batch augmented at once: what lets each worker augment only its
  rows. It rests on TensorFlow's stateless draws being prefix-consistent."""
  for dtype, kw in ((tf.float32, {}), (tf.int32, dict(minval=0, maxval=9))):
    long = tf.random.stateless_uniform([64], [3, 7], dtype=dtype, **kw)
    for n in (1, 5, 31, 63):
      np.testing.assert_array_equal(
          long[:n], tf.random.stateless_uniform([n], [3, 7], dtype=dtype, **kw))
  images = tf.random.stateless_uniform([13, 32, 32, 3], [1, 2])
  small = tf.image.resize(images, [72, 72])  # the resized crop too
  for batch in (images, small):
    whole = _aug(batch, 5, ["flip", "crop"])
    for cut in ([0, 7, 13], [0, 4, 8, 11, 13], [0, 13, 13]):
      pieces = [_aug(batch[a:b], 5, ["flip", "crop"],
                     tf.range(a, b, dtype=tf.int64))
                for a, b in zip(cut[:-1], cut[1:])]
      np.testing.assert_array_equal(np.concatenate(pieces), whole)


def test_one_and_two_replicas_agree_with_augmentation(tmp_path):
  kw = dict(optimizer="sgd", learning_rate=0.05, train_steps=4,
            synthetic_examples=64, label_smoothing=0.1, **AUG)
  one = run_job(tiny_config(cpu_devices=1, batch_size_per_replica=16,
                            model_dir=str(tmp_path / "one"), **kw))
  two = run_job(tiny_config(cpu_devices=2, batch_size_per_replica=8,
                            model_dir=str(tmp_path / "two"), **kw))
  assert one.summary["augment"] == ["flip", "crop"]
  assert one.summary["label_smoothing"] == 0.1
  for a, b in zip(one.weights, two.weights):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_resume_with_the_whole_recipe_is_exact(tmp_path):
  """Issue 18's resume test: warmup + cosine, AdamW with weight decay,
  clipping, label smoothing, EMA and augmentation all on; stopped mid-epoch
  and resumed, it ends where the uninterrupted run ends (weights, the
  per-step losses and rates, and the averages).

  40 examples, global batch 16: 3 steps per epoch, an evaluation at each
  epoch's end. Host calls end at steps 1, 3, 5, 6, 8; the run resumes from
  the uninterrupted run's checkpoint of step 5, mid-epoch: the state a run
  stopped there saves (tests/test_multi_worker.py's
  `start_from_checkpoint`; a SIGTERM's save and its resume are
  tests/test_checkpoint.py's and test_preemption.py's)."""
  kw = dict(cpu_devices=2, optimizer="adamw", learning_rate=0.01,
            weight_decay=0.05, lr_schedule="cosine", warmup_steps=2,
            clip_global_norm=1.0, label_smoothing=0.1, ema_decay=0.9,
            synthetic_examples=40, steps_per_loop=2, **AUG)
  whole = run_job(tiny_config(train_steps=8, checkpoint_every=5,
                              model_dir=str(tmp_path / "whole"), **kw))
  mw.start_from_checkpoint(tmp_path / "whole", tmp_path / "parts", 5)
  part_dir = str(tmp_path / "parts")
  rest = run_job(tiny_config(train_steps=8, model_dir=part_dir, **kw))
  assert rest.summary["start_step"] == 5
  np.testing.assert_allclose(rest.losses, whole.losses[5:], rtol=0,
                             atol=1e-6)
  np.testing.assert_allclose(rest.history["learning_rate"],
                             whole.history["learning_rate"][5:], rtol=1e-7)
  assert whole.history["learning_rate"][0] == 0.0  # warmup starts at 0
  for a, b in zip(rest.weights + rest.averages,
                  whole.weights + whole.averages):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  # The averages are not the weights (else the EMA check would be empty).
  assert max(np.abs(a - w).max() for a, w in
             zip(whole.averages, whole.weights)) > 1e-4


def test_label_smoothing_is_the_task_loss():
  task = tiny_config(label_smoothing=0.2, num_classes=4).task()
  logits = tf.constant([[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 3.0]])
  labels = tf.constant([0, 1])
  target = np.full((2, 4), 0.2 / 4) + 0.8 * np.eye(4)[[0, 1]]
  log_p = tf.nn.log_softmax(logits).numpy()
  np.testing.assert_allclose(task.per_example_loss(labels, logits),
                             -(target * log_p).sum(axis=1), rtol=1e-6)


def test_bad_flags_are_one_line():
  with pytest.raises(ConfigError, match=r"^--label_smoothing=1.0: must be in "
                     r"\[0, 1\)"):
    tiny_config(label_smoothing=1.0)
  with pytest.raises(ConfigError, match="^--augment=flip,flip: names an op"):
    tiny_config(augment="flip,flip")
  # The command line prints a ConfigError as this one line, exit 2
  # (engine/cli.py; its runs are in test_cli.py and test_api.py), so it is
  # checked here in-process, without a TensorFlow import of its own.
  with pytest.raises(ConfigError) as caught:
    tiny_config(augment="flip,rotate")
  assert f"error: {caught.value}" == (
      "error: --augment=flip,rotate: 'rotate' is unknown; a comma list of "
      "flip, crop, each once.")
