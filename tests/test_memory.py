"""Host memory: TensorFlow's 128 KiB mmap threshold, and the engine undoing it.

The page faults are counted in a fresh interpreter (its own malloc state),
as a training process goes: TensorFlow's first GeneratorDataset kernel
(every distributed data set has one), then `tune_malloc`. The probe runs
with oneDNN off: with it on, TensorFlow allocates large CPU tensors from a
pool of its own (its oneDNN CPU allocator) rather than from malloc, so there
the 200 multiplies fault about 260 pages, tuned or not; a training step
still makes many malloc-sized allocations, and the tuning stays on.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_job, tiny_config, train_batches
from engine.core import host_loop
from engine.host import memory

# Page faults while 200 eager multiplies each write a fresh 1 MiB tensor.
_PROBE = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import engine
import tensorflow as tf
from engine.host import memory

for _ in tf.data.Dataset.from_generator(
    lambda: iter([1]), output_signature=tf.TensorSpec([], tf.int32)):
  pass
x = tf.ones([256 * 1024])  # 1 MiB of float32: over 128 KiB, under 32 MiB

def faults():
  y = x * 2.0  # first allocation of this size, not counted
  start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(200):
    y = x * 2.0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

out = {"tf": faults()}
out["tuned"] = memory.tune_malloc()
out["after_tuning"] = faults()
print(json.dumps(out))
"""


def _tensorflows_allocator():
  """The environment of a fresh interpreter whose CPU tensors come from
  malloc: oneDNN off (its own allocator is a pool), and without the BFC
  choice that this process's engine.configure_host (conftest.py) put in
  os.environ."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
  return {k: v for k, v in env.items()
          if k not in (memory.BFC_ENV, memory.BFC_LIMIT_ENV)}


@pytest.mark.skipif(memory.glibc() is None, reason="mallopt is glibc's")
def test_generator_kernel_maps_every_large_tensor_until_tuned():
  out = subprocess.run(
      [sys.executable, "-c", _PROBE, ROOT], capture_output=True, text=True,
      timeout=120, check=False,
      env=_tensorflows_allocator())  # malloc's allocations (above)
  assert out.returncode == 0, out.stderr[-3000:]
  faults = json.loads(out.stdout.strip().splitlines()[-1])
  assert faults["tuned"] is True
  # Under TF's 128 KiB each 1 MiB result is a fresh mapping whose 256 pages
  # fault in again: 200 x 257 faults (51,400) on this machine.
  assert faults["tf"] > 200 * 200
  # Tuned, the block is reused from the heap: the faults left are the ops'
  # small allocations (about 1,000 here).
  assert faults["after_tuning"] < faults["tf"] / 10


# Which allocator TensorFlow's CPU devices took, in a fresh interpreter:
# "first", engine.configure_host before any op (as the command line does);
# "late", after an op made the devices.
_ALLOCATOR_PROBE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import engine
import tensorflow as tf
from engine.host import memory, resources

late = sys.argv[2] == "late"
if late:
  tf.constant(1.0) + 1.0
engine.configure_host(engine.Config.create(cpu_devices=0 if late else 2))
# A later call with another choice changes nothing.
engine.configure_host(engine.Config.create(cpu_allocator="tensorflow"))
out = {"chosen": memory.cpu_allocator(),
       "env": os.environ.get(memory.BFC_ENV),
       "limit_mib": os.environ.get(memory.BFC_LIMIT_ENV),
       "may_use_mib": int(resources.limits()["rss_mib"])}
try:
  with tf.device("CPU:0"):
    x = tf.ones([1 << 20]) * 2.0  # 4 MiB
  out["peak_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
except ValueError:  # only a pool that keeps statistics has them
  out["peak_bytes"] = None
print(json.dumps(out))
"""


def _allocator_probe(case):
  out = subprocess.run(
      [sys.executable, "-c", _ALLOCATOR_PROBE, ROOT, case],
      capture_output=True, text=True, timeout=120, check=False,
      env=_tensorflows_allocator())
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_tensors_come_from_bfc_when_chosen_before_the_first_op():
  first = _allocator_probe("first")
  assert first["chosen"] == "bfc" and first["env"] == "true"
  # TensorFlow's pool counts the 4 MiB tensor; its limit is what the
  # process may use, not TensorFlow's fixed 64 GiB.
  assert first["peak_bytes"] >= 4 << 20
  assert int(first["limit_mib"]) == first["may_use_mib"]
  late = _allocator_probe("late")
  assert late == dict(chosen="tensorflow", env=None, limit_mib=None,
                      may_use_mib=late["may_use_mib"], peak_bytes=None)


def test_training_reports_whether_malloc_was_tuned(tmp_path):
  tuned = run_job(tiny_config(strategy="one_device", train_steps=2,
                                  model_dir=str(tmp_path / "on")))
  assert tuned.summary["malloc_tuned"] is (memory.glibc() is not None)
  kept = run_job(tiny_config(strategy="one_device", train_steps=2,
                                 malloc_tuning=False,
                                 model_dir=str(tmp_path / "off")))
  assert kept.summary["malloc_tuned"] is False


def test_the_history_keeps_the_last_steps_and_the_run_totals():
  """A long run's memory stays flat: per-step values of the last `keep`
  steps only, with the step count, the first row and the column sums of all
  (summary.json's first_loss and skipped_images)."""
  history = host_loop.History(("loss", "examples"), keep=4)
  rows = np.stack([np.arange(1, 11), np.full(10, 8.0)], axis=1).astype(
      np.float32)
  for chunk in (rows[:1], rows[1:3], rows[3:9], rows[9:]):
    history.add(chunk)
  assert history.steps == 10
  np.testing.assert_array_equal(history.columns()["loss"], [7, 8, 9, 10])
  np.testing.assert_array_equal(history.first, [1, 8])
  np.testing.assert_array_equal(history.totals, [55, 80])
  one_call = host_loop.History(("loss",), keep=3)
  one_call.add(np.arange(5, dtype=np.float32)[:, None])  # longer than keep
  np.testing.assert_array_equal(one_call.columns()["loss"], [2, 3, 4])
  assert one_call.steps == 5 and one_call.first[0] == 0


def test_the_engines_pipelines_run_without_tf_datas_autotuner():
  """The autotuner took 30 MiB more of the BFC pool over a run's first
  minutes, memory the process keeps (engine/core/inputs.py's
  `_with_options`): training's and evaluation's pipelines turn it off, the
  task's own stages included."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.core import inputs  # pylint: disable=g-import-not-at-top
  j = tiny_config(eval_split="train[:16]")
  train, _ = train_batches(j, global_batch=8)
  evaluation = inputs.eval_inputs(j.task(), tf.distribute.InputContext(), 8)
  for ds in (train, evaluation.batches()):
    assert ds.options().autotune.enabled is False
  # Still the rows they were: one batch of 8 images.
  images, labels = next(iter(train))
  assert images.shape[0] == 8 and labels.shape == (8,)
