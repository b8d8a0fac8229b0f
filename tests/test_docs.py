"""README and the guide as users read them: every program and command runs.

The code blocks of README.md and docs/guide/*.md:
  ```python  a complete program; its first line `# name.py` names the file
             it is written to, in a work folder that stands for the user's;
             run by a command that names it, else as `python name.py`;
  ```sh      commands, each run there (continuation lines joined, comments
             dropped); the same command in two places runs once;
  ```text    output, templates and commands for machines this one is not
             (GPUs, clusters, downloads): not run, but the flags of each
             `python -m engine.main` line must be flags the command defines.
`/tmp/...` in the docs is the work folder, `/data/...` its data/ folder;
`/data/pets` is a folder of generated images. `make run` runs the command
`make -n run` prints, for one epoch; `make test` is this suite, checked with
`make -n test` only.

Cheap by construction: the commands train small models for a few seconds,
and the commands and programs of a group run one after another in one
interpreter, as `python -m MODULE ...` and `python SCRIPT ...` would run
them (runpy with that sys.argv, the exit code from SystemExit; absl's flags
reset between them), so TensorFlow starts once per group. The training
guide's commands on the synthetic data set run with a quarter of its
examples (`_smaller`). The launcher's workers are processes of their own,
as always; `engine.data.to_tfds` runs in its own process first (it defines
flags the engine also defines). Links between the docs, and their
#anchors, must resolve.
"""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import forkserver
from conftest import ROOT

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)
GUIDE = os.path.join(ROOT, "docs", "guide")
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# Runs the commands of a group in one interpreter: tests/docs_driver.py.
DRIVER = os.path.join(ROOT, "tests", "docs_driver.py")


def _blocks(path):
  with open(path) as f:
    return [(kind, text) for kind, text in _BLOCK.findall(f.read())]


def _commands(text):
  """The commands of a sh block: continuations joined, comments dropped."""
  joined = re.sub(r"\\\n\s*", " ", text)
  return [line.strip() for line in joined.splitlines()
          if line.strip() and not line.strip().startswith("#")]


def _pages(*names):
  """[(page, kind, text)] of README.md and/or guide pages, in order."""
  out = []
  for name in names:
    path = (os.path.join(ROOT, name) if name == "README.md"
            else os.path.join(GUIDE, name))
    out.extend((name, kind, text) for kind, text in _blocks(path))
  return out


def _localize(command, work):
  """The command's words with the docs' paths moved into `work`."""
  words = shlex.split(command)
  return [w.replace("/tmp/", f"{work}/").replace("/data/", f"{work}/data/")
          for w in words]


def _plan(blocks, work):
  """(files, commands for the driver, commands of their own process), in
  order, each run once. A program no command runs (`python name.py ...`)
  runs as `python name.py` where its block is. `engine.data.to_tfds`
  defines flags the engine also defines (--dataset): its own process."""
  run_by_commands = {w for _, kind, text in blocks if kind == "sh"
                     for c in _commands(text) for w in shlex.split(c)
                     if w.endswith(".py")}
  files, driven, alone, seen = {}, [], [], set()
  for page, kind, text in blocks:
    if kind == "python":
      first = text.splitlines()[0]
      name = re.fullmatch(r"# (\w+\.py)(:.*)?", first)
      assert name, f"{page}: a python block must start with '# name.py'"
      files[name.group(1)] = text.replace("/tmp/", f"{work}/")
      if name.group(1) not in run_by_commands:
        driven.append([name.group(1)])
    elif kind == "sh":
      for command in _commands(text):
        if command in seen:
          continue
        seen.add(command)
        words = _localize(command, work)
        if words[:2] == ["make", "run"]:
          driven.append(["-m", "engine.main", *_make_run(work)])
        elif words[:2] == ["make", "test"]:
          dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout
          assert "-m pytest" in dry and " tests" in dry, dry
        elif words[:3] == ["python", "-m", "engine.data.to_tfds"]:
          alone.append([sys.executable, *words[1:]])
        else:
          assert words[0] == "python", f"{page}: {command}"
          driven.append(words[1:])
    else:
      assert kind == "text", f"{page}: a ```{kind} block (sh, python or text)"
      _check_text(page, text)
  return files, driven, alone


def _make_run(work):
  """`make run`'s engine.main flags, its model_dir in `work`, for one epoch
  (its 8 are the same loop 8 times; the suite's time is counted)."""
  dry = subprocess.run(["make", "-s", "-n", "run"], cwd=ROOT, check=True,
                       capture_output=True, text=True).stdout.strip()
  words = shlex.split(dry.splitlines()[-1])
  assert words[1:3] == ["-m", "engine.main"], dry
  return [w if not w.startswith("--model_dir=") else
          f"--model_dir={work}/make_run" for w in words[3:]] + ["--epochs=1"]


def _engine_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  from engine import cli, config  # pylint: disable=g-import-not-at-top
  from engine.tasks import image_classification  # pylint: disable=g-import-not-at-top
  values = flags.FlagValues()
  image_classification.define_flags(flag_values=values, module_name="docs")
  for cls in config.SECTIONS.values():
    cli.define_dataclass_flags(cls, flag_values=values, module_name="docs")
  return set(values) | {"flagfile", "helpfull"}


def _check_text(page, text):
  """Each `python -m engine.main` of a text block uses only real flags."""
  known = _engine_flags()
  for command in _commands(text):
    if not command.startswith("python -m engine.main "):
      continue
    for word in shlex.split(command, comments=True)[3:]:
      name = word.lstrip("-").split("=")[0]
      if name.startswith("no") and name[2:] in known:
        name = name[2:]
      assert name in known, f"{page}: --{name} in {command!r}"


def _run_driven(commands, work):
  """Runs `commands` in one interpreter; each must exit 0, and each
  engine.main run must have written its summary.json (eval.json)."""
  out = forkserver.run([sys.executable, DRIVER, json.dumps(commands)],
                       cwd=work, env=ENV, capture_output=True, text=True,
                       timeout=600)
  line = [l for l in out.stdout.splitlines() if l.startswith("CODES ")]
  assert out.returncode == 0 and line, out.stderr[-4000:]
  codes = json.loads(line[0][len("CODES "):])
  errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  failed = [(argv, c) for argv, c in zip(commands, codes) if c != 0]
  assert not failed, (failed, errors, out.stderr[-3000:])
  for argv in commands:
    if argv[:2] != ["-m", "engine.main"]:
      continue
    model_dir = [w.split("=", 1)[1] for w in argv
                 if w.startswith("--model_dir=")][-1]
    name = "eval.json" if "--mode=eval" in argv else "summary.json"
    assert os.path.exists(os.path.join(model_dir, name)), argv
  return out


def _run_alone(commands, work):
  for command in commands:
    out = forkserver.run(command, cwd=work, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, (command, out.stdout[-2000:],
                                 out.stderr[-3000:])


def _write(files, work):
  for name, text in files.items():
    with open(os.path.join(work, name), "w") as f:
      f.write(text)


def test_readme_and_the_guide_to_scripts_and_outputs_run(tmp_path):
  """README, own-task, multi-worker and outputs, in order."""
  files, driven, alone = _plan(_pages(
      "README.md", "own-task.md", "multi-worker.md", "outputs.md"), tmp_path)
  assert not alone
  _write(files, tmp_path)
  out = _run_driven(driven, tmp_path)
  # my_hook.py's hook heard the evaluations (2048 examples, global batch
  # 128: epochs end every 16 steps).
  heard = re.findall(r"^evaluation at step (\d+): \{'eval_loss'", out.stdout,
                     re.M)
  assert [int(s) for s in heard] == [16, 32], out.stdout[-2000:]
  summary = json.loads((tmp_path / "mine" / "summary.json").read_text())
  assert summary["task"] == "sum_of_four" and summary["global_step"] == 200
  assert summary["final_loss"] < summary["first_loss"]
  launched = json.loads((tmp_path / "mine_2w" / "summary.json").read_text())
  assert launched["num_workers"] == 2 and launched["global_step"] == 200
  assert (tmp_path / "mine_api" / "summary.json").exists()
  assert (tmp_path / "mine_hook" / "summary.json").exists()


def _smaller(argv):
  """An engine.main command on the synthetic data set with a quarter of its
  2048 examples: every flag still runs, each epoch has a quarter of the
  batches (the suite's time is counted; these pages' commands count steps
  or epochs, not examples)."""
  if argv[:2] != ["-m", "engine.main"] or any(
      w.startswith("--dataset=") for w in argv):
    return argv
  return argv + ["--synthetic_examples=512"]


def test_the_guide_to_training_runs(tmp_path):
  """recipes, data, checkpoints, performance, troubleshooting: to_tfds
  first (it reads only the generated images), then the rest in order
  (resume and evaluation follow training)."""
  from engine.data import to_tfds  # pylint: disable=g-import-not-at-top
  to_tfds.write_sample_folder(str(tmp_path / "data" / "pets"),
                              ["cat", "dog", "fox"], 16, size=(12, 12))
  files, driven, alone = _plan(_pages(
      "recipes.md", "data.md", "checkpoints.md", "performance.md",
      "troubleshooting.md"), tmp_path)
  _write(files, tmp_path)
  _run_alone(alone, tmp_path)
  _run_driven([_smaller(argv) for argv in driven], tmp_path)
  resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
  assert resumed["start_step"] == 40 and resumed["global_step"] == 80
  evaluated = json.loads((tmp_path / "best_eval" / "eval.json").read_text())
  assert evaluated["checkpoint"].startswith(str(tmp_path / "best" / "best"))


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path):
  """GitHub's anchors of a Markdown file's headings."""
  with open(path) as f:
    headings = re.findall(r"^#+ (.+)$", f.read(), re.M)
  return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
          for h in headings}


@pytest.mark.parametrize("folder", ["", "docs/guide", "docs/reference",
                                    "docs/design", "benchmarks", "tests"])
def test_every_link_between_the_docs_resolves(folder):
  base = os.path.join(ROOT, folder)
  for name in sorted(os.listdir(base)):
    if not name.endswith(".md") or name == "RESULTS.md":
      continue
    with open(os.path.join(base, name)) as f:
      text = re.sub(r"`[^`]*`", "", _BLOCK.sub("", f.read()))
    for target in _LINK.findall(text):
      if re.match(r"\w+://", target):
        continue
      path, _, anchor = target.partition("#")
      full = os.path.normpath(os.path.join(base, path)) if path else (
          os.path.join(base, name))
      assert os.path.exists(full), f"{folder}/{name}: {target}"
      if anchor and full.endswith(".md"):
        assert anchor in _anchors(full), f"{folder}/{name}: {target}"


def test_readme_is_short():
  assert os.path.getsize(os.path.join(ROOT, "README.md")) < 20_000
