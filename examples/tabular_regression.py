"""Regression on tabular data with dict features, a Huber loss and MAE.

The data are generated (house prices from rooms, area, age and a city
code), so the script runs anywhere; replace `make_examples` with your own
reader of (features dict, target) pairs.

    python examples/tabular_regression.py --cpu_devices=2 --train_steps=400 \
        --model_dir=/tmp/houses
    python -m engine.launch --num_workers=2 --module=examples.tabular_regression \
        -- --train_steps=400 --model_dir=/tmp/houses

Its own `--seed` (the data's) is the script's: the engine's --seed then keeps
its default, as engine/cli.py explains.
"""
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import engine

flags.DEFINE_integer("seed", 0, "Seed of the generated houses (not the "
                     "engine's: this script defines --seed itself).")
flags.DEFINE_integer("houses", 4096, "Generated examples (20% held out).")
flags.DEFINE_float("huber_delta", 1.0, "Huber loss: quadratic below this.")
FLAGS = flags.FLAGS
CITIES = 8
NUMERIC = ("rooms", "area", "age")


def make_examples(houses: int, seed: int):
  """Features {rooms, area, age, city} and a price (in units of 100k)."""
  rng = np.random.default_rng(seed)
  features = {"rooms": rng.integers(1, 8, houses).astype(np.float32),
              "area": rng.uniform(30, 250, houses).astype(np.float32),
              "age": rng.uniform(0, 80, houses).astype(np.float32),
              "city": rng.integers(0, CITIES, houses).astype(np.int32)}
  city_factor = np.linspace(0.6, 1.8, CITIES)[features["city"]]
  price = (0.3 * features["rooms"] + 0.02 * features["area"] -
           0.01 * features["age"]) * city_factor
  price += rng.normal(0, 0.2, houses)
  return features, price.astype(np.float32)[:, None]  # [houses, 1], as Keras


def build_model() -> keras.Model:
  inputs = {name: keras.Input((), name=name) for name in NUMERIC}
  inputs["city"] = keras.Input((), dtype="int32", name="city")
  numeric = keras.layers.Concatenate()(
      [keras.layers.Reshape((1,))(inputs[n]) for n in NUMERIC])
  numeric = keras.layers.Normalization(
      mean=[4.0, 140.0, 40.0], variance=[4.0, 4000.0, 530.0])(numeric)
  city = keras.layers.Flatten()(keras.layers.Embedding(CITIES, 4)(
      keras.layers.Reshape((1,))(inputs["city"])))
  x = keras.layers.Concatenate()([numeric, city])
  x = keras.layers.Dense(32, activation="relu")(x)
  return keras.Model(inputs, keras.layers.Dense(1)(x), name="house_prices")


def make_task(config: engine.Config) -> engine.Task:
  del config
  features, price = make_examples(FLAGS.houses, FLAGS.seed)
  cut = len(price) * 4 // 5

  def inputs(split, context):
    del context  # every worker gets the whole split; the engine shards
    part = slice(0, cut) if split == "train" else slice(cut, None)
    return tf.data.Dataset.from_tensor_slices(
        ({k: v[part] for k, v in features.items()}, price[part]))

  def squared_error(labels, outputs):  # one value per example
    return tf.reduce_mean(tf.square(outputs - labels), axis=-1)

  return engine.Task(
      model=build_model, inputs=inputs,
      # Keras losses with reduction=None, and Keras's metric functions, give
      # one value per example for [batch, 1] targets.
      loss=keras.losses.Huber(delta=FLAGS.huber_delta, reduction=None),
      metrics={"mae": keras.metrics.mean_absolute_error,
               "mse": squared_error},
      name="house_prices")


if __name__ == "__main__":
  engine.cli.run(make_task)
