"""README's shortest complete example runs as README says."""
import json
import os
import re
import subprocess
import sys

from conftest import ROOT

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


def test_the_readme_script_trains_and_evaluates(tmp_path):
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  section = readme.split("## Use it from your own script", 1)[1]
  script = re.search(r"```python\n(# my_train\.py\n.*?)```", section,
                     re.S).group(1)
  (tmp_path / "my_train.py").write_text(script)
  out = subprocess.run(
      [sys.executable, str(tmp_path / "my_train.py"), "--cpu_devices=2",
       "--train_steps=40", "--batch_size_per_replica=32", "--noexport",
       f"--model_dir={tmp_path / 'run'}"],
      cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["task"] == "sum_of_four" and summary["global_step"] == 40
  assert summary["final_loss"] < summary["first_loss"]
  assert summary["eval_examples"] == 256 and summary["eval_mae"] > 0
