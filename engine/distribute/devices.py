"""Host set-up and the tf.distribute strategy: which replicas, which all-reduce.

`configure_host` must run before TensorFlow executes any op (logical devices
cannot be changed afterwards); `main()` and the test fixture call it once.
"""
import itertools
from typing import Sequence

import tensorflow as tf
# CollectiveAllReduce is the only way to give MirroredStrategy a ring
# collective explicitly; the public API only selects it implicitly.
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils

from engine.config import Config, DistributionConfig
from engine.errors import ConfigError, flag_error

_Impl = tf.distribute.experimental.CommunicationImplementation
_KEY_RANGE = 100_000
_strategies_made = itertools.count(1)


def configure_host(config: Config) -> None:
  """Sets up this host for `config`'s run (`engine.configure_host`): splits
  the CPU into --cpu_devices logical devices. Call it before TensorFlow runs
  any op; the command line does.

  Raises:
    ConfigError: TensorFlow already started with fewer logical CPUs.
  """
  split_cpu(config.distribution.cpu_devices)


def split_cpu(cpu_devices: int) -> None:
  """Splits the host CPU into `cpu_devices` logical devices (0: leave as is).

  Safe to call again in one process: a split that already gives at least
  `cpu_devices` logical CPUs is kept.

  Raises:
    ConfigError: if TensorFlow already started with fewer logical CPUs.
  """
  if cpu_devices <= 0:
    return
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
  except RuntimeError as e:  # already initialised in this process
    have = len(tf.config.list_logical_devices("CPU"))
    if have < cpu_devices:
      raise flag_error("cpu_devices", cpu_devices,
                       f"TensorFlow already started with {have} logical "
                       "CPUs in this process; set it before any op runs."
                       ) from e


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


def make_strategy(config: DistributionConfig) -> tf.distribute.Strategy:
  """Builds the strategy the config names, refusing choices that cannot run.

  Raises:
    ConfigError: for NCCL without GPUs, a missing device, or a bad cluster.
  """
  if config.strategy == "multi_worker":
    from engine.distribute import cluster  # pylint: disable=g-import-not-at-top
    return cluster.make_multi_worker_strategy(config)
  devices = replica_devices(config)
  check_nccl(config.cross_device_ops, devices)
  if config.strategy == "one_device":
    return tf.distribute.OneDeviceStrategy(devices[0])
  # TF starts the collective group keys of every MirroredStrategy at 1, so a
  # second strategy over another device set in the same process (the tests)
  # would join group 1 with the wrong size and abort. Each strategy made here
  # gets its own key range instead.
  key_base = next(_strategies_made) * _KEY_RANGE
  tf.distribute.MirroredStrategy._collective_key_base = key_base  # pylint: disable=protected-access
  return tf.distribute.MirroredStrategy(
      devices, cross_device_ops=_mirrored_cross_device_ops(
          config, devices, key_base + _KEY_RANGE // 2))


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


def _mirrored_cross_device_ops(config: DistributionConfig, devices, key_start: int):
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

