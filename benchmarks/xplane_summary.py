"""Where the time goes in a TF profiler trace: `python -m benchmarks.xplane_summary DIR`.

Reads every `*.xplane.pb` under DIR (written by tf.profiler, e.g. by
`benchmarks.allreduce --worker_mode --profile_dir=DIR`) and prints, per
thread, its busy time, and overall the events with the largest total time.
Only the protobuf TensorFlow ships is used; no TensorBoard plugin.
`events(DIR)` is the reader the other trace tools share.
"""
import collections
import glob
import os
import sys


def events(directory: str):
  """Yields (plane, thread, event name, start ms, duration ms) of every event
  in every trace file under `directory`; start on the host's clock (a line's
  timestamp counts from the trace's `profile_start_time`)."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  files = glob.glob(os.path.join(directory, "**", "*.xplane.pb"),
                    recursive=True)
  if not files:
    raise SystemExit(f"error: no *.xplane.pb under {directory}")
  for path in files:
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
    origin_ns = _profile_start_ns(space)
    for plane in space.planes:
      names = {k: m.name for k, m in plane.event_metadata.items()}
      for line in plane.lines:
        line_ms = (origin_ns + line.timestamp_ns) / 1e6
        for event in line.events:
          yield (plane.name, line.name, names.get(event.metadata_id, "?"),
                 line_ms + event.offset_ps / 1e9, event.duration_ps / 1e9)


def _profile_start_ns(space) -> int:
  """The trace's start on the host clock, in ns ("Task Environment" plane's
  `profile_start_time`); 0 where a trace has none."""
  for plane in space.planes:
    names = {k: m.name for k, m in plane.stat_metadata.items()}
    for stat in plane.stats:
      if names.get(stat.metadata_id) == "profile_start_time":
        return stat.uint64_value or stat.int64_value
  return 0


def summarise(directory: str, top: int = 25) -> str:
  totals, counts = collections.Counter(), collections.Counter()
  threads = collections.Counter()
  for plane, thread, name, _, ms in events(directory):
    totals[(plane, name[:70])] += ms
    counts[(plane, name[:70])] += 1
    threads[(plane, thread)] += ms
  lines = ["%-12s %8s  %s" % ("total ms", "count", "plane / event")]
  for key, ms in totals.most_common(top):
    lines.append("%12.1f %8d  %s / %s" % (ms, counts[key], *key))
  lines.append("\n%-12s  %s" % ("busy ms", "plane / thread (events may nest)"))
  for key, ms in threads.most_common(12):
    lines.append("%12.1f  %s / %s" % (ms, *key))
  return "\n".join(lines)


if __name__ == "__main__":
  print(summarise(sys.argv[1]))
