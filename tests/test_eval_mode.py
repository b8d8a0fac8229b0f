"""--mode=eval and --mode=train, and the bad input of issue 18's loop flags."""
import json
import re
import os

import numpy as np
import pytest

from conftest import read_scalars, run_job, tiny_config
from engine.errors import ConfigError

EVAL = dict(synthetic_examples=64, eval_split="train[:37]", train_steps=6,
            learning_rate=0.01, steps_per_loop=3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("trained")
  return model_dir, run_job(tiny_config(strategy="one_device",
                                        model_dir=str(model_dir), **EVAL))


@pytest.mark.parametrize("replicas", [1, 2])
def test_eval_mode_reproduces_the_train_runs_last_evaluation(
    trained, tmp_path, replicas):
  train_dir, train = trained
  if replicas == 1:  # the latest checkpoint of its own model_dir
    model_dir, extra = train_dir, {}
  else:  # another run's checkpoints, with flags of another optimizer
    model_dir = tmp_path
    extra = dict(checkpoint=str(train_dir / "checkpoints"), cpu_devices=2,
                 optimizer="sgd", momentum=0.9)
  result = run_job(tiny_config(mode="eval", model_dir=str(model_dir),
                               **EVAL, **extra))
  s = json.loads((model_dir / "eval.json").read_text())
  assert s == result.summary
  if replicas == 1:  # the training run's summary.json is left as it was
    assert json.loads((model_dir / "summary.json").read_text()) == (
        train.summary)
  else:
    assert not (model_dir / "summary.json").exists()
  assert s["mode"] == "eval" and s["num_replicas"] == replicas
  assert s["checkpoint"] == str(train_dir / "checkpoints" / "ckpt-6")
  assert s["global_step"] == 6 and s["eval_examples"] == 37
  for key in ("eval_loss", "eval_accuracy", "eval_top5_accuracy"):
    np.testing.assert_allclose(s[key], train.summary[key], rtol=1e-5)
  assert read_scalars(model_dir / "eval")["loss"][6] == pytest.approx(
      s["eval_loss"], rel=1e-6)
  for a, b in zip(result.weights, train.weights):
    np.testing.assert_array_equal(a, b)


def test_train_mode_skips_evaluation(tmp_path):
  s = run_job(tiny_config(mode="train", model_dir=str(tmp_path),
                          **EVAL)).summary
  assert s["eval_loss"] is None and s["mode"] == "train"
  assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("fields, line", [
    (dict(mode="train", keep_best="eval_loss"),
     "--keep_best=eval_loss: needs evaluation, which --mode=train skips"),
    (dict(mode="train", early_stopping_patience=2),
     "--early_stopping_patience=2: needs evaluation"),
    (dict(checkpoint="/x"), "--checkpoint=/x: is read by --mode=eval only"),
    (dict(ema_decay=1.0), "--ema_decay=1.0: must be 0 (no average) or in"),
    (dict(keep_best="accuracy"), "--keep_best=accuracy: names an evaluation"),
])
def test_bad_combinations_are_refused(fields, line):
  with pytest.raises(ConfigError, match="^" + re.escape(line)):
    tiny_config(**fields)


@pytest.mark.parametrize("fields, line", [
    (dict(keep_best="eval_nope", eval_split="train"),
     "error: --keep_best=eval_nope: no such evaluation metric; valid: "
     "eval_loss, eval_accuracy, eval_top5_accuracy."),
    (dict(mode="eval"), "error: --mode=eval: no checkpoint in {}/checkpoints "
     "to evaluate; train there first, or pass --checkpoint=PATH."),
])
def test_bad_input_is_one_line_before_training(tmp_path, fields, line):
  """Found by the run, before training: one ConfigError line. The command
  line prints a ConfigError as that line, exit 2, without a traceback
  (engine/cli.py; tests/test_cli.py's --model_dir case runs it): checked
  in-process here, without a TensorFlow start per case."""
  with pytest.raises(ConfigError) as caught:
    run_job(tiny_config(train_steps=2, synthetic_examples=32,
                        model_dir=str(tmp_path), **fields))
  assert f"error: {caught.value}" == line.format(tmp_path)
  assert os.listdir(tmp_path) == []  # nothing trained, nothing written
