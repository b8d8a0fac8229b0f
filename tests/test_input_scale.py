"""Issue 19: input at scale.

Start-up lists files without decoding them (and caches the listing); each
worker decodes only its rows of every global batch, split exactly as
tf.distribute splits it; undecodable images are skipped, counted and named
(or, with --strict_images, one error line); `--eval_dataset` and
`train/`+`val/` folders give evaluation data.
"""
import json
import os
import shutil
import time

import numpy as np
import pytest
import tensorflow as tf

from conftest import engine_cmd, run_job, tiny_config
from engine.core import inputs
from engine.data import decode, folder, to_tfds
from engine.distribute import strategy as strategy_lib
from engine.errors import ConfigError
from engine.tasks import image_classification
import test_multi_worker as mw

CLASSES = ("ant", "bee", "cat")
PER_CLASS = 12
BAD = ("bee/0100.jpg", "cat/0001.png", "ant/0200.gif")  # planted, unreadable
GLOBAL_BATCH = 8


def _plant(root):
  for name in BAD:
    with open(os.path.join(root, name), "wb") as f:
      f.write(b"\xff\xd8 not really an image")  # a JPEG start, then junk
  return root


@pytest.fixture(scope="session")
def images(tmp_path_factory):
  """(clean folder, folder with BAD planted): 36 good 8x8 images each."""
  base = tmp_path_factory.mktemp("images")
  clean = to_tfds.write_sample_folder(str(base / "clean"), CLASSES, PER_CLASS,
                                     size=(8, 8))
  shutil.copytree(clean, str(base / "bad"))
  return clean, _plant(str(base / "bad"))


@pytest.fixture(scope="session")
def tfds_dir(images, tmp_path_factory):
  """The clean folder as tfds data set ant_bee_cat, 4 files of 9 examples."""
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  to_tfds.write(f"folder:{images[0]}", "ant_bee_cat", data_dir, num_shards=4)
  return data_dir


def _sources(clean, data_dir):
  """The three kinds of data set, each 36 examples (folder: all of them)."""
  return {
      "synthetic": dict(dataset="synthetic", synthetic_examples=36),
      "folder": dict(dataset=f"folder:{clean}"),
      "tfds": dict(dataset="ant_bee_cat", data_dir=data_dir),
  }


@pytest.fixture(scope="session")
def big_folder(tmp_path_factory):
  """20,000 tiny JPEGs in 4 classes, written fast: one encoded image, copied."""
  root = tmp_path_factory.mktemp("big")
  payload = tf.io.encode_jpeg(np.full((8, 8, 3), 128, np.uint8)).numpy()
  for c in range(4):
    os.makedirs(root / f"c{c}")
    for i in range(5000):
      with open(root / f"c{c}" / f"{i:05d}.jpg", "wb") as f:
        f.write(payload)
  return str(root)


def _job(dataset, model_dir, **kw):
  base = dict(dataset=f"folder:{dataset}", batch_size_per_replica=GLOBAL_BATCH,
              strategy="one_device", train_steps=0, epochs=1,
              model_dir=str(model_dir))
  base.update(kw)
  return tiny_config(**base)


def _rows(pipeline, steps):
  """Label values per element of a pipeline: one list per replica batch."""
  return [y.numpy().tolist() for _, y in pipeline.take(steps)]


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_replica_rows_are_exactly_tf_distributes(drop_remainder):
  # 20 examples, global batch 8: a partial batch of 4 inside the stream.
  j = tiny_config(synthetic_examples=20, batch_size_per_replica=2,
                  cpu_devices=4, drop_remainder=drop_remainder)
  strategy = strategy_lib.make_strategy(j.config.distribution)
  data = inputs.TrainData(j.task(), inputs.input_context(strategy),
                          j.config.data, GLOBAL_BATCH, 7)
  theirs = iter(strategy.experimental_distribute_dataset(data.batches()))
  ours = data.distribute(strategy)
  for _ in range(7):
    want, got = next(theirs)[1].values, next(ours)[1].values
    assert [w.numpy().tolist() for w in want] == [
        g.numpy().tolist() for g in got]
  # Ours are built by the per-worker function, one pipeline of 4 replicas.
  direct = data.worker_batches(tf.distribute.InputContext(1, 0, 4))
  assert sum(len(r) for r in _rows(direct, 4)) == GLOBAL_BATCH


class _FirstSteps(inputs.TrainData):
  """TrainData whose global batches end after `steps`, so that a worker's
  pipeline can be read to its end: no read-ahead is left uncounted."""
  steps = 3

  def global_items(self, start_step=0):
    return super().global_items(start_step).take(self.steps)


def read_workers(j, workers, data_class):
  """Each worker's own training pipeline (`data_class`, a TrainData whose
  pipelines end) read to its end: per worker, the decode counter's counts
  and the rows it got."""
  per_worker = []
  for w in range(workers):
    context = tf.distribute.InputContext(workers, w, workers)
    data = data_class(j.task(), context, j.config.data, GLOBAL_BATCH, 7)
    decode.counter.reset()
    rows = 0
    try:
      for _, labels in data.worker_batches(context):
        rows += len(labels)
    except tf.errors.OpError:  # the end of a pipeline asserted endless
      pass
    per_worker.append((dict(decode.counter.counts), rows))
  return per_worker


def _counts(j, workers):
  """(images decoded, rows got) per step of each worker's own pipeline."""
  steps = _FirstSteps.steps
  return [(sum(counts.values()) / steps, rows / steps)
          for counts, rows in read_workers(j, workers, _FirstSteps)]


def test_each_worker_decodes_its_share_for_every_source(images, tfds_dir):
  decode.counter.enabled = True
  try:
    for name, kw in _sources(images[0], tfds_dir).items():
      j = tiny_config(batch_size_per_replica=GLOBAL_BATCH, shuffle_buffer=0,
                      **kw)
      for workers in (1, 2, 4):
        # (decoded, rows got) per worker per step: both the global batch / N.
        assert _counts(j, workers) == [(GLOBAL_BATCH / workers,) * 2] * (
            workers), (name, workers)
  finally:
    decode.counter.enabled = False


def _eval_counts(j, workers):
  """(images decoded, rows got, reads to the end) of each worker's own
  pipeline over one evaluation pass."""
  per_worker = []
  for w in range(workers):
    context = tf.distribute.InputContext(workers, w, workers)
    data = inputs.eval_inputs(j.task(), context, GLOBAL_BATCH)
    decode.counter.reset()
    rows = sum(len(labels) for _, labels in data.worker_batches(context))
    per_worker.append((sum(decode.counter.counts.values()), rows,
                       data.until_end))
  return per_worker


def test_each_worker_decodes_its_share_of_the_evaluation(images, tfds_dir):
  # 36 examples in global batches of 8: 8, 8, 8, 8 and a partial 4. A worker
  # used to decode every image of every batch and keep its rows only.
  decode.counter.enabled = True
  try:
    for name, kw in _sources(images[0], tfds_dir).items():
      j = tiny_config(batch_size_per_replica=GLOBAL_BATCH, eval_split="train",
                      **kw)
      for workers in (1, 2, 4):
        # tfds in 4 files: FILE sharding on 2 and 4 workers (each reads its
        # own files to the end), the same share.
        file_sharded = name == "tfds" and workers > 1
        assert _eval_counts(j, workers) == [(36 // workers, 36 // workers,
                                             file_sharded)] * workers, (
                                                 name, workers)
  finally:
    decode.counter.enabled = False


AUGMENT = "flip,crop"


@pytest.fixture(scope="module")
def one_replica_on_bad(images, tmp_path_factory):
  """(model_dir, engine.Result) of one epoch on one replica on the folder
  with BAD planted, augmented (--augment=flip,crop) and checkpointed every 2
  steps: the run that the 4-replica run, the resume from its checkpoint of
  step 2 (test_corrupt_images_are_skipped_counted_named_and_parity) and the
  2-worker launch (test_two_workers_skip_the_same_images_and_match_one_replica)
  are compared with; its checkpoint of step 2 is also the one
  test_evaluation_is_the_same_on_one_replica_two_replicas_and_two_workers
  evaluates."""
  model_dir = tmp_path_factory.mktemp("one_replica")
  result = run_job(_job(images[1], model_dir, augment=AUGMENT,
                        checkpoint_every=2, weights_out="w.npz"))
  return model_dir, result


def test_corrupt_images_are_skipped_counted_named_and_parity(
    images, one_replica_on_bad, tmp_path, capfd):  # pylint: disable=redefined-outer-name
  """One epoch on 1 and on 4 replicas: the bad images skipped, counted and
  named, the same weights; a resume from step 2 ends with them too. (The
  bad rows are dropped after augmentation, so both runs augment: the
  1-replica run is the module's, shared with the 2-worker launch.)"""
  _, bad = images
  model_dir, one = one_replica_on_bad
  four = run_job(_job(bad, tmp_path / "four", strategy="mirrored",
                      cpu_devices=4, batch_size_per_replica=2,
                      augment=AUGMENT))
  err = capfd.readouterr().err  # the 4-replica run's
  for result in (one, four):
    assert result.summary["skipped_images"] == len(BAD)
    # One epoch: every good image once, the bad ones never.
    good = len(folder.list_images(f"folder:{bad}").paths) - len(BAD)
    assert result.history["examples"].sum() == good
  for k, w in enumerate(one.weights):
    np.testing.assert_allclose(four.weights[k], w, rtol=1e-5, atol=1e-6)
  for name in BAD:
    assert os.path.join(bad, name) in err
  assert "warning: skipped image(s) that cannot be decoded" in err
  # Resume stays exact: the 1-replica run's checkpoint of step 2 (the state
  # a run stopped there leaves), then the rest, gives the same weights.
  mw.start_from_checkpoint(model_dir, tmp_path / "resume", 2)
  resumed = run_job(_job(bad, tmp_path / "resume", augment=AUGMENT))
  assert resumed.summary["start_step"] == 2
  for k, w in enumerate(one.weights):
    np.testing.assert_allclose(resumed.weights[k], w, rtol=1e-6, atol=1e-7)


def test_strict_images_is_one_error_line(images, tmp_path):
  """One ConfigError line naming the first bad file met. On the command
  line it is that line and exit 2 without a traceback: the 2-worker test
  below (test_strict_images_on_two_workers_ends_both_bounded) runs it; here
  in-process, without a TensorFlow start."""
  _, bad = images
  with pytest.raises(ConfigError) as caught:
    run_job(_job(bad, tmp_path / "m", strict_images=True, shuffle_buffer=0))
  # No shuffle: the first bad file met is the first in the list's order.
  first = next(p for p in folder.list_images(f"folder:{bad}").paths
               if os.path.relpath(p, bad) in BAD)
  assert f"error: {caught.value}" == (
      f"error: --strict_images: cannot decode {first}; fix or remove it (the "
      "latest checkpoint is intact).")


def test_train_val_folder_and_eval_dataset(images, tmp_path):
  clean, _ = images
  root = tmp_path / "tv"
  shutil.copytree(clean, root / "train")
  to_tfds.write_sample_folder(str(root / "val"), CLASSES, 3, size=(8, 8))
  result = run_job(_job(str(root), tmp_path / "m", train_steps=2,
                        eval_split=""))
  assert result.summary["eval_examples"] == 3 * len(CLASSES)  # all of val/
  # The same val/ folder given as --eval_dataset.
  result = run_job(_job(clean, tmp_path / "m2", train_steps=2,
                        eval_dataset=f"folder:{root / 'val'}"))
  assert result.summary["eval_examples"] == 3 * len(CLASSES)
  # A class missing from val/: one line naming it.
  shutil.rmtree(root / "val" / "bee")
  with pytest.raises(ConfigError) as e:
    run_job(_job(str(root), tmp_path / "m3", train_steps=2))
  assert str(e.value) == (
      f"--dataset=folder:{root}: class 'bee' is in {root / 'train'} but "
      f"missing from {root / 'val'}; both need the same classes.")


def test_startup_lists_without_decoding(big_folder, tmp_path):
  j = _job(big_folder, tmp_path / "m", batch_size_per_replica=64)
  start = time.perf_counter()
  data = inputs.TrainData(j.task(), tf.distribute.InputContext(),
                          j.config.data, 64, 7)
  next(iter(data.batches()))
  seconds = time.perf_counter() - start
  assert data.num_examples == 20000
  # The old start-up scan alone (decoding all 20,000 once) took 5.3 s on
  # the 2-core test machine; listing them takes 0.02 s, this whole start
  # about 0.3 s.
  assert seconds < 2.5, seconds


def test_listing_cache_is_reused_and_invalidated(images, tmp_path,
                                                  monkeypatch):
  clean, _ = images
  root = str(tmp_path / "f")
  shutil.copytree(clean, root)
  cache = str(tmp_path / "model_dir")
  first = folder.list_images(f"folder:{root}", cache)
  assert len(os.listdir(os.path.join(cache, "listings"))) == 1
  real_scan = folder.scan
  monkeypatch.setattr(folder, "scan", lambda *a: pytest.fail("listed again"))
  assert folder.list_images(f"folder:{root}", cache) == first  # reused
  monkeypatch.setattr(folder, "scan", real_scan)
  shutil.copy(first.paths[0], os.path.join(root, "cat", "9999.jpg"))
  changed = folder.list_images(f"folder:{root}", cache)
  assert len(changed.paths) == len(first.paths) + 1
  # The task caches in model_dir when the CLI gives it one.
  task = image_classification.ImageClassification(
      image_classification.ImageClassificationConfig(
          model="small_cnn", dataset=f"folder:{root}"), listing_dir=cache)
  assert task.num_examples("train") == len(changed.paths)


def test_two_workers_skip_the_same_images_and_match_one_replica(
    images, one_replica_on_bad, tmp_path):  # pylint: disable=redefined-outer-name
  # The suite's one launcher test of issue 19: each worker decodes its own
  # rows, skips the bad ones among them, and the all-reduced count keeps the
  # loss the mean over the examples really there. Augmentation runs on each
  # worker's rows, by their positions in the global batch, before the bad
  # rows are dropped: the same examples as on one replica (the module's
  # 1-replica run).
  _, bad = images
  out = mw.launch([
      f"--dataset=folder:{bad}", "--model=small_cnn", "--image_size=32",
      f"--batch_size_per_replica={GLOBAL_BATCH // 2}", "--epochs=1",
      "--steps_per_loop=3", "--seed=7", "--noexport", f"--augment={AUGMENT}",
      f"--model_dir={tmp_path / 'mw'}", "--weights_out=w.npz"])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  summary = json.loads((tmp_path / "mw" / "summary.json").read_text())
  assert summary["num_workers"] == 2
  assert summary["skipped_images"] == len(BAD)
  # Each bad file is named by the worker whose rows held it.
  for name in BAD:
    assert os.path.join(bad, name) in out.stdout + out.stderr
  # The chief cached the listing in model_dir.
  assert os.listdir(tmp_path / "mw" / "listings")
  _, ref = one_replica_on_bad
  got = np.load(tmp_path / "mw" / "w.npz")
  for k, want in enumerate(ref.weights):
    np.testing.assert_allclose(got[f"arr_{k}"], want, rtol=1e-5, atol=1e-6)


def test_evaluation_is_the_same_on_one_replica_two_replicas_and_two_workers(
    images, one_replica_on_bad, tmp_path):  # pylint: disable=redefined-outer-name
  # Evaluation of one checkpoint (the module's 1-replica run's of step 2) on
  # the folder with BAD planted: 35 of 38 images decode, in global batches
  # of 8, 8, 8, 8 and a partial 6 (3 and 3 rows on 2 replicas or workers,
  # two of worker 1's dropped as undecodable); --mode=eval on 1 and 2
  # replicas and on 2 workers through the launcher.
  _, bad = images
  good = len(folder.list_images(f"folder:{bad}").paths) - len(BAD)
  model_dir, _ = one_replica_on_bad
  ckpt = str(model_dir / "checkpoints" / "ckpt-2")
  ev = dict(mode="eval", checkpoint=ckpt, eval_split="train")
  one = run_job(_job(bad, tmp_path / "one", **ev)).summary
  two = run_job(_job(bad, tmp_path / "two", strategy="mirrored",
                     cpu_devices=2, batch_size_per_replica=GLOBAL_BATCH // 2,
                     **ev)).summary
  out = mw.launch([
      f"--dataset=folder:{bad}", "--model=small_cnn", "--image_size=32",
      f"--batch_size_per_replica={GLOBAL_BATCH // 2}", "--mode=eval",
      f"--checkpoint={ckpt}", "--eval_split=train", "--noexport",
      f"--model_dir={tmp_path / 'mw'}"])
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  workers = json.loads((tmp_path / "mw" / "eval.json").read_text())
  assert (two["num_replicas"], workers["num_workers"]) == (2, 2)
  for s in (one, two, workers):
    assert (s["global_step"], s["eval_examples"]) == (2, good)
  for key in ("eval_loss", "eval_accuracy"):
    np.testing.assert_allclose([two[key], workers[key]], [one[key]] * 2,
                               rtol=1e-6, err_msg=key)
  assert 0.0 < one["eval_loss"] < 10.0


def test_strict_images_on_two_workers_ends_both_bounded(images, tmp_path):
  # ant's 12th image corrupt: example 33, in the last batch (32..35, split 2
  # and 2), so worker 0 meets it at step 5, after checkpoints at 2 and 4.
  clean, _ = images
  root = tmp_path / "f"
  shutil.copytree(clean, root)
  corrupt = sorted((root / "ant").iterdir())[11]
  corrupt.write_bytes(b"\xff\xd8 not really an image")
  model_dir = tmp_path / "m"
  hosts = ",".join(f"127.0.0.1:{p}" for p in mw.free_ports(2))
  logs = [tmp_path / f"w{i}.log" for i in range(2)]
  procs = []
  try:
    for i in range(2):
      procs.append(mw._start(engine_cmd(  # pylint: disable=protected-access
          "--strategy=multi_worker", f"--worker_hosts={hosts}",
          f"--task_index={i}", f"--dataset=folder:{root}", "--model=small_cnn",
          "--image_size=32", f"--batch_size_per_replica={GLOBAL_BATCH // 2}",
          "--epochs=1", "--strict_images", "--shuffle_buffer=0",
          "--steps_per_loop=2", "--checkpoint_every=2", "--noexport",
          "--collective_timeout=30", f"--model_dir={model_dir}"),
          open(logs[i], "w")))
    # Both end within 2 minutes (TimeoutExpired otherwise), neither hangs.
    deadline = time.monotonic() + 120
    codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
  finally:
    mw._kill(procs)  # pylint: disable=protected-access
  texts = [log.read_text() for log in logs]
  errors = [[l for l in t.splitlines() if l.startswith("error:")]
            for t in texts]
  assert codes[0] == 2, texts[0][-3000:]
  assert errors[0] == [f"error: --strict_images: cannot decode {corrupt}; "
                       "fix or remove it (the latest checkpoint is intact)."]
  # The peer, waiting for worker 0 in step 5's all-reduce, names it lost.
  assert codes[1] == 3, texts[1][-3000:]
  assert len(errors[1]) == 1 and errors[1][0].startswith(
      "error: lost task worker:0 "), errors[1]
  assert not any("Traceback" in t for t in texts)
  latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
  assert latest.endswith("ckpt-4")
  assert tf.train.load_variable(
      latest, "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 4


def test_a_skipped_image_is_named_once_however_often_it_is_met(
    images, tmp_path, capfd):
  """Three epochs and an evaluation of the same split every 2 steps meet
  each bad image again and again (prefetching, ahead too): stderr names it
  once for training and once for evaluation; summary.json counts every
  skip."""
  _, bad = images
  capfd.readouterr()
  result = run_job(_job(bad, tmp_path, epochs=3, eval_split="train",
                        eval_every=2))
  err = capfd.readouterr().err
  assert result.summary["skipped_images"] == 3 * len(BAD)
  for name in BAD:
    assert err.count(os.path.join(bad, name)) == 2, err[-3000:]
