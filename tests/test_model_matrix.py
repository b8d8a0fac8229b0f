"""The model matrix (issue 27): the families users bring train the same on 1,
2 and 4 replicas and on 2 workers, with --grad_accum_steps=2, and resumed.

Each family of benchmarks/families.py (a: an MLP on dict features with an
Embedding and a rank-1 output, b: a Transformer encoder, c: a masked LSTM,
d: a CNN with BatchNormalization and SpatialDropout2D, e: a subclassed model
with `add_loss` and an adapted Normalization, f: b in mixed_bfloat16) trains
6 steps on 35 examples: global batches of 16, 16 and 3 (its 3 rows leave
one of 4 replicas with nothing), twice. Against its 1-replica run:
  * 2 and 4 replicas in-process: per-step losses and final weights within
    1e-5 (relative; absolute for values near 0), evaluation within 1e-6;
  * 2 workers through the launcher (tests/family_job.py; a-e in one run,
    f in its own): the same, per-step metrics too;
  * 2 replicas with --grad_accum_steps=2 (4 rows per micro-batch): the same
    losses and weights (one update per global batch of 16);
  * the 2-replica run resumed from its checkpoint of step 4 (mid-epoch)
    ends as the uninterrupted one (to 1e-6).
Family f holds looser bounds, for a reason bfloat16 has (BFLOAT16).
SGD: its update is linear in the gradient, so a wrong count of the examples
(a partial batch, an empty replica, a regularizer counted twice) shows in
the weights; Adam would normalize most of it away.

One test per family makes all of its in-process runs and reports every
mismatch at once (`Checks`), so that its 1-replica run is made once even
when pytest-xdist spreads the tests over processes.
"""
import json
import logging
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import engine
from benchmarks import families
import forkserver
from conftest import ROOT, read_scalars
import family_job
from test_multi_worker import start_from_checkpoint

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
SCRIPT = os.path.join(ROOT, "tests", "family_job.py")
GLOBAL_BATCH, STEPS, RESUME_AT, SEED, LR = 16, 6, 4, 3, 0.1
EXAMPLES_PER_STEP = [16, 16, 3] * 2
EXACT = dict(loss=1e-5, weights=1e-5, evaluation=1e-6)
# bfloat16 (family f): the largest differences from 1 replica measured here
# (2 and 4 replicas, 2 workers, grad_accum_steps=2; 6 SGD steps) are 6.0e-3
# relative in the losses, 4.9e-3 absolute in the weights
# (attention_output/bias, largest value 0.21) and 1.3e-3 relative in the
# evaluation loss. Not the engine's doing: a replica's gradient is a
# bfloat16 sum over its rows (a matmul's or a bias-add's gradient, rounded
# to 8 bits of mantissa) before the float32 all-reduce adds the replicas'
# sums, so N replicas round N partial sums where one replica rounds one
# (test_bfloat16_gradients_depend_on_the_split shows it without the
# engine). The bounds are about twice those. The first step's loss (the
# same weights; the forward pass is row by row) and a resumed run (the same
# replicas) still hold to 1e-6.
BFLOAT16 = dict(loss=1e-2, weights=1e-2, evaluation=5e-3)
TOLERANCES = {"f": BFLOAT16}
# Families trained on 2 workers by a launch of their own (f: the precision
# is the run's); the others share one launch.
ALONE = ("f",)


def config(model_dir, replicas, **fields):
  accum = fields.get("grad_accum_steps", 1)
  return engine.Config.create(
      strategy="one_device" if replicas == 1 else "mirrored",
      cpu_devices=0 if replicas == 1 else replicas,
      batch_size_per_replica=GLOBAL_BATCH // replicas // accum,
      train_steps=STEPS, steps_per_loop=STEPS, log_every=STEPS,
      optimizer="sgd", learning_rate=LR, seed=SEED, export=False,
      summary_every=0, progress=False, model_dir=str(model_dir), **fields)


def eval_values(summary):
  return {k: v for k, v in summary.items()
          if k.startswith("eval_") and k != "eval_examples"}


class Checks:
  """Runs a task's runs and collects every mismatch (and error).

  Args:
    name: for the failure message.
    make_task: () -> engine.Task.
    flags: config fields of every run (family f: its precision).
    parity_flags: more for runs on several replicas (family d: BatchNorm
      over the global batch).
  """

  def __init__(self, name, make_task, flags, parity_flags, tmp_path):
    self.name = name
    self.make_task = make_task
    self.flags = flags
    self.parity_flags = parity_flags
    self.tmp_path = tmp_path
    self.tol = TOLERANCES.get(name, EXACT)
    self.problems = []

  def run(self, label, replicas, **fields):
    """engine.Result of the task on `replicas`, or None (noted)."""
    flags = {**self.flags, **fields}
    if replicas > 1 and "sync_batchnorm" not in fields:
      flags.update(self.parity_flags)
    try:
      return engine.run(self.make_task(), config(
          self.tmp_path / label, replicas, **flags))
    except Exception as e:  # pylint: disable=broad-except
      self.problems.append(f"{label}: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:300]}")
      return None

  def close(self, label, what, got, want, rtol, atol=None):
    """Notes where `got` and `want` (arrays, or lists of arrays) differ by
    more than rtol * |want| + atol; one line for the worst."""
    atol = rtol if atol is None else atol
    pairs = list(zip(got, want)) if isinstance(want, list) else [(got, want)]
    worst, where, bad = 0.0, None, 0
    for k, (a, b) in enumerate(pairs):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      if a.shape != b.shape:
        self.problems.append(f"{label}: {what}[{k}] shape {a.shape} != "
                             f"{b.shape}")
        return
      excess = np.max(np.abs(a - b) / (atol + rtol * np.abs(b)), initial=0)
      bad += excess > 1
      if excess > worst:
        worst, where = excess, (k, np.max(np.abs(a - b)))
    if worst > 1:
      which = (f"{bad} of {len(pairs)} {what} differ, {what}[{where[0]}]"
               if len(pairs) > 1 else f"{what} differ")
      self.problems.append(
          f"{label}: {which} by {worst:.3g}x the tolerance (rtol {rtol:g}, "
          f"atol {atol:g}; max abs {where[1]:.3g})")

  def same_run(self, label, got, want, losses, weights, evaluation=None,
               first=0):
    """Per-step losses from step `first`, final weights, evaluation."""
    if got is None or want is None:
      return
    self.close(label, "losses", got["losses"], want["losses"][first:], losses)
    self.close(label, "weights", list(got["weights"]), list(want["weights"]),
               weights)
    if evaluation is not None:
      keys = sorted(eval_values(want["summary"]))
      self.close(label, f"evaluation {keys}",
                 np.array([got["summary"][k] for k in keys]),
                 np.array([want["summary"][k] for k in keys]), evaluation, 0.0)

  def assert_none(self):
    assert not self.problems, (f"{self.name}:\n  " +
                               "\n  ".join(self.problems))


def as_dict(result):
  if result is None:
    return None
  return dict(losses=result.losses, weights=result.weights,
              summary=result.summary, examples=result.history["examples"],
              history=result.history)


def launch(names, flags, model_dir):
  """Starts families `names` (one task, tests/family_job.py) on 2 workers
  through the launcher, as a user runs a script; a Popen, so that it trains
  while the test's in-process runs do."""
  return forkserver.Popen(
      [sys.executable, "-m", "engine.launch", "--num_workers=2",
       f"--script={SCRIPT}", "--", f"--families={','.join(names)}",
       "--strategy=multi_worker",
       f"--batch_size_per_replica={GLOBAL_BATCH // 2}",
       f"--train_steps={STEPS}", f"--steps_per_loop={STEPS}",
       "--optimizer=sgd", f"--learning_rate={LR}", f"--seed={SEED}",
       "--noexport", "--noprogress", "--summary_every=1", f"--log_every={STEPS}",
       "--weights_out=w.npz", f"--model_dir={model_dir}",
       *[f"--{k}={v}" for k, v in flags.items()]],
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)


def check_workers(checks, proc, model_dir, one):
  """The launched run against 1 replica: per-step losses and metrics
  (TensorBoard's), the weights it wrote, its evaluation."""
  try:
    output, _ = proc.communicate(timeout=240)
  finally:
    if proc.poll() is None:  # SIGTERM: the launcher stops its workers
      proc.terminate()
      try:
        proc.wait(timeout=30)
      finally:
        proc.kill()
  if proc.returncode:
    errors = [l for l in output.splitlines()
              if re.search(r"(\] error|Error): ", l)]
    checks.problems.append(f"2 workers: exit {proc.returncode}: " +
                           " | ".join(errors[-4:])[-1500:])
    return
  if one is None:
    return
  summary = json.loads((model_dir / "summary.json").read_text())
  assert summary["num_workers"] == 2 and summary["num_replicas"] == 2
  scalars = read_scalars(model_dir / "train")
  weights = np.load(model_dir / "w.npz")
  checks.same_run("2 workers", dict(
      losses=[scalars["loss"][s] for s in sorted(scalars["loss"])],
      summary=summary,
      weights=[weights[f"arr_{k}"] for k in range(len(weights.files))]),
                  one, *checks.tol.values())
  metrics = sorted(set(one["history"]) - {"loss", "examples", "grad_norm",
                                          "learning_rate"})
  assert metrics and set(metrics) <= set(scalars), (metrics, sorted(scalars))
  for name in metrics:
    checks.close("2 workers", f"per-step {name}",
                 [scalars[name][s] for s in sorted(scalars[name])],
                 one["history"][name], checks.tol["loss"])


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_family_trains_the_same_everywhere(tmp_path, name):
  family = families.FAMILIES[name]("test")
  checks = Checks(name, family.task, family.flags, family.parity_flags,
                  tmp_path)
  tol = checks.tol
  # Family f alone: its precision is the run's (the other families train on
  # 2 workers together, test_families_train_the_same_on_two_workers).
  workers = (launch([name], {**family.flags, **family.parity_flags},
                    tmp_path / "workers") if name in ALONE else None)
  one = as_dict(checks.run("1_replica", 1))
  if one is not None:
    assert one["examples"].tolist() == EXAMPLES_PER_STEP
    assert one["summary"]["eval_examples"] == 21
  # The uninterrupted 2-replica run also saves the step the resumed one
  # starts from.
  two = as_dict(checks.run("2_replicas", 2, checkpoint_every=RESUME_AT))
  for label, result in (("2_replicas", two),
                        ("4_replicas", as_dict(checks.run("4_replicas", 4)))):
    checks.same_run(label, result, one, tol["loss"], tol["weights"],
                    tol["evaluation"])
    if result is not None:
      checks.close(label, "first step's loss", result["losses"][0],
                   one["losses"][0], 1e-6)
      if result["summary"].get("replica_dependent_randomness"):
        checks.problems.append(
            f"{label}: replica_dependent_randomness "
            f"{result['summary']['replica_dependent_randomness']}")

  if two is not None:
    resumed_dir = tmp_path / "resumed"
    start_from_checkpoint(str(tmp_path / "2_replicas"), str(resumed_dir),
                          RESUME_AT)
    resumed = as_dict(checks.run("resumed", 2))
    if resumed is not None:
      assert resumed["summary"]["start_step"] == RESUME_AT
    checks.same_run("resumed at step 4", resumed, two, 1e-6, 1e-6,
                    evaluation=1e-6, first=RESUME_AT)

  if name == "d":
    # Each BatchNormalization normalizes over a micro-batch, so 2 replicas
    # accumulating 2 micro-batches of 4 rows equal 1 replica accumulating 4
    # micro-batches of 4 (the same rows meet in each), not one batch of
    # 16. --drop_remainder: a partial batch's rows are shared out among
    # replicas before micro-batches are cut, so its groups would differ.
    # Trainable weights only: the moving statistics take K updates a step.
    kw = dict(drop_remainder=True, sync_batchnorm=False)
    accumulated = as_dict(checks.run("accumulated", 2, grad_accum_steps=2,
                                     **kw))
    reference = as_dict(checks.run("accumulated_reference", 1,
                                   grad_accum_steps=4, **kw))
    checks.same_run("grad_accum_steps=2", accumulated, reference,
                    tol["loss"], tol["weights"])
  else:
    checks.same_run("grad_accum_steps=2",
                    as_dict(checks.run("accumulated", 2, grad_accum_steps=2)),
                    one, tol["loss"], tol["weights"], tol["evaluation"])

  if workers is not None:
    check_workers(checks, workers, tmp_path / "workers", one)
  checks.assert_none()


def test_families_train_the_same_on_two_workers(tmp_path):
  """Families a-e as one task (tests/family_job.py: their models side by
  side, the loss the sum of theirs) on 2 workers through the launcher, as 1
  replica trains it: the total loss and each family's loss and metrics per
  step, every family's weights, every evaluation metric."""
  names = [n for n in sorted(families.FAMILIES) if n not in ALONE]
  parity = {k: v for n in names
            for k, v in families.FAMILIES[n]("test").parity_flags.items()}
  checks = Checks("families " + ",".join(names),
                  lambda: family_job.make_task(names), {}, parity, tmp_path)
  workers = launch(names, parity, tmp_path / "workers")
  one = as_dict(checks.run("1_replica", 1))
  if one is not None:
    assert one["examples"].tolist() == EXAMPLES_PER_STEP
    assert {f"{n}_loss" for n in names} <= set(one["history"])
  check_workers(checks, workers, tmp_path / "workers", one)
  checks.assert_none()


def test_bfloat16_gradients_depend_on_the_split():
  """Why family f cannot hold 1e-5: in bfloat16, the gradient of a Dense
  layer over 16 rows is not the sum of its gradients over two halves of 8,
  by far more than float32 rounding; in float32 it is, to 1e-6."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 32)).astype(np.float32)
  for dtype, bound in (("float32", 1e-6), ("bfloat16", None)):
    layer = keras.layers.Dense(32, dtype=keras.DTypePolicy(
        "mixed_bfloat16" if dtype == "bfloat16" else "float32"))
    layer.build((None, 32))

    def grads(rows):
      with tf.GradientTape() as tape:
        y = tf.cast(layer(rows), tf.float32)
        loss = tf.reduce_sum(tf.sin(y))
      return [g.numpy() for g in tape.gradient(loss, layer.trainable_weights)]
    whole = grads(x)
    halves = [a + b for a, b in zip(grads(x[:8]), grads(x[8:]))]
    worst = max(np.max(np.abs(a - b)) / np.max(np.abs(b))
                for a, b in zip(halves, whole))
    if bound:
      assert worst < bound, (dtype, worst)
    else:
      assert worst > 1e-3, (dtype, worst)


def test_a_users_own_random_layer_is_named(tmp_path, caplog):
  """A layer drawing with tf.random (not keras.random) cannot be keyed by
  row: the run names it in summary.json and in one log line."""

  class Noise(keras.layers.Layer):
    def call(self, x, training=False):
      if training:
        return x + 0.1 * tf.random.uniform(tf.shape(x))
      return x

  base = families.FAMILIES["e"]("test").task()
  task = engine.Task(
      model=lambda: keras.Sequential([
          keras.Input((6,)), Noise(name="my_noise"), keras.layers.Dropout(0.2),
          keras.layers.Dense(3)]),
      inputs=base.build_inputs, loss=base.per_example_loss,
      metrics=base.build_metrics(), name="noisy")
  with caplog.at_level(logging.WARNING):
    result = engine.run(task, config(tmp_path, 2, mode="train"))
  assert result.summary["replica_dependent_randomness"] == ["my_noise"]
  lines = [r.getMessage() for r in caplog.records
           if "my_noise" in r.getMessage()]
  assert len(lines) == 1 and "replica_dependent_randomness" in lines[0], lines
