"""The model families users bring, as `engine.Task`s: the model matrix of
tests/test_model_matrix.py and the speed benchmark against Keras `fit`.

    python -m benchmarks.families [--families=a,b --rounds=3 --steps=30]

Families (issue 27), each a function of its size ("test": a few thousand
parameters, 35 training examples so that the last batch of an epoch is
partial, 3 rows on 4 replicas leave one replica empty; "bench": sized for a
CPU):
  a  MLP on dict features (8 floats, 12 token ids into an `Embedding`: a
     sparse gradient), L2-regularized Dense layers, a rank-1 output
     (`Dense(1)` squeezed to [batch]), Huber loss, mean absolute error.
  b  Transformer encoder: token and position embeddings, MultiHeadAttention,
     LayerNormalization, Dropout; a text classifier.
  c  LSTM over padded token sequences, masked (`mask_zero=True`).
  d  CNN with BatchNormalization and SpatialDropout2D.
  e  A subclassed model with its own `add_loss` and an adapted (so
     non-trainable) `Normalization` layer.
  f  Family b under --mixed_precision=mixed_bfloat16.

The benchmark (`main`) runs each family in the engine (`engine.run`, its
defaults, with and without --jit_compile) and in Keras `fit` (`compile` +
`fit` under MirroredStrategy, Keras's defaults), on 2 logical CPUs, the same
model, examples and global batch, each measurement in a fresh process
(`benchmarks/variants.py`), rounds alternating the order; it prints every
rate, the medians and the ratios engine / fit. The `fit` child never runs
the engine (whose process settings would then stay), so it has
TensorFlow's and Keras's defaults. Rates are steady state: examples/s of
the `--steps` steps after `--warmup` steps, host calls stopping at both
marks (benchmarks/engine_timer.py; `fit`: a callback).
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = ("test", "bench")


@dataclasses.dataclass(frozen=True)
class Family:
  """One family at one size: the engine's task and what `fit` compiles.

  `flags`: config fields the family always runs with (f: its precision);
  `parity_flags`: more for the replica-parity tests (d: BatchNormalization
  over the global batch, without which N replicas normalize N smaller
  batches; Keras `fit` does not synchronize either, so the benchmark
  leaves it off on both sides).
  """
  name: str
  task: Callable  # () -> engine.Task
  fit_loss: Callable  # () -> a Keras loss with its default reduction
  fit_metrics: Callable  # () -> list for `model.compile`
  global_batch: int  # the benchmark's
  bench_steps: int  # the benchmark's timed steps: a few seconds of training
  flags: Dict[str, object] = dataclasses.field(default_factory=dict)
  parity_flags: Dict[str, object] = dataclasses.field(default_factory=dict)


def _rng(seed):
  return np.random.default_rng(seed)


def _splits(make, sizes):
  """{split: (features, labels)} from make(n, rng) per split."""
  return {"train": make(sizes["n"], _rng(1)),
          "eval": make(sizes["n_eval"], _rng(2))}


def _task(name, data, model, loss, metrics):
  import engine  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return engine.Task(
      model=model, loss=loss, metrics=metrics, name=f"family_{name}",
      inputs=lambda split, context: tf.data.Dataset.from_tensor_slices(
          data[split]))


def _classes():
  """Sparse categorical cross-entropy on logits and accuracy, per example."""
  import keras  # pylint: disable=g-import-not-at-top
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None)
  return loss, {"accuracy": keras.metrics.sparse_categorical_accuracy}


def _fit_classes():
  import keras  # pylint: disable=g-import-not-at-top
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# a ---------------------------------------------------------------------------
MLP = {"test": dict(n=35, n_eval=21, vocab=40, tokens=12, dim=4, width=16,
                    batch=16),
       "bench": dict(n=16384, n_eval=2048, vocab=5000, tokens=12, dim=32,
                     width=256, batch=256)}


def mlp(size: str) -> Family:
  import keras  # pylint: disable=g-import-not-at-top
  s = MLP[size]
  w = _rng(0).normal(size=8).astype(np.float32)

  def make(n, rng):
    num = rng.normal(size=(n, 8)).astype(np.float32)
    tokens = rng.integers(1, s["vocab"], (n, s["tokens"])).astype(np.int32)
    y = num @ w + 0.1 * (tokens % 5).sum(axis=1) - 2.4
    return {"num": num, "tokens": tokens}, y.astype(np.float32)
  data = _splits(make, s)

  def model():
    num = keras.Input((8,), name="num")
    tokens = keras.Input((s["tokens"],), dtype="int32", name="tokens")
    e = keras.layers.Embedding(s["vocab"], s["dim"])(tokens)
    h = keras.layers.Concatenate()(
        [num, keras.layers.GlobalAveragePooling1D()(e)])
    for _ in range(2):
      h = keras.layers.Dense(s["width"], activation="relu",
                             kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    out = keras.ops.squeeze(keras.layers.Dense(1)(h), axis=-1)  # [batch]
    return keras.Model({"num": num, "tokens": tokens}, out)

  return Family(
      "a", lambda: _task("a", data, model, keras.losses.Huber(reduction=None),
                         {"mae": keras.metrics.mean_absolute_error}),
      keras.losses.Huber, lambda: ["mae"], s["batch"], 150)


# b, f ------------------------------------------------------------------------
TRANSFORMER = {"test": dict(n=35, n_eval=21, vocab=30, length=8, dim=8,
                            heads=2, ffn=16, layers=1, classes=3, batch=16),
               "bench": dict(n=8192, n_eval=1024, vocab=2000, length=64,
                             dim=64, heads=4, ffn=128, layers=2, classes=2,
                             batch=64)}
DROPOUT = 0.1


def _token_and_position():
  import keras  # pylint: disable=g-import-not-at-top

  class TokenAndPosition(keras.layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab, length, dim, **kw):
      super().__init__(**kw)
      self.tokens = keras.layers.Embedding(vocab, dim)
      self.positions = keras.layers.Embedding(length, dim)

    def call(self, ids):
      return self.tokens(ids) + self.positions(
          keras.ops.arange(keras.ops.shape(ids)[-1]))

  return TokenAndPosition


def _text(s, rng, n, padded=False):
  """Token ids (0 is padding) and a label from the tokens' mix of halves."""
  ids = rng.integers(1, s["vocab"], (n, s["length"])).astype(np.int32)
  if padded:  # lengths 2..length, padded with zeros at the end
    lengths = rng.integers(2, s["length"] + 1, n)
    ids[np.arange(s["length"])[None, :] >= lengths[:, None]] = 0
  low = ((ids > 0) & (ids < s["vocab"] // 2)).sum(axis=1)
  share = low / np.maximum((ids > 0).sum(axis=1), 1)
  labels = np.minimum((share * s["classes"]).astype(np.int32),
                      s["classes"] - 1)
  return ids, labels


def transformer(size: str, name: str = "b", **flags) -> Family:
  import keras  # pylint: disable=g-import-not-at-top
  s = TRANSFORMER[size]
  data = _splits(lambda n, rng: _text(s, rng, n), s)
  layer = _token_and_position()

  def model():
    ids = keras.Input((s["length"],), dtype="int32")
    x = layer(s["vocab"], s["length"], s["dim"])(ids)
    for _ in range(s["layers"]):
      a = keras.layers.MultiHeadAttention(s["heads"],
                                          s["dim"] // s["heads"])(x, x)
      x = keras.layers.LayerNormalization()(
          x + keras.layers.Dropout(DROPOUT)(a))
      f = keras.layers.Dense(s["ffn"], activation="relu")(x)
      f = keras.layers.Dense(s["dim"])(f)
      x = keras.layers.LayerNormalization()(
          x + keras.layers.Dropout(DROPOUT)(f))
    x = keras.layers.Dropout(DROPOUT)(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(ids, keras.layers.Dense(s["classes"])(x))

  return Family(name, lambda: _task(name, data, model, *_classes()),
                _fit_classes, lambda: ["accuracy"], s["batch"], 30, flags)


def transformer_bf16(size: str) -> Family:
  return transformer(size, "f", mixed_precision="mixed_bfloat16")


# c ---------------------------------------------------------------------------
LSTM = {"test": dict(n=35, n_eval=21, vocab=30, length=10, dim=8, units=8,
                     classes=3, batch=16),
        "bench": dict(n=8192, n_eval=1024, vocab=2000, length=40, dim=32,
                      units=64, classes=2, batch=64)}


def lstm(size: str) -> Family:
  import keras  # pylint: disable=g-import-not-at-top
  s = LSTM[size]
  data = _splits(lambda n, rng: _text(s, rng, n, padded=True), s)

  def model():
    ids = keras.Input((s["length"],), dtype="int32")
    x = keras.layers.Embedding(s["vocab"], s["dim"], mask_zero=True)(ids)
    x = keras.layers.LSTM(s["units"])(x)
    return keras.Model(ids, keras.layers.Dense(s["classes"])(x))

  return Family("c", lambda: _task("c", data, model, *_classes()),
                _fit_classes, lambda: ["accuracy"], s["batch"], 60)


# d ---------------------------------------------------------------------------
CNN = {"test": dict(n=35, n_eval=21, side=8, filters=(4, 8), classes=3,
                    batch=16),
       "bench": dict(n=4096, n_eval=512, side=32, filters=(32, 64, 64),
                     classes=10, batch=64)}


def cnn(size: str) -> Family:
  import keras  # pylint: disable=g-import-not-at-top
  s = CNN[size]
  side = s["side"]

  def make(n, rng):
    labels = rng.integers(0, s["classes"], n).astype(np.int32)
    images = rng.normal(size=(n, side, side, 3)).astype(np.float32)
    images[:, :, :, 0] += (labels[:, None, None] - s["classes"] / 2) * 0.3
    return images, labels
  data = _splits(make, s)

  def model():
    x = inputs = keras.Input((side, side, 3))
    for k, width in enumerate(s["filters"]):
      x = keras.layers.Conv2D(width, 3, strides=1 if k == 0 else 2,
                              padding="same", use_bias=False)(x)
      x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
      if k == 0:
        x = keras.layers.SpatialDropout2D(0.2)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(s["classes"])(x))

  return Family("d", lambda: _task("d", data, model, *_classes()),
                _fit_classes, lambda: ["accuracy"], s["batch"], 40,
                parity_flags={"sync_batchnorm": True})


# e ---------------------------------------------------------------------------
SUBCLASSED = {"test": dict(n=35, n_eval=21, features=6, width=16, classes=3,
                           batch=16),
              "bench": dict(n=16384, n_eval=2048, features=32, width=256,
                            classes=10, batch=256)}
ACTIVITY_PENALTY = 1e-2


def subclassed(size: str) -> Family:
  import keras  # pylint: disable=g-import-not-at-top
  s = SUBCLASSED[size]
  w = _rng(0).normal(size=(s["features"], s["classes"]))

  def make(n, rng):
    x = rng.normal(2.0, 3.0, size=(n, s["features"])).astype(np.float32)
    return x, np.argmax(x @ w, axis=1).astype(np.int32)
  data = _splits(make, s)

  class Classifier(keras.Model):
    """Normalized features, two hidden layers, a penalty on their output."""

    def __init__(self):
      super().__init__()
      self.norm = keras.layers.Normalization()
      self.hidden = [keras.layers.Dense(s["width"], activation="relu")
                     for _ in range(2)]
      self.head = keras.layers.Dense(s["classes"])

    def call(self, x):
      h = self.norm(x)
      for layer in self.hidden:
        h = layer(h)
      # Its own loss: a mean over this call's rows, as Keras adds it.
      self.add_loss(ACTIVITY_PENALTY * keras.ops.mean(keras.ops.square(h)))
      return self.head(h)

  def model():
    m = Classifier()
    m.norm.adapt(data["train"][0])  # mean and variance: not trained
    return m

  return Family("e", lambda: _task("e", data, model, *_classes()),
                _fit_classes, lambda: ["accuracy"], s["batch"], 100)


FAMILIES = {"a": mlp, "b": transformer, "c": lstm, "d": cnn,
            "e": subclassed, "f": transformer_bf16}


# The benchmark -----------------------------------------------------------------
VARIANTS = ("engine", "engine_jit", "fit")
PROFILED_STEPS = 10  # --profile_dir: one engine host call


def engine_child(family: Family, args):
  """(examples/s, CPU seconds per example) of the engine on the family: its
  defaults (steps_per_loop 10, summaries every 10 steps), --jit_compile for
  engine_jit."""
  import engine  # pylint: disable=g-import-not-at-top
  from benchmarks import engine_timer  # pylint: disable=g-import-not-at-top
  config = engine.Config.create(
      strategy="mirrored", cpu_devices=args.cpu_devices,
      batch_size_per_replica=family.global_batch // args.cpu_devices,
      train_steps=args.warmup + args.steps + _profiled(args),
      optimizer="adam", learning_rate=1e-3, mode="train", export=False,
      log_every=1000, jit_compile=args.variant == "engine_jit",
      profile_steps=_profile_steps(args),
      model_dir=(os.path.join(args.profile_dir, args.variant)
                 if args.profile_dir else
                 engine_timer.scratch_dir("families_")),
      **family.flags)
  engine.configure_host(config)
  examples, seconds, cpu = engine_timer.task_timing(
      family.task(), config, args.warmup, args.steps)
  return examples / seconds, cpu / examples


def _profiled(args) -> int:
  """Steps traced after the timed ones (--profile_dir)."""
  return PROFILED_STEPS if args.profile_dir else 0


def _profile_steps(args):
  if not args.profile_dir:
    return ()
  first = args.warmup + args.steps + 1
  return (first, first + PROFILED_STEPS - 1)


def fit_child(family: Family, args):
  """(examples/s, CPU seconds per example) of Keras `compile` + `fit` on
  the family under MirroredStrategy, as its
  users run it: Keras's defaults, the task's examples shuffled and batched
  by the same global batch (partial batches included), Adam 1e-3."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * args.cpu_devices)
  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(args.cpu_devices)])
  keras.utils.set_random_seed(42)
  if family.flags.get("mixed_precision"):
    keras.config.set_dtype_policy(family.flags["mixed_precision"])
  task = family.task()
  dataset = (task.build_inputs("train", None).shuffle(1024)
             .batch(family.global_batch).repeat().prefetch(tf.data.AUTOTUNE))
  with strategy.scope():
    model = task.build_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=family.fit_loss(), metrics=family.fit_metrics())
  marks = {}

  class Timer(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if batch + 1 == args.warmup:
        marks["start"] = (time.perf_counter(), time.process_time())
      if batch + 1 == args.warmup + args.steps:
        float(logs["loss"])  # waits for the step, as fit's end would
        marks["stop"] = (time.perf_counter(), time.process_time())
        if args.profile_dir:
          tf.profiler.experimental.start(os.path.join(args.profile_dir,
                                                      "fit"))
      if args.profile_dir and batch + 1 == (args.warmup + args.steps +
                                            PROFILED_STEPS):
        float(logs["loss"])
        tf.profiler.experimental.stop()

  model.fit(dataset, epochs=1,
            steps_per_epoch=args.warmup + args.steps + _profiled(args),
            callbacks=[Timer()], verbose=0)
  examples = args.steps * family.global_batch
  return (examples / (marks["stop"][0] - marks["start"][0]),
          (marks["stop"][1] - marks["start"][1]) / examples)


def _parse(argv):
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.families",
      description="The engine against Keras fit on the model families.")
  p.add_argument("--families", default=",".join(FAMILIES),
                 help="Comma-separated families (a..f).")
  p.add_argument("--rounds", type=int, default=3,
                 help="Rounds; each runs every variant once, alternating "
                      "the order.")
  p.add_argument("--steps", type=int, default=0,
                 help="Timed steps (0: the family's, a few seconds).")
  p.add_argument("--warmup", type=int, default=10,
                 help="Untimed steps first (the engine: one host call).")
  p.add_argument("--cpu_devices", type=int, default=2,
                 help="Logical CPU devices (replicas) of every variant.")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"Which of {', '.join(VARIANTS)}.")
  p.add_argument("--variant", choices=VARIANTS, help="Internal: run one.")
  p.add_argument("--family", choices=sorted(FAMILIES),
                 help="Internal: the --variant's family.")
  p.add_argument("--baseline_tree", default="",
                 help="Also run the engine variant from this checkout (e.g. "
                      "a worktree of the commit before a change) as "
                      "engine_before, side by side.")
  p.add_argument("--profile_dir", default="",
                 help="With --variant=engine*: trace 10 steps after the "
                      "timed ones into this directory (TensorBoard, "
                      "benchmarks.op_profile).")
  return p.parse_args(argv)


def _child_command(args, family, variant, steps):
  """One measurement's process; engine_before: the engine variant of
  --baseline_tree's checkout, run from there."""
  from benchmarks import variants as variants_lib  # pylint: disable=g-import-not-at-top
  tree = os.path.abspath(args.baseline_tree) if (
      variant == "engine_before") else ROOT
  return variants_lib.Command(
      [sys.executable, "-m", "benchmarks.families",
       f"--variant={'engine' if variant == 'engine_before' else variant}",
       f"--family={family}", f"--steps={steps}", f"--warmup={args.warmup}",
       f"--cpu_devices={args.cpu_devices}"],
      dict(os.environ, PYTHONPATH=tree), tree)


def parent(args) -> dict:
  """{family: {variant: median examples/s}}, printing the table. A family
  whose variant fails is reported as failing and the others go on."""
  from benchmarks import variants as variants_lib  # pylint: disable=g-import-not-at-top
  variants = args.variants.split(",") + (
      ["engine_before"] if args.baseline_tree else [])
  table = {}
  for name in args.families.split(","):
    print(f"== family {name}", flush=True)
    steps = args.steps or FAMILIES[name]("bench").bench_steps
    try:
      results = variants_lib.run_rounds(
          {v: _child_command(args, name, v, steps) for v in variants},
          args.rounds)
    except SystemExit as e:  # run_rounds exits with the child's error
      errors = [l for l in str(e).splitlines() if "Error" in l]
      print(f"family {name} failed: {' | '.join(errors[-2:])}", flush=True)
      table[name] = None
      continue
    table[name] = (variants_lib.median_rates(results), results)
  print(f"\nexamples/s, MirroredStrategy on {args.cpu_devices} logical "
        f"CPUs, {args.warmup} untimed steps then the timed ones, median of "
        f"{args.rounds} rounds (each rate in brackets, each a fresh "
        "process); then the median CPU time of the process per example "
        "(all its threads) over the same steps")
  heads = [v for v in VARIANTS + ("engine_before",) if v in variants]
  ratios = [v for v in heads if v != "fit"] if "fit" in heads else []
  print("| family | global batch | timed steps | " + " | ".join(heads) +
        "".join(f" | {v} / fit" for v in ratios) + " | " +
        " | ".join(f"{v} CPU us/example" for v in heads) + " |")
  print("|---|---|---|" + "---|" * (2 * len(heads) + len(ratios)))
  for name, row in table.items():
    family = FAMILIES[name]("bench")
    steps = args.steps or family.bench_steps
    if row is None:
      print(f"| {name} | {family.global_batch} | {steps} | fails |")
      continue
    median, results = row
    cpu = {v: statistics.median(r.get("cpu_us_per_example", float("nan"))
                                for r in results[v]) for v in heads}
    print(f"| {name} | {family.global_batch} | {steps} | " + " | ".join(
        f"{median[v]:.0f} ({_rates(results[v])})" for v in heads) + "".join(
            f" | {median[v] / median['fit']:.2f}" for v in ratios) + " | " +
          " | ".join(f"{cpu[v]:.0f}" for v in heads) + " |")
  return {name: row and row[0] for name, row in table.items()}


def _rates(results) -> str:
  return ", ".join(f"{r['rate']:.0f}" for r in results)


def main(argv=None):
  args = _parse(argv)
  if args.variant:
    family = FAMILIES[args.family]("bench")
    args.steps = args.steps or family.bench_steps
    run = fit_child if args.variant == "fit" else engine_child
    rate, cpu = run(family, args)
    print("RESULT " + json.dumps({"variant": args.variant, "rate": rate,
                                  "cpu_us_per_example": cpu * 1e6}))
  else:
    parent(args)


if __name__ == "__main__":
  main()
