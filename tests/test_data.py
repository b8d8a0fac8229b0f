"""Image folders, tfds files and mock data, the cache, and every bad-data case."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from conftest import run_job, tiny_config, train_batches
from engine.data import folder, to_tfds
from engine.errors import ConfigError

CLASSES = ("cat", "dog", "fox")


@pytest.fixture(scope="module")
def pets(tmp_path_factory):
  """3 classes x 16 generated images: JPEG, PNG and BMP, 40x48 pixels."""
  root = tmp_path_factory.mktemp("pets")
  return "folder:" + to_tfds.write_sample_folder(str(root), CLASSES, 16)


def folder_config(dataset, tmp_path, **kw):
  base = dict(dataset=dataset, cpu_devices=2, batch_size_per_replica=4,
              train_split="train[:75%]", eval_split="train[75%:]",
              model_dir=str(tmp_path))
  base.update(kw)
  return tiny_config(**base)


def test_folder_listing_is_sorted_interleaved_and_splits_partition(pets):
  listing = folder.list_images(pets)
  assert listing.class_names == CLASSES
  assert len(listing.paths) == 48
  assert listing.labels[:6] == (0, 1, 2, 0, 1, 2)  # round-robin over classes
  assert listing.paths[0].endswith("cat/0000.jpg")
  assert listing.paths[4].endswith("dog/0001.png")
  assert {os.path.splitext(p)[1] for p in listing.paths} == {
      ".jpg", ".png", ".bmp"}
  from engine.data import splits  # pylint: disable=g-import-not-at-top
  train_pos = splits.select("train[:75%]", 48, "train_split")
  eval_pos = splits.select("train[75%:]", 48, "eval_split")
  assert len(train_pos) == 36 and len(eval_pos) == 12
  assert sorted(np.concatenate([train_pos, eval_pos])) == list(range(48))
  assert np.bincount(np.array(listing.labels)[eval_pos]).tolist() == [4, 4, 4]


def test_folder_trains_end_to_end_and_learns(pets, tmp_path):
  # 36 training images, global batch 8: 5 steps per epoch, the last of 4.
  result = run_job(folder_config(
      pets, tmp_path, train_steps=0, epochs=6, learning_rate=0.01,
      steps_per_loop=5, log_every=5))
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["dataset"] == pets and s["num_classes"] == 3
  assert s["class_names"] == list(CLASSES)
  assert s["global_step"] == 30
  assert result.losses[-5:].mean() < 0.5 * result.losses[:5].mean()
  assert s["eval_examples"] == 12
  assert s["eval_accuracy"] >= 0.9  # one colour per class: easy to learn


def test_batches_are_seeded_resumable_and_cover_each_epoch(pets, tmp_path):
  config = folder_config(pets, tmp_path, train_split="train[:36]")
  # Endless, and it says so: tf.distribute then adds no per-step "has every
  # worker data?" all-reduce (the synthetic set: test_training.py).
  assert (train_batches(config, 8)[0].cardinality() ==
          tf.data.INFINITE_CARDINALITY)
  first = [y.numpy() for _, y in train_batches(config, 8)[0].take(10)]
  again = [y.numpy() for _, y in train_batches(config, 8)[0].take(10)]
  later = [y.numpy() for _, y in train_batches(config, 8, 6)[0].take(4)]
  other = [y.numpy() for _, y in train_batches(
      folder_config(pets, tmp_path, seed=8), 8)[0].take(5)]
  assert [len(y) for y in first] == [8, 8, 8, 8, 4] * 2
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(first[6:], later):
    np.testing.assert_array_equal(a, b)
  assert np.bincount(np.concatenate(first[:5])).tolist() == [12, 12, 12]
  assert not all(np.array_equal(a, b) for a, b in zip(first[:5], first[5:]))
  assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_cache_in_memory_or_files_changes_nothing(pets, tmp_path):
  kw = dict(train_steps=7, epochs=1)  # 5 steps per epoch: 2 from the cache
  plain = run_job(folder_config(pets, tmp_path / "plain", **kw))
  for cache in ("memory", str(tmp_path / "imgcache")):
    cached = run_job(folder_config(pets, tmp_path / cache[-6:],
                                       cache=cache, **kw))
    np.testing.assert_array_equal(plain.losses, cached.losses)
    assert plain.summary["eval_loss"] == cached.summary["eval_loss"]
  # One cache per split, named after what it holds.
  names = {f.split(".")[0] for f in os.listdir(tmp_path)
           if f.startswith("imgcache-")}
  assert len(names) == 2, os.listdir(tmp_path)


def test_tfds_files_with_split_expressions(pets, tmp_path):
  sizes = to_tfds.write(pets, "pets_images", str(tmp_path / "tfds"),
                       num_shards=2, eval_fraction=0.25)
  assert sizes == {"train": 36, "test": 12}
  result = run_job(folder_config(
      "pets_images", tmp_path / "run", data_dir=str(tmp_path / "tfds"),
      train_split="train[:32]", eval_split="test+train[32:]", train_steps=0,
      epochs=1))
  s = result.summary
  assert s["class_names"] == list(CLASSES) and s["global_step"] == 4
  assert s["eval_examples"] == 16
  with pytest.raises(ConfigError, match=r"^--eval_split=validation: is not a "
                     r"split of pets_images \(ValueError: Unknown split"):
    run_job(folder_config("pets_images", tmp_path / "bad",
                              data_dir=str(tmp_path / "tfds"),
                              eval_split="validation"))


def test_tfds_through_mock_data_with_split_expressions(tmp_path):
  with tfds.testing.mock_data(num_examples=20):
    result = run_job(tiny_config(
        dataset="tf_flowers", train_split="train[:80%]",
        eval_split="train[80%:]", cpu_devices=2, batch_size_per_replica=4,
        train_steps=0, epochs=1, cache="memory", model_dir=str(tmp_path)))
  s = result.summary
  assert s["dataset"] == "tf_flowers" and s["num_classes"] == 5
  # mock_data yields num_examples for any split: 20 / 8 -> 3 steps.
  assert s["global_step"] == 3 and s["eval_examples"] == 20
  assert np.isfinite(s["eval_loss"]) and 0.0 <= s["eval_accuracy"] <= 1.0


def _write(path, payload: bytes):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(payload)


def _bad_folder(tmp_path, case):
  root = tmp_path / case
  os.makedirs(root)
  if case == "one_class":
    to_tfds.write_sample_folder(str(root), ["cat"], 4)
  elif case in ("class_without_images", "too_few"):
    to_tfds.write_sample_folder(str(root), ["cat", "dog"],
                               2 if case == "too_few" else 6)
  if case == "class_without_images":
    _write(str(root / "emu" / "README.txt"), b"no images here")
  return str(root)


@pytest.mark.parametrize("case,message", [
    ("empty", "needs one sub-directory per class and at least 2 classes; "
              "found 0 (none)."),
    ("one_class", "at least 2 classes; found 1 (cat)."),
    ("class_without_images", "class directory 'emu' has no images"),
    # Undecodable images are no start-up error any more (nothing is decoded
    # at start-up): they are skipped in training, tests/test_input_scale.py.
    ("too_few", "has 4 training examples, fewer than one global batch (8)"),
])
def test_bad_folder_is_one_clear_error(tmp_path, case, message):
  root = _bad_folder(tmp_path, case)
  with pytest.raises(ConfigError) as e:
    run_job(folder_config(f"folder:{root}", tmp_path / "run",
                          train_split="train", eval_split=""))
  # Too few examples is the engine's check, for any task: it names the batch.
  flag = ("--batch_size_per_replica=4: task image_classification"
          if case == "too_few" else f"--dataset=folder:{root}: ")
  assert str(e.value).startswith(flag)
  assert message.format(root=root) in str(e.value)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag,value,message", [
    ("train_split", "test", "is not a split of this data set, which has one "
                            "split, 'train', of 48 examples"),
    ("eval_split", "train[:200]", "Requested slice [:200] incompatible with "
                                  "48 examples"),
    ("eval_split", "train[5:5]", "selects no examples of the 48."),
])
def test_unknown_or_empty_split_is_refused(pets, tmp_path, flag, value,
                                           message):
  with pytest.raises(ConfigError) as e:
    run_job(folder_config(pets, tmp_path, **{flag: value}))
  assert str(e.value).startswith(f"--{flag}={value}: ")
  assert message in str(e.value)


def test_missing_folder_is_one_config_error_line(tmp_path):
  """Found when the run opens the data set, before training. The command
  line prints a ConfigError as `error: <message>`, exit 2 (engine/cli.py;
  its runs are in test_cli.py and test_api.py): checked in-process here."""
  with pytest.raises(ConfigError) as caught:
    run_job(tiny_config(dataset=f"folder:{tmp_path}/nope",
                        batch_size_per_replica=2, train_steps=1,
                        model_dir=str(tmp_path / "m")))
  message = f"error: {caught.value}"
  assert "\n" not in message and message.startswith(
      f"error: --dataset=folder:{tmp_path}/nope: is not a directory"), message
  assert not (tmp_path / "m" / "checkpoints").exists()  # nothing trained


def test_cache_and_dataset_flags_are_checked(tmp_path):
  with pytest.raises(ConfigError, match="^--cache=memory: the synthetic"):
    tiny_config(cache="memory")
  with pytest.raises(ConfigError, match="^--cache=/no/such/dir/c: directory"):
    tiny_config(dataset="folder:/x", cache="/no/such/dir/c")
  with pytest.raises(ConfigError, match="^--dataset=folder:: names no"):
    tiny_config(dataset="folder:")
  with pytest.raises(ConfigError, match="^--eval_every=-1: must be a non-neg"):
    tiny_config(eval_every=-1)
  with pytest.raises(ConfigError, match="^--eval_every=5: task image_classifi"
                     "cation has no evaluation data"):
    run_job(tiny_config(eval_every=5, model_dir=str(tmp_path)))


def test_gif_is_decoded_as_rgb(tmp_path):
  # TensorFlow cannot encode GIF; this is a 1x1 single-frame GIF89a.
  gif = bytes.fromhex("47494638396101000100800000000000ffffff21f904010000"
                      "00002c00000000010001000002024401003b")
  _write(str(tmp_path / "g.gif"), gif)
  image = folder.decode(str(tmp_path / "g.gif")).numpy()
  assert image.shape == (1, 1, 3) and image.dtype == np.uint8


def test_tfds_download_path_has_its_imports():
  # tfds reads a registered builder's code path before downloading; that
  # needs importlib_resources, which tfds does not install on Python >= 3.9
  # (tensorflow/datasets#11212) and pyproject.toml therefore lists.
  path = tfds.builder_cls("tf_flowers").code_path
  assert path is not None and os.path.basename(str(path)).startswith(
      "tf_flowers") and os.path.exists(str(path))
