"""AdamW, RMSprop, Lion, Nesterov SGD, weight decay and clipping, distributed.

Parity: each optimizer with decoupled weight decay, clipping by global norm
and a warmup + cosine schedule under gradient accumulation gives the weights
of one replica on 2 and 4 replicas (a second reduction, or clipping each
replica's own gradient, would not). On 2 workers through the launcher:
adamw with that recipe is tests/test_multi_worker.py's
test_two_workers_match_one_replica (its one launch also accumulates, packs
and profiles).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import engine
from engine.core.optimizers import create_optimizer

EXAMPLES, FEATURES, CLASSES = 64, 6, 3
GLOBAL_BATCH = 16


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
  y = np.argmax(x[:, :CLASSES] + 0.5 * x[:, CLASSES:], axis=1).astype(np.int32)
  return x, y


def build_model(norm: str = "layer") -> keras.Model:
  """Dense -> LayerNorm or BatchNorm -> relu -> Dense, with fixed weights.

  The weights are set from a seeded generator, so a reference computed here
  starts where the engine's run does.
  """
  inputs = keras.Input((FEATURES,))
  h = keras.layers.Dense(8, name="hidden")(inputs)
  h = (keras.layers.LayerNormalization(name="norm") if norm == "layer" else
       keras.layers.BatchNormalization(name="norm"))(h)
  h = keras.layers.Activation("relu")(h)
  model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(h))
  rng = np.random.default_rng(1)
  for v in model.trainable_variables:
    v.assign(rng.normal(size=v.shape, scale=0.7).astype(np.float32))
  return model


_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                   reduction=None)


def make_task(norm: str = "layer") -> engine.Task:
  x, y = _data()
  return engine.Task(
      model=lambda: build_model(norm),
      inputs=lambda split, _: (tf.data.Dataset.from_tensor_slices((x, y))
                               if split == "train" else None),
      loss=_LOSS, name=f"dense_{norm}")


def train(tmp_path, replicas, norm="layer", **fields):
  config = engine.Config.create(
      strategy="one_device" if replicas == 1 else "mirrored",
      cpu_devices=replicas, shuffle_buffer=0, steps_per_loop=4, seed=3,
      export=False, model_dir=str(tmp_path / f"{replicas}_{norm}"),
      **fields)
  return engine.run(make_task(norm), config)


RECIPE = dict(lr_schedule="cosine", warmup_steps=1, train_steps=4,
              grad_accum_steps=2, clip_global_norm=1.2)
OPTIMIZERS = {
    "adamw": dict(optimizer="adamw", learning_rate=0.02, weight_decay=0.5),
    "rmsprop": dict(optimizer="rmsprop", learning_rate=0.01, momentum=0.5,
                    weight_decay=0.5),
    "lion": dict(optimizer="lion", learning_rate=0.005, weight_decay=1.0),
    "sgd_nesterov": dict(optimizer="sgd", learning_rate=0.1, momentum=0.9,
                         nesterov=True, weight_decay=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_replicas_match_one_device(tmp_path, name):
  fields = dict(RECIPE, **OPTIMIZERS[name])
  # Global batch 16 = 2 micro-batches x replicas x per replica.
  results = {r: train(tmp_path, r, batch_size_per_replica=GLOBAL_BATCH // 2
                      // r, **fields) for r in (1, 2, 4)}
  ref = results[1]
  assert max(ref.history["grad_norm"]) > RECIPE["clip_global_norm"]
  assert ref.history["learning_rate"][0] == 0.0  # warmup from 0
  for r in (2, 4):
    got = results[r]
    assert got.summary["global_batch_size"] == GLOBAL_BATCH
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.history["learning_rate"],
                                  ref.history["learning_rate"])
    for a, b in zip(got.weights, ref.weights):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_default_exclusion_spares_biases_and_normalization(tmp_path):
  # The regex over paths decides, for every layer kind.
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    model = build_model("batch")
    for regex, decayed in [
        (engine.Config().optimization.weight_decay_exclude,
         ["hidden/kernel", "logits/kernel"]),
        ("^logits/", ["hidden/kernel", "hidden/bias", "norm/gamma",
                      "norm/beta"])]:
      optimizer = create_optimizer(engine.Config.create(
          optimizer="sgd", weight_decay=0.1,
          weight_decay_exclude=regex).optimization)
      optimizer.build(model.trainable_variables)
      uses = optimizer._use_weight_decay  # pylint: disable=protected-access
      assert [v.path for v in model.trainable_variables if uses(v)] == decayed
  # And training applies it: one SGD update with and without decay differ
  # by lr x decay x the initial weight exactly where decay applies.
  lr, decay = 0.1, 0.5
  kw = dict(optimizer="sgd", learning_rate=lr, train_steps=1,
            batch_size_per_replica=GLOBAL_BATCH)
  plain = train(tmp_path / "plain", 1, "batch", **kw)
  decayed = train(tmp_path / "decayed", 1, "batch", weight_decay=decay, **kw)
  initial = build_model("batch")
  for v, a, b in zip(initial.trainable_variables, decayed.weights,
                     plain.weights):
    if v.path.endswith("kernel"):
      np.testing.assert_allclose(a - b, -lr * decay * v.numpy(), rtol=1e-4,
                                 atol=1e-7)
      assert np.abs(a - b).max() > 1e-3
    else:
      np.testing.assert_array_equal(a, b)


def _reference(clip, steps, lr):
  """One device, the whole global batch: SGD on the mean gradient clipped by
  its global norm. Returns (weights, pre-clip norms)."""
  x, y = _data()
  model = build_model("layer")
  norms = []
  for s in range(steps):
    batch = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_LOSS(y[batch], model(x[batch], training=True)))
    grads = tape.gradient(loss, model.trainable_variables)
    if clip:
      grads, norm = tf.clip_by_global_norm(grads, clip)
    else:
      norm = tf.linalg.global_norm(grads)
    norms.append(float(norm))
    for v, g in zip(model.trainable_variables, grads):
      v.assign_sub(lr * g)
  return [v.numpy() for v in model.trainable_variables], norms


def test_clipping_engages_and_equals_clipping_the_whole_batch(tmp_path):
  lr, clip, steps = 0.5, 0.3, 3
  got = train(tmp_path, 2, optimizer="sgd", learning_rate=lr,
              clip_global_norm=clip, train_steps=steps,
              batch_size_per_replica=GLOBAL_BATCH // 2)
  want, norms = _reference(clip, steps, lr)
  unclipped, _ = _reference(0.0, steps, lr)
  assert min(norms) > 2 * clip  # engaged at every step
  # grad_norm is the norm before clipping.
  np.testing.assert_allclose(got.history["grad_norm"], norms, rtol=1e-5)
  for a, b, c in zip(got.weights, want, unclipped):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert max(np.abs(a - c).max() for a, c in zip(got.weights, unclipped)) > 0.1


def test_clipping_under_float16_loss_scaling_uses_unscaled_norms(tmp_path):
  # The gradients are times the loss scale (2**14 here) when clipped; the
  # update must still have the global norm lr x clip, not lr x clip / 2**14.
  lr, clip = 0.1, 0.05
  got = train(tmp_path, 2, optimizer="sgd", learning_rate=lr,
              clip_global_norm=clip, train_steps=2,
              mixed_precision="mixed_float16",
              batch_size_per_replica=GLOBAL_BATCH // 2)
  # The first step overflows float16 at the initial scale (2**15) and is
  # skipped: exactly one update was applied.
  assert got.summary["skipped_steps"] == 1
  assert got.summary["loss_scale"] == 2.0 ** 14
  assert got.history["grad_norm"][1] > 10 * clip
  initial = build_model("layer")
  update = [w - v.numpy() for v, w in zip(initial.trainable_variables,
                                          got.weights)]
  norm = np.sqrt(sum(float((u.astype(np.float64) ** 2).sum()) for u in update))
  assert norm == pytest.approx(lr * clip, rel=1e-4)
