"""--shard_files: each worker reads only its own files of a tfds training set.

The 4-file tfds set `ant_bee_cat` (36 examples, 9 per file): with N workers
each reads (and decodes) 1/N of the records of every global batch; two real
workers train to the end, and an interrupted run resumes to the same
weights; a source that cannot be split by files is one error line.
"""
import json

import numpy as np
import pytest
import tensorflow as tf

from conftest import run_job, tiny_config
from engine.core import inputs, sharded_inputs
from engine.data import decode
from engine.errors import ConfigError
# The 4-file tfds set and the clean folder it is made from.
from test_input_scale import images, tfds_dir  # noqa: F401  pylint: disable=unused-import
from test_input_scale import GLOBAL_BATCH, read_workers
import test_multi_worker as mw

STEPS = 3


class _FirstSteps(inputs.TrainData):
  """TrainData whose worker batches end after STEPS, so that a worker's
  pipeline can be read to its end: no read-ahead is left uncounted (nor
  read past STEPS: tf.data would otherwise make the numbering map parallel,
  reading ahead of `take`). Each record of the worker's own files is counted
  ("records") as it enters the worker's batches."""

  def worker_items(self, context, start_step=0):
    own = sharded_inputs.own_examples(self._examples, context)
    items = sharded_inputs.worker_items(
        own.map(_counted), sharded_inputs.count(own), context=context,
        global_batch=GLOBAL_BATCH, seed=7,
        shuffle_buffer=self._data.shuffle_buffer, start_step=start_step)
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = False
    options.experimental_optimization.inject_prefetch = False
    return items.take(STEPS).with_options(options)


def _counted(*example):
  decode.counter.count("records", tf.constant(1))
  return example


def _job(data_dir, **kw):
  base = dict(dataset="ant_bee_cat", data_dir=data_dir,
              batch_size_per_replica=GLOBAL_BATCH, shard_files=True)
  base.update(kw)
  return tiny_config(**base)


def _reads(j, workers):
  """(records read, images decoded, rows got) per step of each worker's own
  pipeline."""
  return [(counts["records"] / STEPS, counts["bytes"] / STEPS, rows / STEPS)
          for counts, rows in read_workers(j, workers, _FirstSteps)]


def test_each_worker_reads_its_own_share_of_the_records(tfds_dir):  # pylint: disable=redefined-outer-name
  decode.counter.enabled = True
  try:
    j = _job(tfds_dir, shuffle_buffer=0)
    for workers in (1, 2, 4):
      # Read, decoded and got per worker per step: the global batch / N.
      assert _reads(j, workers) == [(GLOBAL_BATCH / workers,) * 3] * workers, (
          workers)
  finally:
    decode.counter.enabled = False


def test_workers_read_disjoint_files_in_whole_batches(tfds_dir):  # pylint: disable=redefined-outer-name
  j = _job(tfds_dir)
  seen = []
  for w in range(2):
    context = tf.distribute.InputContext(2, w, 2)
    data = inputs.TrainData(j.task(), context, j.config.data, GLOBAL_BATCH, 7)
    # One epoch: 36 // 8 = 4 steps of 4 rows per worker, of its 18 examples.
    assert data.steps_per_epoch == 4
    epoch = list(data.worker_items(context).take(4))
    assert data._worker_counts == {(2, w): 18}  # pylint: disable=protected-access
    for step, ((items, _), (steps, positions)) in enumerate(epoch):
      assert steps.numpy().tolist() == [step] * 4
      assert positions.numpy().tolist() == list(range(4 * w, 4 * w + 4))
    seen.append({x for (items, _), _ in epoch for x in items.numpy()})
    # Resuming at step 5 (epoch 1, one batch in) reads what step 5 read.
    later = [b[0].numpy().tolist() for b, _ in data.worker_items(context)
             .skip(5).take(3)]
    resumed = [b[0].numpy().tolist() for b, _ in data.worker_items(
        context, start_step=5).take(3)]
    assert resumed == later
  assert len(seen[0]) == len(seen[1]) == 16  # 16 distinct records each
  assert not seen[0] & seen[1]  # no record on both workers


def test_default_order_resumes_exactly_on_tfds(tfds_dir):  # pylint: disable=redefined-outer-name
  # The tfds files keep one seeded order in every epoch: resuming at step 5
  # (epoch 1) reads what the uninterrupted run reads. With tfds reshuffling
  # its files each pass, all six batches differed.
  j = tiny_config(dataset="ant_bee_cat", data_dir=tfds_dir,
                  batch_size_per_replica=GLOBAL_BATCH)
  data = inputs.TrainData(j.task(), tf.distribute.InputContext(),
                          j.config.data, GLOBAL_BATCH, 7)

  def items(ds):
    return [b[0].numpy().tolist() for b in ds.take(6)]
  assert items(data.global_items(5)) == items(data.global_items().skip(5))


def test_not_file_sharded_is_one_error_line(tfds_dir, tmp_path):  # pylint: disable=redefined-outer-name
  j = tiny_config(shard_files=True)
  with pytest.raises(ConfigError) as e:
    inputs.TrainData(j.task(), tf.distribute.InputContext(), j.config.data,
                     GLOBAL_BATCH, 7)
  why = ("training data cannot be split by files among {} worker(s) (it needs "
         "a tfds data set with at least one file per worker); synthetic and "
         "folder sources already read only indices or paths per global batch, "
         "so drop --shard_files.")
  assert str(e.value) == ("--shard_files=True: task image_classification's "
                          + why.format(1))
  # 4 files cannot go round 8 workers.
  j = _job(tfds_dir)
  context = tf.distribute.InputContext(8, 0, 8)
  with pytest.raises(ConfigError) as e:
    inputs.TrainData(j.task(), context, j.config.data, GLOBAL_BATCH, 7)
  assert str(e.value).endswith(why.format(8))
  # From a run: that line, before training (the command line prints a
  # ConfigError as that line, exit 2: tests/test_cli.py's --model_dir case
  # runs it; in-process here, without a TensorFlow start).
  with pytest.raises(ConfigError) as e:
    run_job(tiny_config(shard_files=True, train_steps=1,
                        model_dir=str(tmp_path / "m")))
  assert str(e.value).endswith(why.format(1))
  assert not (tmp_path / "m" / "checkpoints").exists()


def test_one_worker_trains_whole_batches(tfds_dir, tmp_path):  # pylint: disable=redefined-outer-name
  one = run_job(_job(tfds_dir, train_steps=0, epochs=2,
                     model_dir=str(tmp_path / "one")))
  # 36 // 8 = 4 whole batches an epoch; the 4 examples left never partial.
  assert one.history["examples"].tolist() == [GLOBAL_BATCH] * 8
  assert one.summary["global_step"] == 8
  assert one.summary["skipped_images"] == 0
  # The worker's batch split between 2 replicas (static sizes 4 and 4): the
  # same batches, the same weights.
  two = run_job(_job(tfds_dir, train_steps=0, epochs=2, strategy="mirrored",
                     cpu_devices=2, batch_size_per_replica=GLOBAL_BATCH // 2,
                     model_dir=str(tmp_path / "two")))
  assert two.history["examples"].tolist() == [GLOBAL_BATCH] * 8
  for k, w in enumerate(one.weights):
    np.testing.assert_allclose(two.weights[k], w, rtol=1e-5, atol=1e-6)


def _launch(data_dir, model_dir, steps):
  out = mw.launch([
      "--dataset=ant_bee_cat", f"--data_dir={data_dir}", "--model=small_cnn",
      "--image_size=32", f"--batch_size_per_replica={GLOBAL_BATCH // 2}",
      "--shard_files", f"--train_steps={steps}", "--steps_per_loop=1",
      "--seed=7", "--noexport", "--augment=flip", f"--model_dir={model_dir}",
      "--weights_out=w.npz", "--checkpoint_every=5"])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  summary = json.loads((model_dir / "summary.json").read_text())
  weights = np.load(model_dir / "w.npz")
  return summary, [weights[f"arr_{k}"] for k in range(len(weights.files))]


def test_two_workers_train_and_resume_exactly(tfds_dir, tmp_path):  # pylint: disable=redefined-outer-name
  # 7 steps: epoch 0 (4 steps) and 3 of epoch 1; the interrupted run goes
  # on from the checkpoint of step 5 (one batch into epoch 1), the one the
  # uninterrupted run saved there.
  summary, whole = _launch(tfds_dir, tmp_path / "whole", 7)
  assert (summary["num_workers"], summary["global_step"]) == (2, 7)
  assert summary["skipped_images"] == 0  # every step a whole global batch
  mw.start_from_checkpoint(tmp_path / "whole", tmp_path / "cut", 5)
  summary, resumed = _launch(tfds_dir, tmp_path / "cut", 7)
  assert (summary["start_step"], summary["global_step"]) == (5, 7)
  for k, want in enumerate(whole):
    np.testing.assert_allclose(resumed[k], want, rtol=1e-6, atol=1e-6)
