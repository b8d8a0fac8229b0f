"""N replicas must give the weights of 1 replica on the same global batches.

This is the proof that gradients are all-reduced exactly once: a second
reduction would scale every update by the replica count.
"""
import numpy as np
import pytest

from conftest import run_job, tiny_config

GLOBAL_BATCH = 16
STEPS = 4


def run(optimizer, replicas, cross_device_ops="auto", strategy="mirrored",
        **kw):
  # Host calls of --steps_per_loop=auto, the default (engine/core/pace.py).
  config = tiny_config(
      steps_per_loop="auto", strategy=strategy, optimizer=optimizer,
      cpu_devices=replicas,
      cross_device_ops=cross_device_ops,
      learning_rate=0.05 if optimizer == "sgd" else 0.005,
      batch_size_per_replica=GLOBAL_BATCH // replicas, train_steps=STEPS,
      model_dir=kw.pop("model_dir"), **kw)
  return run_job(config)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return {opt: run(opt, 1, strategy="one_device",
                   model_dir=str(tmp_path_factory.mktemp(opt)))
          for opt in ("sgd", "adam")}


def assert_same(result, ref, tol=1e-5):
  # Summation order differs between replica counts, so float32 rounding does
  # too; a double reduction would be off by 100%, not by 1e-5.
  np.testing.assert_allclose(result.losses, ref.losses, rtol=tol, atol=tol)
  for got, want in zip(result.weights, ref.weights):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# Every cross_device_ops on 2 and on 4 replicas, each with sgd on one of the
# two counts and adam on the other (the optimizer acts after the all-reduce,
# so each reduction need not meet each optimizer at each count): sgd is the
# case a double reduction cannot pass (adam is nearly scale-invariant), adam
# checks its slots on mirrored variables; and each count meets both.
# sgd with "auto" on 1 and on 2 replicas (mirrored, against one_device, the
# same tolerance) is test_partial_batch.py's
# test_replicas_match_one_device_with_partial_batches[1] and [2], which
# prove it with partial batches on top; it is not run again here.
@pytest.mark.parametrize("replicas,cross_device_ops,optimizer", [
    (1, "auto", "adam"),
    (2, "ring", "adam"),
    (2, "reduce_to_one_device", "sgd"), (2, "hierarchical_copy", "adam"),
    (4, "auto", "adam"), (4, "ring", "sgd"),
    (4, "reduce_to_one_device", "adam"), (4, "hierarchical_copy", "sgd")])
def test_replicas_match_one_device(reference, tmp_path, optimizer, replicas,
                                   cross_device_ops):
  result = run(optimizer, replicas, cross_device_ops, model_dir=str(tmp_path))
  assert result.summary["num_replicas"] == replicas
  assert result.summary["global_batch_size"] == GLOBAL_BATCH
  assert_same(result, reference[optimizer])


def test_a_double_reduction_would_be_caught(reference, tmp_path):
  """Sanity check of the test itself: doubled gradients do not match (the
  same gradients do: test_replicas_match_one_device's 1-replica case, and
  for sgd test_partial_batch's 1-replica case)."""
  ref = reference["sgd"]
  assert ref.summary["strategy"] == "one_device"
  assert ref.summary["num_replicas"] == 1
  doubled = tiny_config(strategy="one_device", optimizer="sgd",
                        learning_rate=0.1, batch_size_per_replica=GLOBAL_BATCH,
                        train_steps=STEPS, model_dir=str(tmp_path / "2x"))
  other = run_job(doubled)
  diff = max(np.abs(a - b).max() for a, b in zip(other.weights, ref.weights))
  assert diff > 1e-4
