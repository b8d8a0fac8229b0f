"""`make_strategy`: the tf.distribute strategy --strategy names.

one_device and mirrored over this host's replica devices (devices.py),
multi_worker over the cluster (cluster.py).
"""
import itertools

import tensorflow as tf

from engine.config import DistributionConfig
from engine.distribute import cluster, devices

_KEY_RANGE = 100_000
_strategies_made = itertools.count(1)


def make_strategy(config: DistributionConfig) -> tf.distribute.Strategy:
  """Builds the strategy the config names, refusing choices that cannot run.

  Raises:
    ConfigError: for NCCL without GPUs, a missing device, or a bad cluster.
  """
  if config.strategy == "multi_worker":
    return cluster.make_multi_worker_strategy(config)
  replicas = devices.replica_devices(config)
  devices.check_nccl(config.cross_device_ops, replicas)
  if config.strategy == "one_device":
    return tf.distribute.OneDeviceStrategy(replicas[0])
  # TF starts the collective group keys of every MirroredStrategy at 1, so a
  # second strategy over another device set in the same process (the tests)
  # would join group 1 with the wrong size and abort. Each strategy made here
  # gets its own key range instead.
  key_base = next(_strategies_made) * _KEY_RANGE
  tf.distribute.MirroredStrategy._collective_key_base = key_base  # pylint: disable=protected-access
  return tf.distribute.MirroredStrategy(
      replicas, cross_device_ops=devices.mirrored_cross_device_ops(
          config, replicas, key_base + _KEY_RANGE // 2))
