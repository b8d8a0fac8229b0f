"""Installed from its wheel, the engine lives beside a user's own modules.

A user's project folder holds `data.py`, `models.py`, `benchmarks.py` and a
`data/` package (the commonest module names in ML projects), each unlike the
engine's, and a training script that imports its own `data` and `models`.
From that folder, with the engine installed from its wheel into a fresh
virtual environment (its dependencies come from the project's environment,
nothing from this checkout), the built-in job (`python -m engine.main`) and
the user's script on 2 workers through the launcher train to the end. Before
the engine's registries moved to engine.models and engine.data, both died at
`from data import decode`.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

from conftest import ROOT

# The user's modules. Importing one of them in place of the engine's would
# fail: none has what the engine's registries have, and these two refuse to
# load at all (the user's script needs neither).
_USER_FILES = {
    "data.py": "raise ImportError('the user\\'s data.py was imported')\n",
    "benchmarks.py":
        "raise ImportError('the user\\'s benchmarks.py was imported')\n",
    "models.py": """
import keras


def make_model():
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                           keras.layers.Dense(1)])
""",
    "data/__init__.py": """
import numpy as np
import tensorflow as tf


def make_examples(split, context):
  del context
  rng = np.random.default_rng(0 if split == "train" else 1)
  x = rng.normal(size=(64, 4)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1)))
""",
    "train.py": """
import keras

import data  # the user's data/ package
import engine
import engine.data
import models  # the user's models.py


def make_task(config):
  del config
  return engine.Task(model=models.make_model, inputs=data.make_examples,
                     loss=keras.losses.MeanSquaredError(reduction=None),
                     name="user_task")


if __name__ == "__main__":
  print("modules:", engine.__file__, engine.data.__file__, data.__file__,
        models.__file__, flush=True)
  engine.cli.run(make_task)
""",
}


def _wheel(tmp_path) -> str:
  """The wheel, built from a copy of the sources (the checkout stays clean)."""
  src = tmp_path / "src"
  for name in ("engine", "models", "data"):
    shutil.copytree(os.path.join(ROOT, name), src / name,
                    ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(ROOT, name), src / name)
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                  "--no-build-isolation", "--no-index", "-w",
                  str(tmp_path / "dist"), str(src)],
                 check=True, capture_output=True, timeout=300)
  return glob.glob(str(tmp_path / "dist" / "tfengine-*.whl"))[0]


def _fresh_venv(tmp_path, wheel: str) -> str:
  """A new venv holding the wheel; TensorFlow and the other dependencies are
  the project environment's (a path in a .pth file: its own .pth files,
  among them the editable install's, are not read)."""
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                 check=True, timeout=120)
  python = str(venv / "bin" / "python")
  subprocess.run([sys.executable, "-m", "pip", "--python", python, "install",
                  "--quiet", "--no-deps", "--no-index", wheel],
                 check=True, capture_output=True, timeout=300)
  site = subprocess.run(
      [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
      check=True, capture_output=True, text=True).stdout.strip()
  with open(os.path.join(site, "project_dependencies.pth"), "w") as f:
    f.write(sysconfig.get_path("purelib") + "\n")
  return python


def test_the_wheel_lives_beside_a_users_data_models_and_benchmarks(tmp_path):
  wheel = _wheel(tmp_path)
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
  # One top-level package; the registries inside it, every module shipped.
  assert {n.split("/")[0] for n in names if n.endswith(".py")} == {"engine"}
  for folder, package in (("engine", "engine"), ("models", "engine/models"),
                          ("data", "engine/data")):
    for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"),
                          recursive=True):
      rel = os.path.relpath(path, os.path.join(ROOT, folder))
      assert f"{package}/{rel}" in names, rel
  python = _fresh_venv(tmp_path, wheel)
  project = tmp_path / "project"
  for name, text in _USER_FILES.items():
    (project / name).parent.mkdir(parents=True, exist_ok=True)
    (project / name).write_text(text)
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "TF_CONFIG")}
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  run = lambda *args: subprocess.run(  # pylint: disable=g-long-lambda
      [python, *args], cwd=project, env=env, capture_output=True, text=True,
      timeout=300)
  # The built-in job, run from the user's folder (on sys.path first).
  main = run("-m", "engine.main", "--model=small_cnn", "--dataset=synthetic",
             "--image_size=32", "--synthetic_examples=32",
             "--batch_size_per_replica=8", "--train_steps=2",
             "--steps_per_loop=1", "--noexport", "--noprogress",
             f"--model_dir={tmp_path / 'main'}")
  assert main.returncode == 0, main.stderr[-3000:]
  assert json.loads((tmp_path / "main" / "summary.json").read_text())[
      "global_step"] == 2
  # The user's script, importing its own data and models, on 2 workers.
  launched = run("-m", "engine.launch", "--num_workers=2",
                 "--script=train.py", "--", "--train_steps=3",
                 "--batch_size_per_replica=4", "--noexport", "--noprogress",
                 f"--model_dir={tmp_path / 'mine'}")
  assert launched.returncode == 0, launched.stdout[-3000:]
  summary = json.loads((tmp_path / "mine" / "summary.json").read_text())
  assert summary["task"] == "user_task" and summary["num_workers"] == 2
  assert summary["global_step"] == 3
  # The engine and its registries from the wheel; the user's modules theirs.
  line = next(l for l in launched.stdout.splitlines() if "modules:" in l)
  engine_file, registry, users_data, users_models = line.split()[-4:]
  installed = str(tmp_path / "venv")
  assert engine_file.startswith(installed), engine_file
  assert registry.startswith(installed), registry
  assert users_data == str(project / "data" / "__init__.py")
  assert users_models == str(project / "models.py")
