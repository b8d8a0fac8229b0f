"""All-reduce benchmark in the style of nccl-tests: `python -m benchmarks.allreduce`.

For message sizes from --min_bytes to --max_bytes (x --factor each row) it
times a float32 SUM all-reduce through `ReplicaContext.all_reduce`, the call
the train step makes, for every cross_device_ops that runs here:

* mirrored on --cpu_devices logical CPU devices (GPUs where there are any),
* --workers workers through `engine.launch` (MultiWorkerMirroredStrategy),
* and the same bytes through one plain loopback TCP stream, the ceiling.

Columns as nccl-tests: time per all-reduce, algbw = bytes / time, busbw =
algbw * 2(n-1)/n (what each replica's link carries in a ring, comparable
across replica counts), and vs_tcp = busbw / loopback TCP bandwidth at that
size. A standalone command with its own argparse, like engine.launch.
"""
import argparse
import os
import resource
import socket
import subprocess
import sys
import threading
import time

_REPS = 4  # chained all-reduces per host call, to amortise dispatch
MIRRORED_OPS = ("auto", "ring", "hierarchical_copy", "reduce_to_one_device")
WORKER_OPS = ("auto", "ring")
HEADER = ("%-30s %10s %9s %11s %11s %11s %7s" %
          ("impl", "size(B)", "count", "time(us)", "algbw(GB/s)",
           "busbw(GB/s)", "vs_tcp"))


def sizes(args):
  out, s = [], args.min_bytes
  while s <= args.max_bytes:
    out.append(s)
    s *= args.factor
  return out


def time_all_reduce(strategy, nbytes: int, iters: int, options):
  """Seconds per all-reduce of `nbytes` float32 bytes, and CPU seconds."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = nbytes // 4

  def replica_fn(one):
    ctx = tf.distribute.get_replica_context()
    # From a run-time input: grappler would fold a constant's copy-based sum.
    x = tf.fill([n], tf.cast(ctx.replica_id_in_sync_group, tf.float32) + one)
    for _ in range(_REPS):  # unrolled: merge_call cannot sit in a while loop
      x = ctx.all_reduce(tf.distribute.ReduceOp.SUM, x, options=options)
    return x[0]

  @tf.function
  def run(one):
    return strategy.experimental_local_results(
        strategy.run(replica_fn, args=(one,)))

  one = tf.constant(1.0)

  expected = sum(range(1, strategy.num_replicas_in_sync + 1)) * (
      strategy.num_replicas_in_sync ** (_REPS - 1))
  got = float(run(one)[0].numpy())  # trace and warm up
  if abs(got - expected) > 1e-3 * expected:
    raise RuntimeError(f"all-reduce gave {got}, want {expected}")
  cpu0, start = _cpu_seconds(), time.perf_counter()
  for _ in range(iters):
    run(one)[0].numpy()
  wall = time.perf_counter() - start
  return wall / (iters * _REPS), (_cpu_seconds() - cpu0) / (iters * _REPS)


def _cpu_seconds():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def tcp_seconds(nbytes: int, iters: int) -> float:
  """Seconds per `nbytes` message streamed through one loopback TCP socket."""
  server = socket.create_server(("127.0.0.1", 0))
  sender = socket.create_connection(server.getsockname())
  receiver, _ = server.accept()
  payload, buf = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))

  def receive(messages):
    for _ in range(messages):
      got = 0
      while got < nbytes:
        got += receiver.recv_into(buf[got:], min(nbytes - got, 1 << 22))

  try:
    receive_thread = threading.Thread(target=receive, args=(1,))
    receive_thread.start()  # warm-up message
    sender.sendall(payload)
    receive_thread.join()
    receive_thread = threading.Thread(target=receive, args=(iters,))
    start = time.perf_counter()
    receive_thread.start()
    for _ in range(iters):
      sender.sendall(payload)
    receive_thread.join()
    return (time.perf_counter() - start) / iters
  finally:
    for s in (sender, receiver, server):
      s.close()


def row(impl, nbytes, seconds, replicas, tcp):
  algbw = nbytes / seconds / 1e9
  busbw = algbw * 2 * (replicas - 1) / replicas
  ratio = busbw / (nbytes / tcp / 1e9) if tcp else float("nan")
  return "%-30s %10d %9d %11.1f %11.3f %11.3f %7.3f" % (
      impl, nbytes, nbytes // 4, seconds * 1e6, algbw, busbw, ratio)


def iters_for(nbytes: int, args) -> int:
  return max(2, min(args.iters, (64 << 20) * 4 // nbytes))


def bench_mirrored(args, tcp):
  from engine.config import DistributionConfig  # pylint: disable=g-import-not-at-top
  from engine.distribute import devices  # pylint: disable=g-import-not-at-top
  from engine.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  from engine.host import cpus, memory  # pylint: disable=g-import-not-at-top
  cpus.split_cpu(args.cpu_devices)
  memory.tune_malloc()  # as training does
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = len(tf.config.list_logical_devices("GPU"))
  ops = list(args.ops or MIRRORED_OPS)
  if gpus and "nccl" not in ops:
    ops.append("nccl")
  where = f"{gpus} GPU(s)" if gpus else f"{args.cpu_devices} logical CPUs"
  note = " (1 replica: busbw is 0 by definition)" if gpus == 1 else ""
  print(f"# mirrored, {where}{note}", flush=True)
  print(HEADER)
  for op in ops:
    config = DistributionConfig(cpu_devices=0 if gpus else args.cpu_devices,
                                cross_device_ops=op)
    strategy = strategy_lib.make_strategy(config)
    name = f"mirrored/{op}"
    for nbytes in sizes(args):
      seconds, _ = time_all_reduce(strategy, nbytes, iters_for(nbytes, args),
                                   devices.communication_options(config))
      print(row(name, nbytes, seconds, strategy.num_replicas_in_sync,
                tcp[nbytes]), flush=True)


def bench_workers(args, tcp):
  """Runs this module's --worker_mode in --workers processes via the launcher."""
  print(f"# multi_worker, {args.workers} workers through engine.launch "
        "(one CPU replica each)", flush=True)
  print(HEADER)
  for op in args.worker_ops:
    cmd = [sys.executable, "-m", "engine.launch",
           f"--num_workers={args.workers}", "--module=benchmarks.allreduce",
           "--", "--worker_mode", f"--cross_device_ops={op}",
           f"--min_bytes={args.min_bytes}", f"--max_bytes={args.max_bytes}",
           f"--factor={args.factor}", f"--iters={args.iters}",
           "--tcp=" + ",".join(f"{k}:{v!r}" for k, v in tcp.items())]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         timeout=args.timeout,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    rows = [l.split("] ", 1)[1] for l in out.stdout.splitlines()
            if l.startswith("[worker 0] ") and l.split("] ", 1)[1].startswith(
                ("multi_worker/", "# cpu"))]
    if out.returncode != 0 or not rows:
      sys.exit(f"error: 2-worker benchmark ({op}) failed:\n"
               f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
    print("\n".join(rows), flush=True)


def worker_main(args):
  """One worker: builds MWMS as training does, prints rows (chief's kept)."""
  from engine.config import DistributionConfig  # pylint: disable=g-import-not-at-top
  from engine.distribute import cluster, devices  # pylint: disable=g-import-not-at-top
  from engine.host import memory  # pylint: disable=g-import-not-at-top
  config = DistributionConfig(
      strategy="multi_worker", cross_device_ops=args.cross_device_ops,
      worker_hosts=tuple(args.worker_hosts.split(",")),
      task_index=args.task_index, collective_timeout=600.0)
  strategy = cluster.make_multi_worker_strategy(config)
  memory.tune_malloc()  # as training does
  tcp = {int(k): float(v) for k, v in
         (item.split(":") for item in args.tcp.split(",") if item)}
  for nbytes in sizes(args):
    last = nbytes == sizes(args)[-1]
    if last and args.profile_dir and args.task_index == 0:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      tf.profiler.experimental.start(args.profile_dir)
    seconds, cpu = time_all_reduce(strategy, nbytes, iters_for(nbytes, args),
                                   devices.communication_options(config))
    if last and args.profile_dir and args.task_index == 0:
      tf.profiler.experimental.stop()
    print(row(f"multi_worker/{args.cross_device_ops}", nbytes, seconds,
              strategy.num_replicas_in_sync, tcp.get(nbytes)), flush=True)
    if last:
      # Where the time goes: a worker busy for the whole all-reduce is
      # bound by its own CPU (copies, serialisation), not by waiting.
      print(f"# cpu: {nbytes} B all-reduce: {seconds * 1e3:.1f} ms wall, "
            f"{cpu * 1e3:.1f} ms CPU in this worker "
            f"({cpu / seconds:.2f} cores busy)", flush=True)
  cluster.stop_watchdog()


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks.allreduce")
  p.add_argument("--min_bytes", type=int, default=4 << 10)
  p.add_argument("--max_bytes", type=int, default=64 << 20)
  p.add_argument("--factor", type=int, default=4,
                 help="size ratio between rows (nccl-tests -f)")
  p.add_argument("--iters", type=int, default=20,
                 help="timed host calls per size (fewer for large sizes)")
  p.add_argument("--cpu_devices", type=int, default=2)
  p.add_argument("--workers", type=int, default=2,
                 help="0 skips the multi-worker table")
  p.add_argument("--ops", default="",
                 help="comma-separated mirrored cross_device_ops to run")
  p.add_argument("--worker_ops", default=",".join(WORKER_OPS),
                 help="comma-separated multi_worker cross_device_ops to run")
  p.add_argument("--timeout", type=float, default=600.0,
                 help="seconds the whole multi-worker run may take")
  # Worker mode, set by bench_workers and engine.launch.
  p.add_argument("--worker_mode", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--strategy", help=argparse.SUPPRESS)
  p.add_argument("--worker_hosts", help=argparse.SUPPRESS)
  p.add_argument("--task_index", type=int, help=argparse.SUPPRESS)
  p.add_argument("--cross_device_ops", default="ring", help=argparse.SUPPRESS)
  p.add_argument("--tcp", default="", help=argparse.SUPPRESS)
  p.add_argument("--profile_dir", default="",
                 help="worker mode: TF profiler trace of the largest size on "
                 "worker 0 (summarise with benchmarks/xplane_summary.py)")
  args = p.parse_args(argv)
  args.ops = tuple(o for o in args.ops.split(",") if o)
  args.worker_ops = tuple(o for o in args.worker_ops.split(",") if o)
  if args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.factor < 2:
    p.error("need 4 <= --min_bytes <= --max_bytes and --factor >= 2")
  return args


def main(argv=None):
  args = parse(sys.argv[1:] if argv is None else argv)
  if args.worker_mode:
    return worker_main(args)
  tcp = {n: tcp_seconds(n, iters_for(n, args)) for n in sizes(args)}
  print("# loopback TCP, one stream (the ceiling)")
  print("%-30s %10s %11s %11s" % ("impl", "size(B)", "time(us)", "GB/s"))
  for n, s in tcp.items():
    print("%-30s %10d %11.1f %11.3f" % ("tcp/loopback", n, s * 1e6,
                                         n / s / 1e9), flush=True)
  bench_mirrored(args, tcp)
  if args.workers:
    bench_workers(args, tcp)


if __name__ == "__main__":
  main()
