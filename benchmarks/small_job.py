"""A small regression job, as a new user writes it, for the engine and for Keras.

Generated data: 5,000 examples (4,000 for training, 1,000 held out), dict
features of 8 floats and 12 token ids (vocabulary 100) into an `Embedding`,
two L2-regularized `Dense` layers and a `Dense(1)` output, a Huber loss and
the mean absolute error; global batch 64, 20 epochs (63 steps each, the
last partial: 1,260 steps), an evaluation after every epoch.

    python benchmarks/small_job.py --runner=engine [engine flags]
    python benchmarks/small_job.py --runner=keras

`engine`: the job through `engine.cli.run` (what `python train.py` of a
user's script does), with the engine's defaults (mirrored on this host's
devices) plus --epochs=20 --batch_size_per_replica=64 --noexport unless
given. `keras`: the same model, data and batch under `model.fit(...,
validation_data=...)` with Keras's defaults (adam, as the engine's), the
evaluations `fit` makes at each epoch's end. benchmarks/end_to_end.py times
both, each in a fresh process.
"""
import sys

EXAMPLES, TRAIN, FLOATS, TOKENS, VOCAB = 5000, 4000, 8, 12, 100
BATCH, EPOCHS = 64, 20


def make_examples():
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  floats = rng.normal(size=(EXAMPLES, FLOATS)).astype(np.float32)
  tokens = rng.integers(0, VOCAB, size=(EXAMPLES, TOKENS)).astype(np.int32)
  weights = rng.normal(size=VOCAB).astype(np.float32)
  target = floats @ rng.normal(size=FLOATS) + weights[tokens].mean(axis=1)
  target += rng.normal(0.0, 0.1, EXAMPLES)
  return {"floats": floats, "tokens": tokens}, target.astype(np.float32)[
      :, None]


def build_model():
  import keras  # pylint: disable=g-import-not-at-top
  floats = keras.Input((FLOATS,), name="floats")
  tokens = keras.Input((TOKENS,), dtype="int32", name="tokens")
  embedded = keras.layers.GlobalAveragePooling1D()(
      keras.layers.Embedding(VOCAB, 8)(tokens))
  x = keras.layers.Concatenate()([floats, embedded])
  for width in (64, 32):
    x = keras.layers.Dense(width, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-4))(x)
  return keras.Model({"floats": floats, "tokens": tokens},
                     keras.layers.Dense(1)(x), name="small_regression")


def split(features, target, part):
  rows = slice(0, TRAIN) if part == "train" else slice(TRAIN, None)
  return {k: v[rows] for k, v in features.items()}, target[rows]


def run_engine(argv):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import engine  # pylint: disable=g-import-not-at-top

  def make_task(config):
    del config
    features, target = make_examples()
    return engine.Task(
        model=build_model,
        inputs=lambda part, context: tf.data.Dataset.from_tensor_slices(
            split(features, target, part)),
        loss=keras.losses.Huber(reduction=None),
        metrics={"mae": keras.metrics.mean_absolute_error},
        name="small_regression")

  defaults = [f"--epochs={EPOCHS}", f"--batch_size_per_replica={BATCH}",
              "--noexport"]
  given = {a.split("=")[0].lstrip("-").removeprefix("no") for a in argv[1:]}
  argv = [argv[0]] + [d for d in defaults
                      if d.split("=")[0].lstrip("-").removeprefix("no")
                      not in given] + argv[1:]
  engine.cli.run(make_task, argv=argv)


def run_keras():
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  features, target = make_examples()
  train = tf.data.Dataset.from_tensor_slices(
      split(features, target, "train")).shuffle(1024, seed=0).batch(BATCH)
  held_out = tf.data.Dataset.from_tensor_slices(
      split(features, target, "eval")).batch(BATCH)
  keras.utils.set_random_seed(0)
  model = build_model()
  model.compile(optimizer="adam", loss=keras.losses.Huber(),
                metrics=["mae"])
  history = model.fit(train, epochs=EPOCHS, validation_data=held_out,
                      verbose=2)
  print(f"keras done: loss {history.history['loss'][-1]:.4f} val_mae "
        f"{history.history['val_mae'][-1]:.4f}", flush=True)


def main(argv):
  runner = [a for a in argv[1:] if a.startswith("--runner=")]
  rest = [a for a in argv if not a.startswith("--runner=")]
  which = runner[-1].split("=", 1)[1] if runner else "engine"
  if which == "keras":
    run_keras()
  elif which == "engine":
    run_engine(rest)
  else:
    print(f"error: --runner={which}: use engine or keras.", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main(sys.argv)
