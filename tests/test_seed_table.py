"""benchmarks.seed_table, reduced: the mirrored table on 2 logical CPU
devices, a few steps (the multi_worker table takes the launcher through
eight more processes; tests/test_multi_worker.py covers the launcher)."""
import re
import sys

import forkserver
from conftest import ROOT

NUMBER = re.compile(r"^\d+\.\d s$")


def test_seed_table_prints_every_row_and_column():
  proc = forkserver.run(
      [sys.executable, "-m", "benchmarks.seed_table", "--dataset=tf_flowers",
       "--cpu_devices=2", "--model=small_cnn", "--image_size=32",
       "--warmup=1", "--steps=2", "--steps_per_loop=2",
       "--data_dir=/nonexistent/tfds", "--nodownload", "--nomulti_worker"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  titles = [l for l in lines if "seconds per epoch" in l]
  assert [t.split(" ")[0] for t in titles] == ["mirrored"]
  for t in titles:  # no network here: the stand-in is named in the title
    assert "tf_flowers (synthetic stand-in), 3670 images, 5 classes" in t
    assert "--nodownload was given" in t
  headers = [l for l in lines if l.startswith("| data set |")]
  assert headers == [
      "| data set | runner | 1 device (batch 64) | 2 devices (global batch 64)"
      " | 2 devices (global batch 128) |"]
  rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines
          if l.startswith("| tf_flowers |")]
  assert [r[1] for r in rows] == ["engine", "Keras fit", "engine speed / fit"]
  for r in rows:
    assert len(r) == 5
  engine_mirrored, fit_mirrored, ratios = rows
  for cell in engine_mirrored[2:] + fit_mirrored[2:]:
    assert NUMBER.match(cell) and float(cell[:-2]) > 0, cell
  for cell in ratios[2:]:
    assert re.match(r"^\d+\.\d\dx$", cell), cell
