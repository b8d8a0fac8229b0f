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

import pytest

from conftest import ROOT, run_job, tiny_config
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


@pytest.mark.skipif(memory.glibc() is None, reason="mallopt is glibc's")
def test_generator_kernel_maps_every_large_tensor_until_tuned():
  out = subprocess.run(
      [sys.executable, "-c", _PROBE, ROOT], capture_output=True, text=True,
      timeout=120, check=False,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_ENABLE_ONEDNN_OPTS="0"))  # malloc's allocations (above)
  assert out.returncode == 0, out.stderr[-3000:]
  faults = json.loads(out.stdout.strip().splitlines()[-1])
  assert faults["tuned"] is True
  # Under TF's 128 KiB each 1 MiB result is a fresh mapping whose 256 pages
  # fault in again: 200 x 257 faults (51,400) on this machine.
  assert faults["tf"] > 200 * 200
  # Tuned, the block is reused from the heap: the faults left are the ops'
  # small allocations (about 1,000 here).
  assert faults["after_tuning"] < faults["tf"] / 10


def test_training_reports_whether_malloc_was_tuned(tmp_path):
  tuned = run_job(tiny_config(strategy="one_device", train_steps=2,
                                  model_dir=str(tmp_path / "on")))
  assert tuned.summary["malloc_tuned"] is (memory.glibc() is not None)
  kept = run_job(tiny_config(strategy="one_device", train_steps=2,
                                 malloc_tuning=False,
                                 model_dir=str(tmp_path / "off")))
  assert kept.summary["malloc_tuned"] is False
