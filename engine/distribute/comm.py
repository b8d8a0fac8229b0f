"""What one gradient all-reduce moves, logged at the start and in summary.json.

The step itself is in engine/core/step.py; this module only describes it: bytes on
the wire per all-reduce (after `--grad_compression`), the number of packs
`--bytes_per_pack` gives, and at the end the loss scale and skipped steps of
float16 loss scaling.
"""
import re

from absl import logging
import tensorflow as tf
# group_by_size is how CollectiveAllReduce packs; reusing it keeps the logged
# pack count equal to the number of collectives TF actually launches.
from tensorflow.python.distribute import cross_device_utils

from engine import hooks
from engine.config import DistributionConfig, OptimizationConfig

# --grad_compression: the dtype gradients have on the wire (None: float32).
WIRE_DTYPES = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}


def gradient_bytes(variables, config: DistributionConfig):
  """(bytes, packs): gradient bytes one replica puts into one all-reduce.

  The example count (4 bytes) is not included; packs count the collective
  all-reduces of the gradients (auto, ring, nccl; the copy-based reductions
  do not pack).
  """
  dtype = WIRE_DTYPES[config.grad_compression] or tf.float32
  specs = [tf.TensorSpec(v.shape, dtype) for v in variables]
  total = sum(s.shape.num_elements() * dtype.size for s in specs)
  # CollectiveAllReduce packs the values in reverse (last gradient first).
  packs = cross_device_utils.group_by_size(specs[::-1], config.bytes_per_pack)
  return total, len(packs)


# Ops that move data between replicas (not the group set-up ops).
_COLLECTIVE = re.compile(r"^(Collective(Reduce|Gather|Bcast|AllToAll)|Nccl)")


def collectives_per_step(concrete_function, local_replicas: int) -> float:
  """Collective ops one replica launches per step of the compiled loop.

  Counted in the traced graph: the loop body (a `while_body` function) and
  every function it calls, divided by the replicas of this worker. The
  gradient all-reduce is one per pack; anything else (a per-step metrics
  reduce, the distributed iterator's "has every worker data?" check for a
  data set that might end) shows up here as more.
  """
  library = {f.signature.name: f
             for f in concrete_function.graph.as_graph_def().library.function}
  todo = [name for name in library if name.startswith("while_body")]
  seen, count = set(todo), 0
  while todo:
    for node in library[todo.pop()].node_def:
      count += bool(_COLLECTIVE.match(node.op))
      called = [node.op] + [a.func.name for a in node.attr.values()]
      for name in called:
        if name in library and name not in seen:
          seen.add(name)
          todo.append(name)
  return count / local_replicas


class CommHook(hooks.Hook):
  """Logs the all-reduce size once; adds the communication keys to the summary."""

  def __init__(self, distribution: DistributionConfig,
               optimization: OptimizationConfig, batch_size_per_replica: int,
               optimizer, variables, replicas: int, sync_batchnorm: bool):
    self._dist = distribution
    self._sync_batchnorm = sync_batchnorm
    self._opt = optimization
    self._optimizer = optimizer
    self._bytes, self._packs = gradient_bytes(variables, distribution)
    self._steps_run = 0
    dtype = WIRE_DTYPES[distribution.grad_compression] or tf.float32
    # A ring all-reduce sends 2(n-1)/n of the buffer from every replica.
    sent = 2 * (replicas - 1) / replicas * self._bytes
    logging.info(
        "Each step all-reduces %d gradient bytes (%s) per replica in %d "
        "pack(s) (--bytes_per_pack=%d); a ring sends %.0f bytes per replica. "
        "%d micro-batch(es) of %d per replica per update; mixed precision "
        "%s; XLA %s; sync BatchNorm %s.", self._bytes, dtype.name,
        self._packs, distribution.bytes_per_pack, sent,
        optimization.grad_accum_steps, batch_size_per_replica,
        optimization.mixed_precision,
        "on" if optimization.jit_compile else "off",
        "on" if sync_batchnorm else "off")

  def after_loop(self, step, rows, seconds):
    self._steps_run += len(rows)

  def end(self, summary):
    summary.update({
        "grad_accum_steps": self._opt.grad_accum_steps,
        "grad_compression": self._dist.grad_compression,
        "allreduce_bytes": self._bytes,
        "allreduce_packs": self._packs,
        "mixed_precision": self._opt.mixed_precision,
        "jit_compile": self._opt.jit_compile,
        "sync_batchnorm": self._sync_batchnorm,
    })
    if self._opt.loss_scaling:
      summary["loss_scale"] = float(self._optimizer.dynamic_scale.numpy())
      # Host steps whose update was skipped because a gradient overflowed.
      summary["skipped_steps"] = self._steps_run - (
          summary["global_step"] - summary["start_step"])
