"""Keras callbacks at host-call boundaries; one 2-worker launch where EMA,
early stopping and a callback on one worker stop both at the same step."""
import csv
import json
import os
import sys

import keras
import numpy as np

from callback_job import StopAfter
import forkserver
from conftest import ROOT, read_scalars, tiny_config
import engine

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
ENV.pop("TF_CONFIG", None)


def test_csv_logger_and_lambda_callback_get_the_metrics_by_name(tmp_path):
  # 48 examples in batches of 8: 6 steps per epoch; evaluations at 4, 8, 12
  # end host calls there, so epoch 0 ends inside the call of steps 5-8.
  config = tiny_config(synthetic_examples=48, train_steps=12, eval_every=4,
                       steps_per_loop=5, eval_split="train[:20]",
                       model_dir=str(tmp_path))
  tests, epochs = [], []
  callbacks = [
      keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
      keras.callbacks.TerminateOnNaN(),
      keras.callbacks.LambdaCallback(
          on_epoch_end=lambda epoch, logs: epochs.append((epoch, logs)),
          on_test_end=lambda logs: tests.append(logs))]
  result = engine.run(config.task(), config.config, callbacks=callbacks)
  with open(tmp_path / "log.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["epoch"] for r in rows] == ["0", "1"]
  assert sorted(rows[0]) == ["accuracy", "epoch", "loss", "top5_accuracy",
                             "val_accuracy", "val_loss", "val_top5_accuracy"]
  # Keras writes NA where an epoch ended without an evaluation (step 6).
  assert rows[0]["val_loss"] == "NA"
  assert float(rows[1]["val_loss"]) == result.summary["eval_loss"]
  for k, row in enumerate(rows):
    for name in ("loss", "accuracy", "top5_accuracy"):
      want = np.mean(result.history[name][6 * k:6 * (k + 1)], dtype=np.float64)
      np.testing.assert_allclose(float(row[name]), want, rtol=1e-6)
  scalars = read_scalars(tmp_path / "eval")
  assert [t["loss"] for t in tests] == [
      scalars["loss"][s] for s in (4, 8, 12)]
  assert "val_loss" not in epochs[0][1]  # no evaluation at step 6
  assert epochs[1][1]["val_loss"] == tests[-1]["loss"]
  assert epochs[1][1]["val_accuracy"] == result.summary["eval_accuracy"]
  assert not result.model.stop_training


def test_two_workers_stop_together_with_ema_early_stopping_and_a_callback(
    tmp_path):
  """Worker 1 alone has a callback that stops at step 6: its vote rides the
  host call of steps 7-8. Early stopping (patience 1) ends training at the
  evaluation of step 8 on each worker by its own decision. Both workers
  stop at step 8, with the one-replica run's weights and averages."""
  fields = dict(optimizer="sgd", learning_rate=3.0, ema_decay=0.8,
                synthetic_examples=64, eval_split="train[:32]", eval_every=2,
                steps_per_loop=2, early_stopping_patience=1, train_steps=16,
                model="small_cnn", image_size=32, seed=7, log_every=2)
  flags = [f"--{k}={v}" for k, v in fields.items()] + [
      "--batch_size_per_replica=8", "--noexport", "--weights_out=w.npz",
      "--stop_after=6", "--stop_on_worker=1", "--collective_timeout=30",
      f"--model_dir={tmp_path / 'mw'}"]
  out = forkserver.run(
      [sys.executable, "-m", "engine.launch", "--num_workers=2",
       f"--script={os.path.join(ROOT, 'tests', 'callback_job.py')}", "--",
       *flags], cwd=ROOT, env=ENV, capture_output=True, text=True,
      timeout=180, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "launcher: all 2 workers succeeded." in out.stderr
  early = "early stopping: eval_loss did not improve in 1 evaluation(s)"
  stops = {w: [l for l in out.stdout.splitlines()
               if l.startswith(f"[worker {w}] ") and "Stopping at step" in l]
           for w in (0, 1)}
  assert len(stops[0]) == len(stops[1]) == 1, out.stdout[-3000:]
  assert ("Stopping at step 8 of 16: a callback on another worker asked to "
          f"stop; {early}") in stops[0][0]
  assert ("Stopping at step 8 of 16: a callback set model.stop_training at "
          f"step 6; {early}") in stops[1][0]
  summary = json.loads((tmp_path / "mw" / "summary.json").read_text())
  assert summary["num_workers"] == 2 and summary["ema_decay"] == 0.8
  assert summary["global_step"] == summary["stop_step"] == 8
  assert summary["best_step"] == 6
  assert "ckpt-8.index" in os.listdir(tmp_path / "mw" / "checkpoints")

  config = tiny_config(strategy="one_device", batch_size_per_replica=16,
                       model_dir=str(tmp_path / "one"),
                       **{k: v for k, v in fields.items()
                          if k not in ("model", "image_size", "seed")})
  ref = engine.run(config.task(), config.config, callbacks=[StopAfter(6)])
  assert ref.summary["stop_step"] == 8
  got = np.load(tmp_path / "mw" / "w.npz")
  for k, want in enumerate(ref.weights):
    np.testing.assert_allclose(got[f"arr_{k}"], want, rtol=1e-5, atol=1e-6)
  # The evaluations used the averages: equal too.
  for key in ("eval_loss", "best_value", "final_loss"):
    np.testing.assert_allclose(summary[key], ref.summary[key], rtol=1e-5)
