"""The host's logical CPU devices: `engine.configure_host(config)`.

It must run before TensorFlow executes any op (logical devices cannot be
changed afterwards); the command line and the test fixture call it once per
process.
"""
import tensorflow as tf

from engine.config import Config
from engine.errors import flag_error
from engine.host import memory


def configure_host(config: Config) -> None:
  """Sets up this host for `config`'s run (`engine.configure_host`): chooses
  the CPU tensors' allocator (--cpu_allocator), splits the CPU into
  --cpu_devices logical devices and, with
  --strategy=multi_worker, joins the cluster (TensorFlow configures the
  collectives only before its first op, and a task's Keras metric objects
  or lookup tables run ops when they are made). Call it before TensorFlow
  runs any op; the command line does, before it makes the task.

  Raises:
    ConfigError: TensorFlow already started with fewer logical CPUs, or the
      cluster cannot be joined.
  """
  memory.use_cpu_allocator(config.host.cpu_allocator)
  split_cpu(config.distribution.cpu_devices)
  if config.distribution.strategy == "multi_worker":
    from engine.distribute import cluster  # pylint: disable=g-import-not-at-top
    cluster.make_multi_worker_strategy(config.distribution)


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
