"""benchmarks.seed_table, reduced: 2 logical CPU devices, a few steps."""
import re
import subprocess
import sys

from conftest import ROOT

NUMBER = re.compile(r"^\d+\.\d s$")


def test_seed_table_prints_every_row_and_column():
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.seed_table", "--dataset=tf_flowers",
       "--cpu_devices=2", "--model=small_cnn", "--image_size=32",
       "--warmup=1", "--steps=2", "--steps_per_loop=2",
       "--data_dir=/nonexistent/tfds", "--nodownload"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  titles = [l for l in lines if "seconds per epoch" in l]
  assert [t.split(" ")[0] for t in titles] == ["mirrored", "multi_worker"]
  for t in titles:  # no network here: the stand-in is named in the title
    assert "tf_flowers (synthetic stand-in), 3670 images, 5 classes" in t
    assert "--nodownload was given" in t
  headers = [l for l in lines if l.startswith("| data set |")]
  assert headers == [
      "| data set | runner | 1 device (batch 64) | 2 devices (global batch 64)"
      " | 2 devices (global batch 128) |",
      "| data set | runner | 1 worker (batch 64) | 2 workers (global batch 64)"
      " | 2 workers (global batch 128) |"]
  rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines
          if l.startswith("| tf_flowers |")]
  assert [r[1] for r in rows] == ["engine", "Keras fit", "engine speed / fit"
                                  ] * 2
  for r in rows:
    assert len(r) == 5
  engine_mirrored, fit_mirrored, _, engine_mw, fit_mw, _ = rows
  for cell in engine_mirrored[2:] + fit_mirrored[2:] + engine_mw[2:]:
    assert NUMBER.match(cell) and float(cell[:-2]) > 0, cell
  assert NUMBER.match(fit_mw[2])  # one worker: fit runs
  # Two workers: Keras 3 fit fails under MWMS; the table says so, with why.
  assert fit_mw[3:] == ["fails [1]", "fails [1]"]
  assert any(l.startswith("[1] Keras 3 `Model.fit` under Multi") for l in lines)
