"""Issue 6: accumulation, compression, packing, mixed precision, XLA, sync BN.

In-process on logical CPU devices; the 2-worker cases are in
tests/test_comm_multi_worker.py.
"""
import json

import numpy as np
import pytest
import tensorflow as tf

from conftest import conv_bn_task, run_job, tiny_config, train_batches
from engine.config import Config
from engine.core import model_building, step
from engine.core.optimizers import create_optimizer
from engine.distribute import strategy as strategy_lib
from engine.errors import ConfigError


def max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _dtype(node, ops):
  del ops
  return tf.as_dtype(node.attr["T"].type).name


def traced_collectives(monkeypatch):
  """Patches make_train_loop; returns a function listing, sorted, what
  `describe(node, ops)` says of each collective all-reduce in the traced
  loop (every replica's all-reduce is one op; `ops` maps the names of the
  nodes of the node's function to their ops). By default its dtype."""
  loops = []
  make = step.make_train_loop
  monkeypatch.setattr(step, "make_train_loop",
                      lambda *a, **k: loops.append(make(*a, **k)) or loops[-1])

  def listed(describe=_dtype):
    out = []
    for fn in loops[-1]._list_all_concrete_functions_for_serialization():  # pylint: disable=protected-access
      graph = fn.graph.as_graph_def()
      for nodes in [graph.node] + [f.node_def for f in graph.library.function]:
        ops = {n.name: n.op for n in nodes}
        out += [describe(n, ops) for n in nodes
                if n.op.startswith("CollectiveReduce")]
    return sorted(out)
  return listed


def accumulation_kw(replicas):
  return dict(strategy="mirrored", cpu_devices=replicas, optimizer="sgd",
              learning_rate=0.05, train_steps=4, steps_per_loop=2)


def accumulated(replicas, model_dir):
  """K=4 micro-batches of 8 (global), 4 updates."""
  return run_job(tiny_config(batch_size_per_replica=8 // replicas,
                             grad_accum_steps=4, model_dir=str(model_dir),
                             **accumulation_kw(replicas)))


@pytest.fixture(scope="module")
def accumulated_on_two_replicas(tmp_path_factory):
  """The 2-replica accumulated run: test_accumulation_equals_one_large_batch
  checks it against one large batch, test_jit_compile_matches_plain compiles
  the same run with XLA."""
  return accumulated(2, tmp_path_factory.mktemp("acc2"))


@pytest.mark.parametrize("replicas", [1, 2])
def test_accumulation_equals_one_large_batch(request, tmp_path, replicas):
  """K=4 micro-batches of 8 (global) == one batch of 32, one update each."""
  big = run_job(tiny_config(batch_size_per_replica=32 // replicas,
                            model_dir=str(tmp_path / "big"),
                            **accumulation_kw(replicas)))
  acc = (request.getfixturevalue("accumulated_on_two_replicas")
         if replicas == 2 else accumulated(replicas, tmp_path / "acc"))
  assert acc.summary["global_step"] == 4  # optimizer updates, not batches
  assert acc.summary["global_batch_size"] == 32
  assert acc.summary["grad_accum_steps"] == 4
  np.testing.assert_allclose(acc.losses, big.losses, rtol=1e-5, atol=1e-5)
  assert max_diff(acc.weights, big.weights) < 1e-5


def test_accumulation_with_adam_and_partial_batch(tmp_path):
  """A partial last batch leaves micro-batches short or empty: still exact."""
  kw = dict(cpu_devices=2, synthetic_examples=40, epochs=1, train_steps=0,
            steps_per_loop=1)
  big = run_job(tiny_config(batch_size_per_replica=12,
                                model_dir=str(tmp_path / "big"), **kw))
  acc = run_job(tiny_config(batch_size_per_replica=4, grad_accum_steps=3,
                                model_dir=str(tmp_path / "acc"), **kw))
  assert acc.summary["global_step"] == big.summary["global_step"] == 2
  assert max_diff(acc.weights, big.weights) < 1e-5


COMPRESSION_KW = dict(cpu_devices=2, cross_device_ops="ring", optimizer="sgd",
                     learning_rate=0.1, train_steps=20, steps_per_loop=10)


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
  """(the float32 run on 2 replicas with ring all-reduces, its collectives'
  dtypes): both compression cases compare with it, and
  test_bytes_per_pack_reaches_mirrored[ring] checks its packs of 1024 bytes.

  Packing splits the all-reduce, not the sums: each element is still the sum
  of the same two replicas' values, so the packed run trains as the
  unpacked one (the compression bounds were measured against it unpacked).
  """
  with pytest.MonkeyPatch.context() as monkeypatch:
    collectives = traced_collectives(monkeypatch)
    ref = run_job(tiny_config(
        model_dir=str(tmp_path_factory.mktemp("uncompressed")),
        bytes_per_pack=1024, **COMPRESSION_KW))
    return ref, collectives()


@pytest.mark.parametrize("compression,wire", [("fp16", "float16"),
                                              ("bf16", "bfloat16")])
def test_compression_tolerance_and_wire_dtype(tmp_path, monkeypatch,
                                              uncompressed, compression,
                                              wire):
  ref, ref_collectives = uncompressed
  assert wire not in ref_collectives
  collectives = traced_collectives(monkeypatch)
  got = run_job(tiny_config(grad_compression=compression,
                            model_dir=str(tmp_path / "c"), **COMPRESSION_KW))
  # Per replica: one gradient pack in the compressed dtype and the float32
  # 4-byte example count.
  assert collectives() == sorted([wire] * 2 + ["float32"] * 2)
  assert got.summary["allreduce_bytes"] * 2 == ref.summary["allreduce_bytes"]
  # Measured after 20 SGD steps: weights differ by 6e-4 (fp16) and 7e-4
  # (bf16) at most, where the largest weight is 0.38; losses by 1.5e-4.
  assert max_diff(got.weights, ref.weights) < 5e-3
  np.testing.assert_allclose(got.losses, ref.losses, atol=2e-3)


@pytest.mark.parametrize("cross_device_ops", ["auto", "ring"])
def test_bytes_per_pack_reaches_mirrored(request, tmp_path, monkeypatch,
                                         cross_device_ops):
  """--bytes_per_pack=1024 on 2 replicas; the ring case checks the
  compression tests' float32 run (`uncompressed`), which packs so."""
  if cross_device_ops == "ring":
    result, traced = request.getfixturevalue("uncompressed")
  else:
    collectives = traced_collectives(monkeypatch)
    result = run_job(tiny_config(
        cpu_devices=2, cross_device_ops=cross_device_ops, bytes_per_pack=1024,
        train_steps=2, steps_per_loop=1, model_dir=str(tmp_path)))
    traced = collectives()
  assert result.summary["cross_device_ops"] == cross_device_ops
  packs = result.summary["allreduce_packs"]
  assert packs >= 4
  # One collective per pack and replica (the 4-byte count rides in a pack;
  # the loop's metrics reduce is not a collective on mirrored).
  assert traced == ["float32"] * 2 * packs
  assert result.summary["collectives_per_step"] == packs


def test_bytes_per_pack_refused_where_it_cannot_apply():
  with pytest.raises(ConfigError, match="--bytes_per_pack=4096: "):
    Config.create(cross_device_ops="hierarchical_copy", bytes_per_pack=4096)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_loss_falls(tmp_path, policy):
  result = run_job(tiny_config(
      cpu_devices=2, mixed_precision=policy, learning_rate=0.005,
      batch_size_per_replica=16, train_steps=30, steps_per_loop=10,
      model_dir=str(tmp_path)))
  assert np.isfinite(result.losses).all()
  assert result.losses[-10:].mean() < result.losses[:10].mean() - 0.02
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["mixed_precision"] == policy
  if policy == "mixed_float16":
    # Each overflow step halved the scale (growth needs 2000 finite steps);
    # the skipped steps are no optimizer updates.
    skipped = summary["skipped_steps"]
    assert summary["loss_scale"] == 32768.0 / 2 ** skipped
    assert summary["global_step"] == 30 - skipped


def test_float16_overflow_step_is_skipped_and_recovers():
  """An injected huge loss scale overflows float16: nothing is applied."""
  job = tiny_config(cpu_devices=2, mixed_precision="mixed_float16",
                    learning_rate=0.01)
  config = job.config
  strategy = strategy_lib.make_strategy(config.distribution)
  task = job.task()
  dataset, _ = train_batches(job, 16, with_rows=True)
  with strategy.scope():
    model = model_building.build_model(
        task, mixed_precision=config.optimization.mixed_precision,
        batchnorm=config.batchnorm)
    optimizer = create_optimizer(config.optimization)
    optimizer.build(model.trainable_variables)
  objective = step.resolve(task, model, dataset.element_spec)
  names = step.sum_names(objective)
  loop = step.make_train_loop(strategy, step.make_replica_step(
      objective, model, optimizer, distribution=config.distribution,
      optimization=config.optimization, batchnorm=config.batchnorm,
      batch_size_per_replica=8), names,
      exchange_votes=False)
  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  norm = names.index("grad_norm")
  before = [v.numpy() for v in model.trainable_variables + optimizer.variables]
  optimizer.dynamic_scale.assign(2.0 ** 40)  # scaled logits' grads > 65504
  rows = loop(iterator, tf.constant(1), tf.constant([0.0, 0.0]))[0].numpy()
  after = [v.numpy() for v in model.trainable_variables + optimizer.variables]
  assert int(optimizer.iterations.numpy()) == 0
  assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 39
  changed = [i for i, (a, b) in enumerate(zip(before, after))
             if not np.array_equal(a, b)]
  # Only the loss scale itself changed; weights and slots did not.
  assert [optimizer.variables[i - len(model.trainable_variables)].path
          for i in changed] == [optimizer.dynamic_scale.path]
  assert np.isfinite(rows[0, 0]) and rows[0, norm] == 0.0  # nothing applied
  optimizer.dynamic_scale.assign(2.0 ** 8)
  rows = loop(iterator, tf.constant(3), tf.constant([0.0, 0.0]))[0].numpy()
  assert int(optimizer.iterations.numpy()) == 3
  assert np.isfinite(rows).all() and (rows[:, norm] > 0).all()
  assert max_diff([v.numpy() for v in model.trainable_variables],
                  before) > 1e-4


def test_jit_compile_matches_plain(tmp_path, accumulated_on_two_replicas):
  """XLA-compiled steps (2 replicas, 4 accumulated micro-batches) train as
  the plain run: test_accumulation_equals_one_large_batch[2]'s accumulated
  run."""
  plain = accumulated_on_two_replicas
  xla = run_job(tiny_config(jit_compile=True, batch_size_per_replica=4,
                            grad_accum_steps=4, model_dir=str(tmp_path / "x"),
                            **accumulation_kw(2)))
  assert plain.summary["jit_compile"] is False
  assert xla.summary["jit_compile"] is True
  assert max_diff(xla.weights, plain.weights) < 1e-4


def test_sync_batchnorm_one_and_two_replicas_agree(tmp_path):
  """Global-batch moments: 2 replicas of 8 rows train as one device of 16,
  and without --sync_batchnorm they do not (the comparison can fail).

  A small BatchNorm model rather than MobileNetV2 (45 s for its two runs):
  the property does not depend on the model, and MobileNetV2's 52 layers
  amplify float32 summation order so much that only one step and a 0.05
  weight bound separated the cases; here both steps agree to float32
  rounding (measured 2026-12-05: loss 0.0 and weights 3e-8 apart with sync
  BN; without it the loss is 10% and the weights 0.07 apart).
  """
  import engine  # pylint: disable=g-import-not-at-top
  kw = dict(optimizer="sgd", learning_rate=0.1, train_steps=2,
            steps_per_loop=1, shuffle_buffer=0, export=False)

  def train(name, sync, **fields):
    # 8x8 down to 1x1 maps, where a replica's 8 rows are all its moments see.
    task = conv_bn_task(32, (8, 16, 16), strides=2, name="bn")
    return engine.run(task, Config.create(
        sync_batchnorm=sync, model_dir=str(tmp_path / name), **kw, **fields))
  one = train("1", True, strategy="one_device", batch_size_per_replica=16)
  two = train("2", True, cpu_devices=2, batch_size_per_replica=8)
  local = train("2_local", False, cpu_devices=2, batch_size_per_replica=8)
  assert len(one.losses) == len(two.losses) == 2
  np.testing.assert_allclose(two.losses, one.losses, rtol=1e-5)
  assert max_diff(two.weights, one.weights) < 1e-5
  # Per-replica moments: the same comparison fails.
  assert np.abs(np.asarray(local.losses) / one.losses - 1).max() > 1e-2
  assert max_diff(local.weights, one.weights) > 1e-2


@pytest.mark.parametrize("overrides,flag", [
    (dict(grad_compression="int8"), "grad_compression"),
    (dict(mixed_precision="float16"), "mixed_precision"),
    (dict(grad_accum_steps=0), "grad_accum_steps"),
    (dict(jit_compile=True, sync_batchnorm=True), "jit_compile"),
    (dict(sync_batchnorm=True, grad_accum_steps=2), "sync_batchnorm"),
])
def test_bad_comm_flags(overrides, flag):
  with pytest.raises(ConfigError, match=f"^--{flag}="):
    Config.create(**overrides)


def test_the_gradient_all_reduce_keeps_one_instance_key(tmp_path,
                                                        monkeypatch):
  """TensorFlow keeps a record of every collective instance key it has seen
  (about 1.6 KB per host call on 2 replicas, benchmarks/RESULTS.md "Soak"):
  the gradient all-reduce, whose shapes never change, takes its key when the
  step is traced (a constant in the graph), so its record is one for the
  run; every other collective (here synchronized BatchNorm's) still gets a
  fresh key at every call, and TensorFlow's default is back afterwards."""
  import engine  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import cross_device_utils  # pylint: disable=g-import-not-at-top
  collectives = traced_collectives(monkeypatch)
  result = engine.run(conv_bn_task(32, (8, 16), strides=2, name="bn"),
                      Config.create(
                          sync_batchnorm=True, cpu_devices=2,
                          batch_size_per_replica=8, optimizer="sgd",
                          train_steps=3, steps_per_loop=1, export=False,
                          model_dir=str(tmp_path)))
  assert len(result.losses) == 3  # three host calls
  # What makes each all-reduce's instance key: a constant, or an argument
  # of its function (the key TensorFlow feeds at every call).
  sources = collectives(
      lambda node, ops: ops.get(node.input[3].split(":")[0], "argument"))
  # One gradient pack per replica; per replica and BatchNorm layer (two),
  # the moments' all-reduce and, in the backward pass, its gradient's.
  assert sources == ["Const"] * 2 + ["argument"] * 8, sources
  assert cross_device_utils.CollectiveReplicaLauncher._prefer_unique_instance_key  # pylint: disable=protected-access
