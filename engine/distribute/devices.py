"""Which devices hold the replicas, and which all-reduce joins them.

The strategy is made in engine/distribute/strategy.py; the logical CPU
devices that serve as replicas on a machine without GPUs are made by
engine/host/cpus.py before TensorFlow runs any op.
"""
from typing import Sequence

import tensorflow as tf
# CollectiveAllReduce is the only way to give MirroredStrategy a ring
# collective explicitly; the public API only selects it implicitly.
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils

from engine.config import DistributionConfig
from engine.errors import ConfigError, flag_error

_Impl = tf.distribute.experimental.CommunicationImplementation


def replica_devices(config: DistributionConfig) -> tuple:
  """The local devices that hold one replica each, validated.

  Raises:
    ConfigError: for a device that does not exist.
  """
  logical = {_canonical(d.name): d.name
             for d in tf.config.list_logical_devices()}
  if config.devices:
    for d in config.devices:
      if _canonical(d) not in logical:
        raise flag_error(
            "devices", ",".join(config.devices),
            f"{d} does not exist here; this host has "
            f"{', '.join(sorted(logical.values())) or 'no devices'}.")
    return tuple(config.devices)
  cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
  if config.cpu_devices:
    return tuple(cpus[:config.cpu_devices])
  gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
  return tuple(gpus) if gpus else (cpus[0],)


def check_nccl(choice: str, devices: Sequence[str]) -> None:
  """NCCL only has GPU kernels; fail here rather than deep inside the graph."""
  if choice == "nccl" and not all(":gpu:" in _canonical(d) for d in devices):
    raise flag_error(
        "cross_device_ops", choice,
        f"NCCL needs GPUs, but the replicas are {', '.join(devices)}; "
        "use --cross_device_ops=ring or auto.")


def communication_options(config: DistributionConfig):
  """Options passed to every explicit all-reduce (packing, algorithm).

  No `timeout_seconds`, here or anywhere: TensorFlow keeps one sleeping
  thread per collective op for the whole timeout (tensorflow#62466), which
  made long runs die of thread exhaustion. engine/distribute/hang.py bounds the host
  calls instead, with one thread per process.
  """
  impl = {"nccl": _Impl.NCCL, "ring": _Impl.RING}.get(
      config.cross_device_ops, _Impl.AUTO)
  return tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=config.bytes_per_pack, implementation=impl)


def mirrored_cross_device_ops(config: DistributionConfig, devices,
                              key_start: int):
  """MirroredStrategy's cross-device ops for --cross_device_ops (None: TF's
  own choice); a ring's collective group keys start at `key_start`."""
  choice = config.cross_device_ops
  num_packs = 1
  if choice == "auto":
    # TF's default for MirroredStrategy: collective all-reduce, NCCL on
    # physical GPUs and ring otherwise.
    return None
  if choice == "ring":
    return cross_device_ops_lib.CollectiveAllReduce(
        devices=devices, group_size=len(devices),
        options=communication_options(config),
        collective_keys=cross_device_utils.CollectiveKeys(
            group_key_start=key_start))
  if choice == "nccl":
    return tf.distribute.NcclAllReduce(num_packs=num_packs)
  if choice == "hierarchical_copy":
    return tf.distribute.HierarchicalCopyAllReduce(num_packs=num_packs)
  if choice == "reduce_to_one_device":
    return tf.distribute.ReductionToOneDevice()
  raise ConfigError(f"--cross_device_ops={choice}: unknown.")


def describe(strategy: tf.distribute.Strategy) -> str:
  """The cross-device implementation actually in use, for logs and summary."""
  ops = getattr(strategy.extended, "_cross_device_ops", None)
  if ops is None:
    return "none (one device)"
  name = type(ops).__name__
  options = getattr(ops, "_options", None)
  if options is not None and hasattr(options, "implementation"):
    name += f"({options.implementation.name})"
  return name


def _canonical(name: str) -> str:
  """'/gpu:0' and '/job:localhost/replica:0/task:0/device:GPU:0' -> ':gpu:0'."""
  name = name.lower()
  name = name.split("device:")[-1] if "device:" in name else name.lstrip("/")
  return ":" + name

