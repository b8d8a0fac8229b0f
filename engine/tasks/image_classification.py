"""The built-in job: image classification with a registered model and data set.

`python -m engine.main` is this task on the public API, exactly the path a
user's own script takes (engine/cli.py). The model comes from `models/`
(imported as engine.models; `--model`), the examples from `data/`
(engine.data; `--dataset`: synthetic, folder:/path or a TensorFlow Datasets
name), the loss and metrics from
engine/classification.py (cross-entropy; accuracy, and top-5 accuracy when
there are more than 5 classes).

    task = ImageClassification(ImageClassificationConfig(
        model="small_cnn", dataset="folder:/data/pets", image_size=64),
        seed=42)
    engine.run(task, engine.Config.create(train_steps=500))
"""
import dataclasses
import os
from typing import Dict, Optional, Tuple

from absl import flags

from engine import cli
from engine import models
from engine.errors import flag_error
from engine.options import check_options, option
from engine.task import Task

# TensorFlow, engine.data and engine.classification are imported where they are
# used: this module (the flags, the config and its checks) loads without
# TensorFlow, so `python -m engine.main` refuses a bad flag in a fraction of
# a second.

AUGMENT_OPS = ("flip", "crop")  # data/augment.py


@dataclasses.dataclass(frozen=True)
class ImageClassificationConfig:
  """The built-in task's own flags, declared as the engine's are
  (engine/options.py's `option`); validated when made."""
  model: str = option("mobilenet_v2", "The model (models/).",
                      choices=tuple(sorted(models.MODELS)))
  dataset: str = option(
      "synthetic", "synthetic, folder:/path (one sub-directory per class) or "
      "any TensorFlow Datasets name (cats_vs_dogs, ...).")
  data_dir: Optional[str] = option(None, "TensorFlow Datasets dir.")
  train_split: str = option(
      "train", "Split expression for training, e.g. train[:80%].")
  eval_split: str = option(
      "", "Split expression to evaluate on, e.g. test or train[80%:] (empty: "
      "no evaluation, unless --eval_dataset or a train/+val/ folder gives "
      "evaluation data).")
  download: bool = option(
      True, "Let tfds download and prepare a missing data set.")
  image_size: int = option(
      224, "Image side, pixels.", at_least=32,
      problem="must be at least 32 (the models downsample 5 times).")
  num_classes: int = option(
      10, "Classes of the synthetic data set (tfds data sets and folders say "
      "their own).", at_least=2, problem="must be at least 2.")
  synthetic_examples: int = option(
      2048, "Examples in one epoch of the synthetic data set.", above=0)
  cache: str = option(
      "", "Cache decoded images: memory, or a file path prefix (empty: no "
      "cache).")
  label_smoothing: float = option(
      0.0, "Label smoothing e of the cross-entropy (training and evaluation "
      "loss): 1-e on the label, e spread over all classes.", at_least=0,
      below=1, problem="must be in [0, 1), e.g. 0.1.")
  augment: str = option(
      "", "Training augmentation, a comma list: flip (random horizontal "
      "flip), crop (pad-and-crop up to 64 px, random resized crop above); "
      "seeded by --seed and the step.")
  eval_dataset: str = option(
      "", "Evaluation data elsewhere: folder:/path or a TensorFlow Datasets "
      "name (--eval_split selects in it; default: train, all of a folder).")
  strict_images: bool = option(
      False, "Stop at the first image that cannot be decoded (default: skip "
      "it, count it, name it in the log).")

  def __post_init__(self):
    check_options(self)
    if self.dataset in ("", "folder:"):
      raise flag_error("dataset", self.dataset, "names no data set; use "
                       "synthetic, folder:/path or a TensorFlow Datasets name.")
    if self.eval_dataset in ("folder:", "synthetic"):
      raise flag_error("eval_dataset", self.eval_dataset, "names no "
                       "evaluation data; use folder:/path or a TensorFlow "
                       "Datasets name.")
    if self.cache and self.dataset == "synthetic":
      raise flag_error("cache", self.cache, "the synthetic data set is "
                       "generated per batch and has nothing to cache; drop it.")
    augment_ops(self.augment)
    cache_dir = os.path.dirname(os.path.abspath(self.cache))
    if self.cache not in ("", "memory") and not os.path.isdir(cache_dir):
      raise flag_error("cache", self.cache, f"directory {cache_dir} does not "
                       "exist; use memory or a path in an existing directory.")


def augment_ops(text: str) -> Tuple[str, ...]:
  """--augment's names: 'flip,crop' -> ('flip', 'crop'); '' -> ().

  Raises:
    ConfigError: an unknown name, or one named twice.
  """
  ops = tuple(op.strip() for op in text.split(",") if op.strip())
  bad = [op for op in ops if op not in AUGMENT_OPS]
  if bad or len(set(ops)) != len(ops):
    what = f"{bad[0]!r} is unknown" if bad else "names an op twice"
    raise flag_error("augment", text, f"{what}; a comma list of "
                     f"{', '.join(AUGMENT_OPS)}, each once.")
  return ops


class ImageClassification(Task):
  """A registered model on a registered data set; see the module docstring.

  Args:
    config: the task's flags.
    seed: the run's --seed (synthetic images, tfds file order, --augment).
    init_weights: the run's --init_weights: Keras's ImageNet file for
      mobilenet_v2 makes the inputs [-1, 1], what those weights expect.
    listing_dir: where a folder's file listing is cached (the run's
      model_dir; None: no cache).
  """
  serving_input_name = "images"
  # Its preprocessing branches on Python values only (engine/task.py).
  autograph = False

  def __init__(self, config: ImageClassificationConfig, seed: int = 42,
               init_weights: str = "",
               listing_dir: Optional[str] = None):
    super().__init__(name="image_classification")
    self.config = config
    self._seed = seed
    self._augment = augment_ops(config.augment)
    # Images are [0, 1] (data/); keras.applications' ImageNet weights for
    # MobileNetV2 were trained on [-1, 1] (mobilenet_v2.preprocess_input).
    self._signed = False
    if config.model == "mobilenet_v2" and init_weights:
      from engine.core import init_weights as init_lib  # pylint: disable=g-import-not-at-top
      self._signed = init_lib.is_legacy_h5(init_weights)
    self._listing_dir = listing_dir
    self._chief = True  # worker 0 writes the listing cache
    self._sources: Dict[str, "engine.data.Source"] = {}
    self._patterns = None

  def _source(self, split: str, workers: int = 1) -> Optional["engine.data.Source"]:
    """The split's Source, read once ("train" or "eval")."""
    from engine import data  # pylint: disable=g-import-not-at-top
    if split not in self._sources:
      config, expression = self._split_plan(split)
      if not expression:
        return None
      found = data.source(
          config, expression, f"{split}_split", seed=self._seed,
          training=split == "train", num_workers=workers,
          listing_dir=self._listing_dir, chief=self._chief,
          strict=self.config.strict_images)
      if split == "eval" and self.config.eval_dataset:
        from engine.data import folder  # pylint: disable=g-import-not-at-top
        folder.check_same_classes(
            self.class_names, found.class_names, "eval_dataset",
            self.config.eval_dataset, (self.config.dataset,
                                       self.config.eval_dataset))
      self._sources[split] = found
    return self._sources[split]

  def _split_plan(self, split: str):
    """(the config to read, the split expression) of "train" or "eval"."""
    config = self.config
    if split == "train":
      return config, config.train_split
    if config.eval_dataset:
      return (dataclasses.replace(config, dataset=config.eval_dataset),
              config.eval_split or "train")
    from engine.data import folder  # pylint: disable=g-import-not-at-top
    root = folder.root_of(config.dataset)
    if (folder.is_folder(config.dataset) and os.path.isdir(root) and
        folder.split_dirs(root)):
      return config, config.eval_split or "train"  # all of val/
    return config, config.eval_split

  @property
  def class_names(self):
    return self._source("train").class_names

  @property
  def num_classes(self) -> int:
    return len(self.class_names)

  def build_model(self):
    return models.create_model(self.config.model, self.num_classes,
                               self.config.image_size)

  def build_inputs(self, split, context):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self._chief = context.input_pipeline_id == 0
    found = self._source(split, context.num_input_pipelines)
    if found is None:
      return None
    if self.config.dataset == "synthetic" and self._patterns is None:
      # Made here, eagerly: the per-batch map below only looks them up.
      from engine.data import synthetic  # pylint: disable=g-import-not-at-top
      self._patterns = tf.constant(synthetic.class_patterns(
          self.config.num_classes, self.config.image_size, self._seed))
    examples = found.examples
    # FILE lets each worker read its own files: in evaluation, and in
    # training under --shard_files (the engine sets DATA otherwise).
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = found.policy
    return examples.with_options(options)

  def num_examples(self, split):
    found = self._source(split)
    return None if found is None else found.num_examples

  def preprocess_batch(self, features, labels, training):
    # Called on each worker's own rows only (engine/core/inputs.py): the
    # images are made or decoded here, 1/N of them per worker.
    # An undecodable image's row comes back with keep False, and the engine
    # drops it after augmentation (data/decode.py).
    kind = self._source("train" if training else "eval").kind
    keep = None
    if kind == "synthetic":
      from engine.data import synthetic  # pylint: disable=g-import-not-at-top
      features, labels = synthetic.images_for(features, self._patterns,
                                              self.config.num_classes)
    elif kind != "images":  # "images": --cache, decoded before batching
      from engine.data import decode  # pylint: disable=g-import-not-at-top
      features, labels, keep = decode.decode_rows(
          features, labels, self.config.image_size,
          from_files=kind == "files", strict=self.config.strict_images,
          source=kind)
    if self._signed:
      features = features * 2.0 - 1.0
    return (features, labels) if keep is None else (features, labels, keep)

  def augment_batch(self, features, labels, step, positions):
    if not self._augment:
      return features, labels
    from engine.data import augment  # pylint: disable=g-import-not-at-top
    return augment.augment(features, step, positions, self._seed,
                           self._augment), labels

  def per_example_loss(self, labels, outputs):
    # Evaluation reports this loss too, smoothed, as Keras and official.core
    # do: the training and evaluation losses stay comparable; accuracy is
    # the measure that ignores the smoothing.
    from engine import classification  # pylint: disable=g-import-not-at-top
    return classification.cross_entropy(self.config.label_smoothing)(
        labels, outputs)

  def build_metrics(self):
    from engine import classification  # pylint: disable=g-import-not-at-top
    return classification.metrics(self.num_classes)

  def describe(self):
    source = self._source("train")
    return {"model": self.config.model, "dataset": self.config.dataset,
            "image_size": self.config.image_size,
            "num_classes": len(source.class_names),
            "class_names": list(source.class_names),
            "label_smoothing": self.config.label_smoothing,
            "augment": list(self._augment),
            "input_range": [-1, 1] if self._signed else [0, 1]}

  def serving_outputs(self, outputs):
    from engine import classification  # pylint: disable=g-import-not-at-top
    return classification.serving_outputs(outputs)


def define_flags(flag_values=flags.FLAGS, module_name=None):
  """Defines the task's flags (--model, --dataset, ...)."""
  return cli.define_dataclass_flags(
      ImageClassificationConfig, flag_values=flag_values,
      module_name=module_name or cli.caller_module())


def from_flags(config, flag_values=flags.FLAGS) -> ImageClassification:
  """The task from its parsed flags and the engine's config.

  Raises:
    ConfigError: a bad task flag, or --eval_every without --eval_split.
  """
  names = [f.name for f in dataclasses.fields(ImageClassificationConfig)]
  task_config = ImageClassificationConfig(**cli.flag_values_of(
      ImageClassificationConfig, names, flag_values))
  if (config.evaluation.eval_every and not task_config.eval_split and
      not task_config.eval_dataset and not _split_folder(task_config.dataset)):
    raise flag_error("eval_every", config.evaluation.eval_every,
                     "needs --eval_split, the split to evaluate on (e.g. "
                     "test or train[80%:]), or --eval_dataset.")
  return ImageClassification(
      task_config, seed=config.randomness.seed,
      init_weights=config.initialization.init_weights,
      listing_dir=config.checkpoints.model_dir)


def _split_folder(dataset: str) -> bool:
  """Whether `dataset` is a folder:/path with train/ + val/ (or test/).

  engine.data.folder.split_dirs's rule, restated here because data/ imports
  TensorFlow and this module's flag checks must not.
  """
  root = dataset[len("folder:"):]
  return dataset.startswith("folder:") and os.path.isdir(
      os.path.join(root, "train")) and any(
          os.path.isdir(os.path.join(root, d))
          for d in ("val", "validation", "test"))


def configs(**fields):
  """(engine Config, ImageClassificationConfig) from flat flag names.

  What `python -m engine.main --name=value ...` builds, for Python callers:

      config, image = configs(model="small_cnn", train_steps=100)
      engine.run(ImageClassification(
          image, seed=config.randomness.seed,
          init_weights=config.initialization.init_weights), config)

  Raises:
    ConfigError: an unknown name or a bad value.
  """
  from engine.config import Config  # pylint: disable=g-import-not-at-top
  names = {f.name for f in dataclasses.fields(ImageClassificationConfig)}
  image = ImageClassificationConfig(
      **{k: v for k, v in fields.items() if k in names})
  return Config.create(**{k: v for k, v in fields.items() if k not in names}
                       ), image
