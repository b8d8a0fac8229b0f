"""The Task contract holds for the models users write (issue 27): rank-1
outputs as Keras `fit` takes them, embeddings with partial batches on any
replica count and with every gradient option, any seed in range, and
randomness inside the model keyed by example (the same on 1, 2, 4 replicas
and after a resume), and AutoGraph for a task's preprocessing unless it opts
out. tests/test_model_matrix.py runs whole model families.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import engine
from test_multi_worker import start_from_checkpoint

# 34 examples in global batches of 16: each epoch ends with a batch of 2, so
# on 4 replicas two replicas get no example at all.
EXAMPLES = 34
GLOBAL_BATCH = 16
TOKENS, VOCAB = 3, 11


def _examples():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(EXAMPLES, 5)).astype(np.float32)
  tokens = rng.integers(0, VOCAB, size=(EXAMPLES, TOKENS)).astype(np.int32)
  y = (x.sum(1) + (tokens % 3).sum(1)).astype(np.float32)
  return {"x": x, "tokens": tokens}, y


def regression_task(rank1: bool = True, loss=None,
                    name: str = "regression") -> engine.Task:
  """The issue's user script at test size: dict features (floats and token
  ids into an Embedding), L2-regularized Dense layers, a Dense(1) output
  squeezed to [batch] (`rank1`), Huber loss and MAE."""
  features, y = _examples()

  def model():
    inputs = {"x": keras.Input((5,), name="x"),
              "tokens": keras.Input((TOKENS,), dtype="int32", name="tokens")}
    embedded = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4)(
        inputs["tokens"]))
    h = keras.layers.Concatenate()([inputs["x"], embedded])
    h = keras.layers.Dense(8, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    out = keras.layers.Dense(1)(h)
    return keras.Model(inputs, keras.layers.Reshape(())(out) if rank1
                       else out)

  labels = y if rank1 else y[:, None]
  return engine.Task(
      model=model, name=name,
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          (features, labels)) if split == "train" else None,
      loss=loss or keras.losses.Huber(reduction=None),
      metrics={"mae": keras.metrics.mean_absolute_error})


def config(tmp_path, replicas: int, **fields) -> engine.Config:
  accum = fields.get("grad_accum_steps", 1)
  base = dict(strategy="mirrored" if replicas > 1 else "one_device",
              cpu_devices=replicas,
              batch_size_per_replica=GLOBAL_BATCH // replicas // accum,
              train_steps=6, steps_per_loop=6, optimizer="sgd",
              learning_rate=0.05, seed=5, export=False,
              model_dir=str(tmp_path / f"r{replicas}"))
  base.update(fields)
  return engine.Config.create(**base)


def assert_same(result, reference, tol=1e-5):
  np.testing.assert_allclose(result.losses, reference.losses, rtol=tol,
                             atol=tol)
  for got, want in zip(result.weights, reference.weights):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_rank1_outputs_and_labels_train_as_fit_takes_them(tmp_path,
                                                          one_replica):
  """[batch] outputs and labels with a Keras loss and metric function made
  for `fit` give one value per example: the same run as [batch, 1]."""
  rank1 = one_replica()  # regression_task(rank1=True) on 1 replica
  column = engine.run(regression_task(rank1=False),
                      config(tmp_path / "b", 1))
  np.testing.assert_array_equal(rank1.losses, column.losses)
  np.testing.assert_array_equal(rank1.history["mae"], column.history["mae"])
  assert rank1.losses[-1] < rank1.losses[0]


@pytest.mark.parametrize("loss,expected", [
    (keras.losses.Huber(),  # reduction left at its default: a mean
     "error: task regression: the loss returned shape [] for labels shape "
     "[None, 1] and outputs shape [None, 1]; it must return one value per "
     "example (shape [batch]): it averaged over the batch (a Keras loss "
     "object needs reduction=None; a function must keep the batch axis)."),
    (lambda y, p: tf.concat([y - p, p], axis=1),
     "error: task regression: the loss returned shape [None, 2] for labels "
     "shape [None, 1] and outputs shape [None, 1]; it must return one value "
     "per example (shape [batch]): it gives several values per example "
     "(average them, e.g. tf.reduce_mean(..., axis=-1))."),
])
def test_a_loss_of_the_wrong_shape_names_the_shapes(tmp_path, loss,
                                                    expected):
  with pytest.raises(engine.ConfigError) as caught:
    engine.run(regression_task(loss=loss), config(tmp_path, 1))
  assert f"error: {caught.value}" == expected


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
  """1-replica references, one per set of gradient options."""
  cache = {}

  def get(**fields):
    key = tuple(sorted(fields.items()))
    if key not in cache:
      path = tmp_path_factory.mktemp("one")
      cache[key] = engine.run(regression_task(), config(path, 1, **fields))
    return cache[key]
  return get


# An embedding's gradient is sparse (IndexedSlices); the run crosses two
# partial batches inside one host call, on 4 replicas with empty replicas.
@pytest.mark.parametrize("replicas,fields,tol", [
    (2, {}, 1e-5),
    (4, {}, 1e-5),
    (4, {"grad_accum_steps": 2, "clip_global_norm": 0.5}, 1e-5),
    (2, {"ema_decay": 0.9, "bytes_per_pack": 256,
         "cross_device_ops": "ring"}, 1e-5),
    # bfloat16 on the wire: each replica's share is rounded before the sum,
    # one device's whole gradient once (8 bits of mantissa).
    (4, {"grad_compression": "bf16"}, 2e-2),
])
def test_sparse_gradients_with_partial_batches(tmp_path, one_replica,
                                               replicas, fields, tol):
  result = engine.run(regression_task(), config(tmp_path, replicas,
                                                **fields))
  reference = one_replica(**fields)
  assert result.summary["num_replicas"] == replicas
  assert list(result.history["examples"]) == [16, 16, 2] * 2
  # One all-reduce per step (dense, with the count); packs of 256 bytes
  # split it in two; compressed, the count has one of its own.
  assert result.summary["collectives_per_step"] == (
      1 + ("bytes_per_pack" in fields) + ("grad_compression" in fields))
  assert_same(result, reference, tol)
  if "ema_decay" in fields:
    for got, want in zip(result.averages, reference.averages):
      np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_seed_zero_and_the_seed_range(tmp_path, one_replica):
  """Seed 0 is a seed like any other (TensorFlow's (0, 0) comparison in
  its seed helper broke it): two runs of seed 0 are the same run, and
  another seed's run differs (the first 3 steps of the module's 1-replica
  reference, the same task and config with seed 5, rather than a third
  run); out of range is one line."""
  zero = engine.run(regression_task(), config(tmp_path / "a", 1, seed=0,
                                              train_steps=3))
  again = engine.run(regression_task(), config(tmp_path / "b", 1, seed=0,
                                                train_steps=3))
  other = one_replica()  # seed=5 (config's)
  np.testing.assert_array_equal(zero.losses, again.losses)
  assert not np.allclose(zero.losses, other.losses[:3])
  for seed in (-1, 2**31 - 1):
    with pytest.raises(engine.ConfigError) as caught:
      config(tmp_path, 1, seed=seed)
    assert str(caught.value) == (
        f"--seed={seed}: must be an integer from 0 to 2147483646 "
        "(TensorFlow takes seeds modulo 2**31 - 1).")


def random_layers_task(seed_of_data: int = 0) -> engine.Task:
  """Every Keras random layer a user puts in a model, on images, sequences
  and volumes of 34 examples."""
  rng = np.random.default_rng(seed_of_data)
  features = {
      "image": rng.normal(size=(EXAMPLES, 6, 6, 2)).astype(np.float32),
      "sequence": rng.normal(size=(EXAMPLES, 4, 3)).astype(np.float32),
      "volume": rng.normal(size=(EXAMPLES, 2, 2, 2, 2)).astype(np.float32)}
  labels = rng.integers(0, 3, size=EXAMPLES).astype(np.int32)

  def model():
    inputs = {"image": keras.Input((6, 6, 2), name="image"),
              "sequence": keras.Input((4, 3), name="sequence"),
              "volume": keras.Input((2, 2, 2, 2), name="volume")}
    image = inputs["image"]
    for layer in (keras.layers.RandomFlip(), keras.layers.RandomRotation(0.2),
                  keras.layers.RandomZoom(0.2),
                  keras.layers.RandomTranslation(0.1, 0.1),
                  keras.layers.RandomContrast(0.3),
                  keras.layers.GaussianNoise(0.3),
                  keras.layers.Conv2D(4, 3),
                  keras.layers.SpatialDropout2D(0.3)):
      image = layer(image)
    sequence = keras.layers.SpatialDropout1D(0.3)(inputs["sequence"])
    volume = keras.layers.SpatialDropout3D(0.3)(inputs["volume"])
    h = keras.layers.Concatenate()([keras.layers.Flatten()(t) for t in
                                    (image, sequence, volume)])
    h = keras.layers.Dense(16, activation="relu")(h)
    for layer in (keras.layers.Dropout(0.5), keras.layers.GaussianDropout(0.2),
                  keras.layers.AlphaDropout(0.2)):
      h = layer(h)
    return keras.Model(inputs, keras.layers.Dense(3)(h))

  return engine.Task(
      model=model, name="random_layers",
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          (features, labels)) if split == "train" else None,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=None))


@pytest.fixture(scope="module")
def random_reference(tmp_path_factory):
  return engine.run(random_layers_task(),
                    config(tmp_path_factory.mktemp("random"), 1))


@pytest.fixture(scope="module")
def random_two_replicas(tmp_path_factory):
  """The 2-replica run, also saving the mid-epoch step the resume test
  starts from (RESUME_AT)."""
  model_dir = tmp_path_factory.mktemp("random_2")
  result = engine.run(random_layers_task(), config(
      model_dir, 2, checkpoint_every=RESUME_AT))
  return result, model_dir / "r2"


RESUME_AT = 4  # mid-epoch: epochs of 16, 16, 2 examples


@pytest.mark.parametrize("replicas", [2, 4])
def test_randomness_inside_the_model_is_keyed_by_example(
    tmp_path, random_reference, random_two_replicas, replicas):
  result = (random_two_replicas[0] if replicas == 2 else
            engine.run(random_layers_task(), config(tmp_path, replicas)))
  assert result.summary["replica_dependent_randomness"] == []
  assert_same(result, random_reference)


def test_randomness_inside_the_model_resumes_exactly(
    tmp_path, random_reference, random_two_replicas):
  """Stopped at step 4 (mid-epoch) and resumed, on 2 replicas: the draws
  of steps 5 and 6 are the uninterrupted run's. The stop is the 2-replica
  run's checkpoint of step 4, the state a run stopped there saves
  (test_multi_worker.start_from_checkpoint; one run fewer than training
  the first 4 steps again)."""
  resumed_dir = tmp_path / "r2"
  start_from_checkpoint(random_two_replicas[1], resumed_dir, RESUME_AT)
  resumed = engine.run(random_layers_task(), config(tmp_path, 2))
  assert resumed.summary["start_step"] == RESUME_AT
  np.testing.assert_allclose(resumed.losses,
                             random_reference.losses[RESUME_AT:],
                             rtol=1e-5, atol=1e-5)
  for got, want in zip(resumed.weights, random_reference.weights):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_draws_the_same_wherever_it_is_trained():
  """The draw of a row is a function of (seed, step, its position): the
  same whether its batch is trained whole or in pieces; other steps,
  positions and seeds draw otherwise."""
  from engine.core import randomness  # pylint: disable=g-import-not-at-top
  x = tf.ones([8, 64])

  def masks(positions, step=0, seed=3):
    keyed = randomness.RowRandomness(seed, rows_per_replica=8)
    dropout = keras.layers.Dropout(0.5)

    @tf.function
    def dropped(rows):
      with keyed.rows((tf.fill(tf.shape(rows), tf.constant(step, tf.int64)),
                       rows)):
        return dropout(x[:tf.size(rows)], training=True)
    return dropped(tf.constant(positions, tf.int64)).numpy()

  whole = masks(list(range(8)))
  np.testing.assert_array_equal(
      whole, np.concatenate([masks([0, 1, 2]), masks([3, 4, 5, 6, 7])]))
  np.testing.assert_array_equal(whole[[2, 5]], masks([2, 5]))
  assert set(np.unique(whole)) == {0.0, 2.0}
  assert 0.4 < (whole == 0).mean() < 0.6
  assert len({row.tobytes() for row in whole}) == 8  # every row its own
  for other in (masks(list(range(8)), step=1), masks(list(range(8)), seed=4),
                masks(list(range(1, 9)))):
    assert (other != whole).mean() > 0.3


class OwnNoise(keras.layers.Layer):
  """A user's random layer drawing with TensorFlow's stateful op."""

  def call(self, x, training=False):
    return x + tf.random.uniform(tf.shape(x)) if training else x


def test_a_users_own_random_layer_is_named(tmp_path, caplog):
  features, y = _examples()

  def model():
    x = keras.Input((5,), name="x")
    return keras.Model(x, keras.layers.Dense(1)(OwnNoise(name="own_noise")(
        keras.layers.Dropout(0.1)(x))))

  task = engine.Task(
      model=model, name="own_noise",
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          (features["x"], y)) if split == "train" else None,
      loss=keras.losses.MeanSquaredError(reduction=None))
  with caplog.at_level("WARNING"):
    result = engine.run(task, config(tmp_path, 1, train_steps=2))
  assert result.summary["replica_dependent_randomness"] == ["own_noise"]
  lines = [r.getMessage() for r in caplog.records
           if "cannot key by example" in r.getMessage()]
  assert len(lines) == 1 and lines[0].startswith(
      "Layer own_noise draws random numbers with RandomUniform"), lines


def test_a_step_that_fails_when_it_runs_is_one_line(tmp_path):
  """Mistakes found only when the first step runs name their cause: a label
  outside the model's classes; an op XLA cannot compile (RandomRotation's
  image transform) under --jit_compile."""
  features, _ = _examples()
  bad_labels = np.full(EXAMPLES, 5, np.int32)  # 3 classes
  task = engine.Task(
      model=lambda: keras.Sequential([keras.Input((5,)),
                                      keras.layers.Dense(3)]),
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          (features["x"], bad_labels)) if split == "train" else None,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=None),
      name="bad_labels")
  with pytest.raises(engine.ConfigError) as caught:
    engine.run(task, config(tmp_path / "a", 1, train_steps=1))
  message = str(caught.value)
  assert message.startswith("the first training step failed: Received a "
                            "label value of 5 which is outside the valid "
                            "range of [0, 3)"), message
  assert message.endswith("(check that the task's labels fit the model's "
                          "outputs).") and "\n" not in message
  with pytest.raises(engine.ConfigError) as caught:
    engine.run(random_layers_task(), config(tmp_path / "b", 1, train_steps=1,
                                            jit_compile=True))
  message = str(caught.value)
  assert "ImageProjectiveTransformV3" in message and message.endswith(
      "(--jit_compile: XLA cannot compile an op of the model; train without "
      "--jit_compile).") and "\n" not in message, message


class _CappedLabels(engine.Task):
  """A user's `preprocess_batch` with a Python `if` on a tensor's value."""

  def preprocess_batch(self, features, labels, training):
    if tf.reduce_max(labels) > 1.0:
      labels = tf.minimum(labels, 1.0)
    return features, labels


def test_a_tasks_preprocessing_is_converted_unless_it_opts_out(tmp_path):
  """tf.data converts a task's own `preprocess_batch` with AutoGraph, as it
  converts every map function (the `if` becomes a graph branch); a task
  that sets `autograph = False` is traced as written (the built-in image
  task, whose branches are on Python values)."""
  from engine.core import inputs  # pylint: disable=g-import-not-at-top
  features, y = _examples()
  task = _CappedLabels(
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          (features, y)))
  cfg = config(tmp_path, 1)

  def first_labels():
    data = inputs.TrainData(task, tf.distribute.InputContext(), cfg.data,
                            GLOBAL_BATCH, cfg.randomness.seed)
    return next(iter(data.batches()))[1].numpy()

  assert y.max() > 1.0
  assert first_labels().max() == 1.0
  task.autograph = False
  with pytest.raises(TypeError,
                     match="symbolic `tf.Tensor` as a Python `bool`"):
    first_labels()
