"""Learning-rate schedules: values by hand, TensorBoard, resume, bad input."""
import json
import logging

import numpy as np
import pytest

import forkserver
from conftest import ROOT, engine_cmd, read_scalars, run_job, tiny_config
import engine
from engine.core import schedules
import test_multi_worker as mw

COS_QUARTER = 0.5 * (1 + np.cos(np.pi / 4))  # 0.853553...


def rate(total, at, steps_per_epoch=10, global_batch=256, **fields):
  """The schedule's rate before update `at` (step at + 1)."""
  config = engine.Config.create(**fields).optimization
  lr = schedules.learning_rate(config, total_steps=total,
                               steps_per_epoch=steps_per_epoch,
                               global_batch=global_batch)
  if isinstance(lr, float):
    return lr
  return float(lr(np.int64(at)))


@pytest.mark.parametrize("fields, total, expected", [
    # Warmup from 0, then cosine over the 16 updates left: 0 at update 20.
    (dict(lr_schedule="cosine", warmup_steps=4, learning_rate=0.1), 20,
     {0: 0.0, 1: 0.025, 3: 0.075, 4: 0.1, 8: 0.1 * COS_QUARTER, 12: 0.05,
      19: 0.1 * 0.5 * (1 + np.cos(np.pi * 15 / 16)), 20: 0.0}),
    (dict(lr_schedule="linear", warmup_steps=4, learning_rate=0.1), 20,
     {2: 0.05, 4: 0.1, 8: 0.075, 19: 0.1 / 16, 20: 0.0}),
    (dict(lr_schedule="cosine", learning_rate=0.2), 8,
     {0: 0.2, 2: 0.2 * COS_QUARTER, 4: 0.1}),
    (dict(lr_schedule="exponential", lr_decay_rate=0.5, lr_decay_steps=10,
          learning_rate=0.1), 100,
     {0: 0.1, 5: 0.1 * 0.5 ** 0.5, 10: 0.05, 25: 0.1 * 0.5 ** 2.5}),
    (dict(lr_schedule="exponential", lr_decay_rate=0.5, lr_decay_steps=10,
          warmup_steps=10, learning_rate=0.1), 100,
     {5: 0.05, 10: 0.1, 20: 0.05}),
    # Boundary b: values[i + 1] from update b on, i.e. from step b + 1.
    (dict(lr_schedule="piecewise", lr_boundaries=(5, 10),
          lr_values=(0.3, 0.2, 0.1)), 20,
     {0: 0.3, 4: 0.3, 5: 0.2, 9: 0.2, 10: 0.1, 19: 0.1}),
    (dict(lr_schedule="piecewise", lr_boundaries=(5,), lr_values=(0.4, 0.1),
          warmup_steps=2), 20, {0: 0.0, 1: 0.2, 2: 0.4, 5: 0.1}),
    # --lr_scaling=linear: x global batch / base batch (1024 / 256 = 4);
    # 2 warmup epochs of 10 steps.
    (dict(lr_schedule="constant", warmup_epochs=2, learning_rate=0.1,
          lr_scaling="linear"), 50, {0: 0.0, 5: 0.1, 10: 0.2, 20: 0.4,
                                     49: 0.4}),
    (dict(lr_schedule="piecewise", lr_boundaries=(30,), lr_values=(0.1, 0.01),
          lr_scaling="linear", base_batch_size=512), 50,
     {0: 0.2, 30: 0.02}),
])
def test_schedule_values_match_hand_computed_numbers(fields, total, expected):
  for at, want in expected.items():
    got = rate(total, at, global_batch=1024, **fields)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9), (at, got, want)


def test_a_constant_rate_stays_a_plain_float():
  config = engine.Config.create(learning_rate=0.3).optimization
  assert schedules.learning_rate(config, total_steps=None,
                                 steps_per_epoch=None,
                                 global_batch=None) == 0.3
  scaled = engine.Config.create(learning_rate=0.3,
                                lr_scaling="linear").optimization
  assert schedules.learning_rate(scaled, total_steps=10, steps_per_epoch=5,
                                 global_batch=128) == pytest.approx(0.15)


@pytest.mark.parametrize("fields, line", [
    (dict(lr_boundaries=(3, 8), warmup_steps=4),
     "--lr_boundaries=3,8: must lie after the warmup (4 steps) and before "
     "the last step (10)."),
    (dict(lr_boundaries=(3, 10)),
     "--lr_boundaries=3,10: must lie after the warmup (0 steps) and before "
     "the last step (10)."),
    (dict(lr_boundaries=(), warmup_steps=10),
     "--warmup_steps=10: is 10 steps, but the run has 10; warmup must end "
     "before the last step."),
])
def test_what_needs_the_run_length_is_checked_before_training(fields, line):
  config = engine.Config.create(
      lr_schedule="piecewise", lr_values=(0.1,) * (len(fields["lr_boundaries"])
                                                  + 1), **fields)
  with pytest.raises(engine.ConfigError) as e:
    schedules.plan(config.optimization, total_steps=10, steps_per_epoch=5,
                   global_batch=8)
  assert str(e.value) == line


def test_warmup_cosine_is_in_tensorboard_and_resumes_exactly(tmp_path,
                                                             caplog):
  kw = dict(cpu_devices=2, optimizer="adamw", weight_decay=0.05,
            learning_rate=0.01, lr_schedule="cosine", warmup_steps=3,
            clip_global_norm=0.4, grad_accum_steps=2,
            batch_size_per_replica=4, synthetic_examples=40,
            steps_per_loop=4, summary_every=1)  # a partial batch too
  caplog.set_level(logging.INFO, logger="absl")
  whole = run_job(tiny_config(train_steps=9, checkpoint_every=4,
                              model_dir=str(tmp_path / "whole"), **kw))
  lines = [r.getMessage() for r in caplog.records
           if r.getMessage().startswith("Learning rate:")]
  assert lines == ["Learning rate: cosine, peak 0.01, linear warmup from 0 "
                   "over 3 steps, then cosine decay to 0 at step 9."]
  # Step s's update used the rate at s - 1 updates: TensorBoard, history
  # and summary.json say so.
  want = [0.0, 0.01 / 3, 0.02 / 3, 0.01, 0.01 * (1 + np.cos(np.pi / 6)) / 2,
          0.01 * 0.75, 0.005, 0.0025, 0.01 * (1 + np.cos(np.pi * 5 / 6)) / 2]
  np.testing.assert_allclose(whole.history["learning_rate"], want, rtol=1e-6)
  scalars = read_scalars(tmp_path / "whole" / "train")["learning_rate"]
  np.testing.assert_allclose([scalars[s] for s in range(1, 10)], want,
                             rtol=1e-6)
  summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
  assert summary["lr_schedule"] == "cosine"
  assert summary["peak_learning_rate"] == pytest.approx(0.01)
  assert summary["final_learning_rate"] == pytest.approx(want[-1], rel=1e-6)
  assert max(whole.history["grad_norm"]) > 0.4  # clipping took part

  # Resumed from the uninterrupted run's checkpoint of step 4 (a run
  # stopped there saves that state: tests/test_multi_worker.py's
  # `start_from_checkpoint`), with the same total: the schedule is over 9
  # steps in both parts.
  mw.start_from_checkpoint(tmp_path / "whole", tmp_path / "parts", 4)
  parts = str(tmp_path / "parts")
  rest = run_job(tiny_config(train_steps=9, model_dir=parts, **kw))
  assert rest.summary["start_step"] == 4
  np.testing.assert_array_equal(rest.history["learning_rate"],
                                whole.history["learning_rate"][4:])
  np.testing.assert_allclose(rest.losses, whole.losses[4:], rtol=0, atol=1e-6)
  for a, b in zip(rest.weights, whole.weights):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


TINY = ["--model=small_cnn", "--image_size=32", "--synthetic_examples=64",
        "--batch_size_per_replica=8", "--noexport"]


@pytest.mark.parametrize("flags, line", [
    (["--lr_schedule=step"], "error: flag --lr_schedule=step: value should "
     "be one of <constant|cosine|linear|exponential|piecewise>"),
    (["--lr_schedule=piecewise", "--lr_boundaries=10,5",
      "--lr_values=0.1,0.01,0.001"],
     "error: --lr_boundaries=10,5: must be strictly increasing positive "
     "steps, e.g. 1000,2000."),
    (["--lr_schedule=piecewise", "--lr_boundaries=10,20",
      "--lr_values=0.1,0.01"],
     "error: --lr_values=0.1,0.01: needs 3 values (one more than the 2 "
     "--lr_boundaries), e.g. 0.1,0.01,0.001 for 2."),
    (["--lr_schedule=piecewise", "--lr_boundaries=a", "--lr_values=0.1,0.2"],
     "error: --lr_boundaries=a: must be integers, e.g. 10,20."),
    (["--lr_schedule=exponential", "--lr_decay_rate=-0.5",
      "--lr_decay_steps=10"], "error: --lr_decay_rate=-0.5: must not be "
     "negative."),
    (["--lr_schedule=exponential", "--lr_decay_rate=0.5",
      "--lr_decay_steps=-10"], "error: --lr_decay_steps=-10: must be a "
     "non-negative integer."),
    (["--lr_schedule=exponential", "--lr_decay_rate=0.5"],
     "error: --lr_decay_steps=0: --lr_schedule=exponential needs a positive "
     "value."),
    (["--lr_decay_rate=0.5"], "error: --lr_decay_rate=0.5: is used only by "
     "--lr_schedule=exponential."),
    (["--warmup_steps=5", "--warmup_epochs=1"], "error: --warmup_epochs=1: "
     "cannot be combined with --warmup_steps; set one."),
    (["--lr_scaling=sqrt"], "error: flag --lr_scaling=sqrt: value should be "
     "one of <none|linear>"),
    (["--weight_decay=-1"], "error: --weight_decay=-1.0: must not be "
     "negative."),
    (["--weight_decay_exclude=bias("], "error: --weight_decay_exclude=bias(: "
     "is not a regular expression (missing ), unterminated subpattern at "
     "position 4)."),
    (["--optimizer=adamw"], "error: --weight_decay=0.0: --optimizer=adamw "
     "needs a positive --weight_decay (without one it is adam), e.g. 0.05."),
    (["--nesterov"], "error: --nesterov=True: needs --optimizer=sgd with "
     "--momentum > 0 (it is Nesterov momentum)."),
    (["--clip_global_norm=-1"], "error: --clip_global_norm=-1.0: must not be "
     "negative."),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, flags, line):
  proc = forkserver.run(
      engine_cmd(*TINY, f"--model_dir={tmp_path}", "--strategy=one_device",
                 *flags), cwd=ROOT, capture_output=True, text=True,
      timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert errors == [line], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "checkpoints").exists()  # nothing trained


def test_warmup_longer_than_the_run_is_one_line_before_training(tmp_path):
  """Known only once the run's length is: still before training. Checked
  in-process (the same flags as TINY): the command line prints this
  ConfigError as the one line, exit 2, as it does the cases above."""
  with pytest.raises(engine.ConfigError) as caught:
    run_job(tiny_config(synthetic_examples=64, batch_size_per_replica=8,
                        export=False, strategy="one_device", train_steps=4,
                        warmup_epochs=1, lr_schedule="cosine",
                        model_dir=str(tmp_path)))
  assert f"error: {caught.value}" == (
      "error: --warmup_epochs=1: is 8 steps, but the run has 4; warmup must "
      "end before the last step.")
  assert not (tmp_path / "checkpoints").exists()  # nothing trained
