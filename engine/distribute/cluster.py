"""Multi-worker set-up: where the cluster comes from, bounded start-up, lost peers.

The cluster is read from exactly one source, in this order: `--worker_hosts`
with `--task_index`, else a TF_CONFIG in the environment (Kubernetes training
operators, cloud trainers), else SLURM under `srun`. Two sources at once are
refused rather than guessed between.

MultiWorkerMirroredStrategy's constructor blocks until every peer has joined,
and a dead peer can leave a collective waiting for a long time. A watchdog
process bounds both: it exits the process with one line naming the task(s) that
never joined within `--init_timeout`, or that stopped accepting connections
during training.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from absl import logging
import tensorflow as tf
from tensorflow.python.eager import context

from engine.distribute import devices, watchdog
from engine.config import DistributionConfig
from engine.errors import ConfigError, flag_error

# A running peer whose port refuses this many probes in a row is lost; probes
# are _PROBE_SECONDS apart, so a dead peer is noticed in about 3 seconds.
_PROBE_SECONDS = 1.0
_PROBE_FAILURES = 3
# After reporting a lost peer, how long beyond --collective_timeout the
# watchdog process lets the worker stop itself before it ends it.
_GRACE_SECONDS = 10.0
# How long a peer's gRPC server has to answer the probe of `stuck_peers`.
_RESPOND_SECONDS = 2.0
# At the end of a run, how long the coordination service's leader waits for
# the other workers to exit after the last barrier (they exit at once).
_LEAVE_SECONDS = 5.0
_watchdog: Optional["Watchdog"] = None
# (DistributionConfig, strategy): the process's cluster, once joined.
_made = None


def make_multi_worker_strategy(config: DistributionConfig) -> tf.distribute.Strategy:
  """Builds MultiWorkerMirroredStrategy for the cluster the config describes,
  once per process: `engine.configure_host` makes it, before the task is
  made (a task's Keras metric objects or lookup tables run ops, and
  TensorFlow takes the cluster's collectives only before its first op), and
  `engine.run` gets the same one.

  Raises:
    ConfigError: for a bad or conflicting cluster, a busy port, or NCCL
      without GPUs, or a second cluster in one process.
  """
  global _made
  if _made is not None:
    if _made[0] != config:
      raise ConfigError(
          "this process already joined a cluster with other distribution "
          "settings (engine.configure_host's config); a process trains on "
          "one cluster: pass the same Config to configure_host and run.")
    return _made[1]
  resolver = cluster_resolver(config, os.environ)
  spec = resolver.cluster_spec().as_dict()
  me = (resolver.task_type, resolver.task_id)
  addresses = task_addresses(spec)
  own = addresses[me]
  check_own_address(own)
  # Physical devices only: listing logical ones would start the TF context,
  # and MWMS must configure collectives before that. MWMS itself uses every
  # local GPU, else the CPU, one replica each.
  gpus = tf.config.list_physical_devices("GPU")
  local = [f"/gpu:{i}" for i in range(len(gpus))] or ["/cpu:0"]
  devices.check_nccl(config.cross_device_ops, local)
  logging.info("Cluster %s; this task is %s:%d (%s), %d replica(s) per worker.",
               json.dumps(spec), me[0], me[1], own, len(local))
  global _watchdog
  _watchdog = Watchdog(addresses, me, config.init_timeout,
                       grace=config.collective_timeout + _GRACE_SECONDS)
  _watchdog.start()
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      cluster_resolver=resolver,
      communication_options=devices.communication_options(config))
  _watchdog.joined()
  logging.info("All %d workers joined: %d replicas in total.",
               len(addresses), strategy.num_replicas_in_sync)
  _made = (config, strategy)
  return strategy


def stop_watchdog() -> None:
  """Called after the last collective: peers may now exit in any order."""
  if _watchdog is not None:
    _watchdog.stop()


def meet_peers(timeout: float) -> None:
  """Waits until every worker has ended its run, at most `timeout` seconds.

  The command line calls it once a run ended the same way on every worker
  (done, preempted, stopped for a resource, diverged), just before the
  process exits without TensorFlow's teardown (engine/ending.py). A worker
  that is done may still be needed: a peer's last collective can still be
  reading from its gRPC server, and the leader task (the chief, or worker 0)
  hosts TensorFlow's coordination service, whose heartbeats every worker
  sends. So every worker waits at a barrier of that service, and the leader
  then waits (up to _LEAVE_SECONDS) for the others' ports to close before
  it goes, so that no worker is left waiting for the barrier's answer.

  A peer that never comes (it failed after the last collective; its own exit
  code says so) costs `timeout` seconds and a warning: this worker's outputs
  are written, so its exit code stays its own. Off a cluster it does nothing.
  """
  if _watchdog is None:
    return
  stop_watchdog()
  try:
    context.context().wait_at_barrier("tfengine_end", int(timeout * 1000))
  except tf.errors.OpError as e:
    logging.warning("not every worker reached the end of the run within "
                    "%g s (%s); exiting: this worker's outputs are written.",
                    timeout, _first_line(e, str(e.message)))
    return
  if _watchdog.leader:
    deadline = time.monotonic() + _LEAVE_SECONDS
    while (time.monotonic() < deadline and
           any(watchdog.accepts(a, 0.5) for a in _watchdog.peers.values())):
      time.sleep(0.02)


def peer_messages():
  """The watchdog process's reports (`lost ...` lines), or None off a cluster."""
  return _watchdog.messages if _watchdog is not None else None


def stuck_peers_line() -> Optional[str]:
  """Names the peers whose gRPC server no longer answers, for engine/distribute/hang.py.

  Called once a host call has outlived its bound: a peer that is stopped
  (SIGSTOP), swapped out or frozen still has its port accepting connections,
  so only a request that needs an answer tells it apart.
  """
  peers = _watchdog.peers if _watchdog is not None else {}
  stuck = [t for t, a in peers.items()
           if not watchdog.responds(a, _RESPOND_SECONDS)]
  if not stuck:
    return None
  return (f"lost task {_names(stuck, peers)}: it stopped responding during "
          "training (its gRPC server did not answer within "
          f"{_RESPOND_SECONDS:g} s); stopping this worker too.")


def cluster_resolver(config: DistributionConfig, environ):
  """The one cluster source that is set; see the module docstring.

  Raises:
    ConfigError: none or several sources, or a malformed one.
  """
  has_tf_config = bool(environ.get("TF_CONFIG"))
  under_slurm = "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ
  if config.worker_hosts:
    if has_tf_config:
      raise flag_error("worker_hosts", ",".join(config.worker_hosts),
                       "conflicts with TF_CONFIG in the environment; use one "
                       "of them (unset TF_CONFIG or drop --worker_hosts).")
    hosts = check_worker_hosts(config.worker_hosts, config.task_index)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": hosts}), task_type="worker",
        task_id=config.task_index, rpc_layer="grpc")
  if config.task_index >= 0:
    raise flag_error("task_index", config.task_index,
                     "needs --worker_hosts; with TF_CONFIG or SLURM the task "
                     "comes from there.")
  if has_tf_config:
    if under_slurm:
      raise ConfigError("TF_CONFIG is set and this is a SLURM step; the "
                        "cluster would be ambiguous, unset TF_CONFIG.")
    return _tf_config_resolver(environ["TF_CONFIG"])
  if under_slurm:
    return tf.distribute.cluster_resolver.SlurmClusterResolver(
        rpc_layer="grpc")
  raise flag_error("strategy", "multi_worker",
                   "needs a cluster: --worker_hosts with --task_index, "
                   "TF_CONFIG in the environment, or a SLURM srun step.")


def check_worker_hosts(hosts, task_index: int, resolve: bool = True
                       ) -> List[str]:
  """Refuses malformed, duplicate or (if `resolve`) unresolvable hosts and a
  bad index."""
  flag = ",".join(hosts)
  for h in hosts:
    host, sep, port = h.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise flag_error("worker_hosts", flag,
                       f"'{h}' is not host:port with a port in 1-65535.")
  dupes = sorted({h for h in hosts if list(hosts).count(h) > 1})
  if dupes:
    raise flag_error("worker_hosts", flag,
                     f"lists {', '.join(dupes)} more than once; each worker "
                     "needs its own host:port.")
  if not 0 <= task_index < len(hosts):
    raise flag_error("task_index", task_index,
                     f"must be in 0..{len(hosts) - 1} for {len(hosts)} "
                     "--worker_hosts.")
  for h in hosts if resolve else ():
    host, _, port = h.rpartition(":")
    try:
      socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
      raise flag_error("worker_hosts", flag,
                       f"host '{host}' does not resolve ({e.strerror}).") from e
  return list(hosts)


def _tf_config_resolver(text: str):
  try:
    tf_config = json.loads(text)
    spec = tf_config["cluster"]
    task = tf_config["task"]
    task_type, task_id = task["type"], int(task["index"])
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"TF_CONFIG is not valid JSON with 'cluster' and "
                      f"'task': {e}") from e
  if task_id >= len(spec.get(task_type, ())):
    raise ConfigError(f"TF_CONFIG task {task_type}:{task_id} is not in its "
                      f"cluster {json.dumps(spec)}.")
  # Names are not resolved: a Kubernetes operator's pod names may only
  # resolve once the pods run; the init timeout covers that case.
  for job in spec.values():
    check_worker_hosts(job, 0, resolve=False)
  return tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(spec), task_type=task_type, task_id=task_id,
      rpc_layer=tf_config.get("rpc_layer", "grpc"))


def task_addresses(spec: Dict[str, list]) -> Dict[tuple, str]:
  return {(job, i): addr for job, tasks in spec.items()
          for i, addr in enumerate(tasks)}


def check_own_address(address: str) -> None:
  """Binds this task's host:port once, so a busy port fails before TF starts."""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    try:
      s.bind((host, int(port)))
    except OSError as e:
      raise ConfigError(f"this task's address {address} cannot be bound "
                        f"({e.strerror}): the port is in use or the host is "
                        "not an address of this machine.") from e


class Watchdog:
  """Handle on the watchdog process (engine/distribute/watchdog.py, which explains why).

  Before `joined()`: if `init_timeout` passes, it names the peers whose ports
  never accepted a TCP connection. After: it probes every peer's port and names
  the first that refuses `_PROBE_FAILURES` probes in a row. A killed worker's
  port refuses at once, so this is far quicker than a collective timeout.
  """

  def __init__(self, addresses: Dict[tuple, str], me: tuple,
               init_timeout: float, grace: float):
    self.peers = {k: v for k, v in addresses.items() if k != me}
    # Whether this task hosts TensorFlow's coordination service (TF's
    # multi_worker_util.coordination_leader: the chief, else worker 0).
    self.leader = me == (("chief", 0) if ("chief", 0) in addresses else
                         ("worker", 0))
    self._args = [str(os.getpid()), str(init_timeout), str(_PROBE_SECONDS),
                  str(_PROBE_FAILURES), str(grace),
                  json.dumps({f"{t}:{i}": a for (t, i), a in
                              self.peers.items()})]
    self._proc = None
    self.messages = None  # its stdout: `lost ...` lines for engine/distribute/hang.py

  def start(self):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "watchdog.py")
    self._proc = subprocess.Popen([sys.executable, script, *self._args],
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    self.messages = self._proc.stdout

  def _say(self, word):
    if self._proc is not None and self._proc.poll() is None:
      self._proc.stdin.write(word + "\n")
      self._proc.stdin.flush()

  def joined(self):
    self._say("joined")

  def stop(self):
    self._say("stop")
    if self._proc is not None:
      self._proc.stdin.close()
      self._proc.wait(10)
      # Its stdout stays open: the hang watchdog may still be reading it,
      # and sees EOF now that the process has ended.
      self._proc = None


# What TensorFlow's error text says about a lost peer, in the line's words.
_CAUSES = (
    ("stopped sending heartbeats",
     "it stopped sending heartbeats to TensorFlow's coordination service"),
    ("Socket closed", "its connection closed"),
    ("Connection reset", "its connection was reset"),
    ("Connection refused", "it refused connections"),
    ("failed to connect", "it refused connections"),
)


def failure_line(error: Exception, collective_timeout: float) -> str:
  """One line for a failed collective, naming the lost task where it can.

  TF names the remote task in the gRPC or coordination-service error;
  failing that, the peers whose ports refuse a connection right now are
  named.
  """
  text = str(getattr(error, "message", error))
  peers = _watchdog.peers if _watchdog is not None else {}
  named = [(job, int(i)) for job, i in
           re.findall(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)", text)]
  lost = [t for t in dict.fromkeys(named) if t in peers]
  if not lost:
    lost = [t for t, a in peers.items() if not watchdog.accepts(a)]
  cause = next((words for key, words in _CAUSES if key in text), None)
  if lost:
    return (f"lost task {_names(lost, peers)}: "
            f"{cause or 'a collective failed: ' + _first_line(error, text)}"
            "; stopping this worker too.")
  return (f"a collective failed or exceeded --collective_timeout="
          f"{collective_timeout:g}: {cause or _first_line(error, text)}")


def _first_line(error: Exception, text: str) -> str:
  """The first line of TF's message that says something (not where)."""
  skip = ("Graph execution error", "Detected at node", "File ", "[[",
          "The error could be from")
  for line in text.splitlines():
    line = line.strip().replace("Collective ops is aborted by: ", "")
    if line and not line.startswith(skip):
      return line
  return type(error).__name__


def _names(tasks, addresses) -> str:
  return ", ".join(f"{t}:{i} ({addresses[(t, i)]})" for t, i in tasks)


