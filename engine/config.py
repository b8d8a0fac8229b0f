"""The frozen configuration every library module receives.

Defaults live here and only here; `engine/main.py` turns flags into a `Config`.
"""
import dataclasses
import os
from typing import Optional, Tuple

from engine.errors import flag_error

STRATEGIES = ("one_device", "mirrored", "multi_worker")
CROSS_DEVICE_OPS = ("auto", "nccl", "ring", "hierarchical_copy",
                    "reduce_to_one_device")
OPTIMIZERS = ("adam", "sgd")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16")
MIXED_PRECISIONS = ("none", "mixed_float16", "mixed_bfloat16")


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything one training run needs; see README's flag table."""
  # Strategy and devices.
  strategy: str = "mirrored"
  cross_device_ops: str = "auto"
  devices: Tuple[str, ...] = ()
  cpu_devices: int = 0
  # Multi-worker cluster (only read when strategy == "multi_worker").
  worker_hosts: Tuple[str, ...] = ()
  task_index: int = -1
  init_timeout: float = 180.0
  collective_timeout: float = 60.0
  bytes_per_pack: int = 0
  # Model and data.
  model: str = "mobilenet_v2"
  dataset: str = "synthetic"
  data_dir: Optional[str] = None
  train_split: str = "train"
  download: bool = True
  image_size: int = 224
  num_classes: int = 10  # synthetic data set only; tfds data sets say their own
  synthetic_examples: int = 2048
  shuffle_buffer: int = 1024
  drop_remainder: bool = False
  # Schedule and optimisation.
  epochs: int = 5
  train_steps: int = 0  # 0 = run `epochs` epochs
  batch_size_per_replica: int = 64
  optimizer: str = "adam"
  learning_rate: float = 0.001
  momentum: float = 0.0
  # Host loop and output.
  steps_per_loop: int = 10
  log_every: int = 10
  model_dir: str = "/tmp/tfengine"
  weights_out: str = ""  # file name in model_dir for final weights (.npz)
  seed: int = 42
  # Checkpoints (model_dir/checkpoints).
  checkpoint_every: int = 0  # steps; 0 = only at the end
  keep_checkpoints: int = 5
  allow_resume_change: bool = False
  # Preemption (issue 4): exchange the stop flag after every host call.
  preemption_sync: bool = True
  # Data sets, evaluation and the input pipeline (issue 5).
  eval_split: str = ""  # split expression to evaluate on; "" = no evaluation
  eval_every: int = 0   # steps between evaluations; 0 = at each epoch's end
  cache: str = ""       # "" = none, "memory", or a file path prefix
  # What users see: summaries, progress, profiler, export (issue 7).
  summary_every: int = 10  # TensorBoard scalars every N steps; 0 = none
  progress: bool = True  # a progress bar when stdout is a terminal
  profile_steps: Tuple[int, ...] = ()  # (START, END): trace those steps
  export: bool = True  # write the model for serving at the end
  export_dir: str = ""  # "" = model_dir/export
  # Communication and speed (issue 6).
  grad_accum_steps: int = 1  # micro-batches summed locally per all-reduce
  grad_compression: str = "none"  # dtype of gradients on the wire
  mixed_precision: str = "none"  # Keras dtype policy of the model
  jit_compile: bool = False  # XLA for the forward/backward pass
  sync_batchnorm: bool = False  # BatchNormalization over the global batch
  # Host memory: keep large CPU tensors in malloc's heap (engine/memory.py).
  malloc_tuning: bool = True

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    """Refuses values that cannot work, naming the flag and value.

    Raises:
      ConfigError: for the first bad value found.
    """
    _one_of("strategy", self.strategy, STRATEGIES)
    _one_of("cross_device_ops", self.cross_device_ops, CROSS_DEVICE_OPS)
    _one_of("optimizer", self.optimizer, OPTIMIZERS)
    for name in ("image_size", "batch_size_per_replica", "steps_per_loop",
                 "log_every", "num_classes", "synthetic_examples",
                 "shuffle_buffer", "keep_checkpoints"):
      _positive(name, getattr(self, name))
    for name in ("epochs", "train_steps", "cpu_devices", "bytes_per_pack",
                 "checkpoint_every"):
      _non_negative(name, getattr(self, name))
    if self.epochs == 0 and self.train_steps == 0:
      raise flag_error("epochs", 0, "must be positive when --train_steps=0; "
                       "set one of them")
    for name in ("learning_rate", "init_timeout", "collective_timeout"):
      if not getattr(self, name) > 0:
        raise flag_error(name, getattr(self, name), "must be positive.")
    if os.path.basename(self.weights_out) != self.weights_out:
      raise flag_error("weights_out", self.weights_out,
                       "is a file name inside --model_dir, not a path.")
    if not 0.0 <= self.momentum < 1.0:
      raise flag_error("momentum", self.momentum, "must be in [0, 1).")
    if self.num_classes < 2:
      raise flag_error("num_classes", self.num_classes, "must be at least 2.")
    if self.image_size < 32:
      raise flag_error("image_size", self.image_size,
                       "must be at least 32 (the models downsample 5 times).")
    if len(set(self.devices)) != len(self.devices):
      raise flag_error("devices", ",".join(self.devices),
                       "lists a device twice.")
    if self.devices and self.cpu_devices:
      raise flag_error("cpu_devices", self.cpu_devices,
                       "cannot be combined with --devices; the replicas are "
                       "either the listed devices or the first N logical CPUs.")
    if self.strategy == "one_device" and len(self.devices) > 1:
      raise flag_error("devices", ",".join(self.devices),
                       "--strategy=one_device takes one device; use "
                       "--strategy=mirrored for several.")
    if self.strategy == "multi_worker" and self.cross_device_ops in (
        "hierarchical_copy", "reduce_to_one_device"):
      raise flag_error("cross_device_ops", self.cross_device_ops,
                       "is a MirroredStrategy option; multi_worker takes "
                       "auto, ring or nccl.")
    if self.strategy == "multi_worker" and (self.devices or self.cpu_devices):
      raise flag_error("cpu_devices" if self.cpu_devices else "devices",
                       self.cpu_devices or ",".join(self.devices),
                       "is not used by --strategy=multi_worker, which takes "
                       "every local GPU, else one CPU, per worker; drop it.")
    # Data sets, evaluation and the input pipeline (issue 5).
    _non_negative("eval_every", self.eval_every)
    if self.eval_every and not self.eval_split:
      raise flag_error("eval_every", self.eval_every, "needs --eval_split, "
                       "the split to evaluate on (e.g. test or train[80%:]).")
    if self.dataset in ("", "folder:"):
      raise flag_error("dataset", self.dataset, "names no data set; use "
                       "synthetic, folder:/path or a TensorFlow Datasets name.")
    if self.cache and self.dataset == "synthetic":
      raise flag_error("cache", self.cache, "the synthetic data set is "
                       "generated per batch and has nothing to cache; drop it.")
    cache_dir = os.path.dirname(os.path.abspath(self.cache))
    if self.cache not in ("", "memory") and not os.path.isdir(cache_dir):
      raise flag_error("cache", self.cache, f"directory {cache_dir} does not "
                       "exist; use memory or a path in an existing directory.")
    # What users see (issue 7).
    _non_negative("summary_every", self.summary_every)
    if self.profile_steps and not (
        len(self.profile_steps) == 2 and
        all(isinstance(s, int) for s in self.profile_steps) and
        1 <= self.profile_steps[0] <= self.profile_steps[1]):
      raise flag_error("profile_steps",
                       ",".join(str(s) for s in self.profile_steps),
                       "must be START,END with 1 <= START <= END (steps "
                       "counted from 1), e.g. 10,20.")
    # Communication and speed (issue 6).
    self._validate_comm()

  def _validate_comm(self) -> None:
    """Communication and speed (issue 6)."""
    _one_of("grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
    _one_of("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
    _positive("grad_accum_steps", self.grad_accum_steps)
    if self.bytes_per_pack and self.cross_device_ops in (
        "hierarchical_copy", "reduce_to_one_device"):
      raise flag_error("bytes_per_pack", self.bytes_per_pack,
                       f"--cross_device_ops={self.cross_device_ops} does not "
                       "pack; packing needs a collective all-reduce (auto, "
                       "ring or nccl).")
    if self.jit_compile and self.sync_batchnorm:
      # Synchronized BatchNorm all-reduces inside the forward pass, and a
      # collective cannot run inside the XLA-compiled function (merge_call).
      raise flag_error("jit_compile", True,
                       "cannot be combined with --sync_batchnorm, whose "
                       "all-reduces inside the forward pass XLA cannot "
                       "compile here; drop one of them.")
    if (self.sync_batchnorm and self.grad_accum_steps > 1 and
        not self.drop_remainder):
      # A partial batch could leave a micro-batch empty on every replica;
      # its statistics would then pull the moving averages towards zero.
      raise flag_error("sync_batchnorm", True,
                       "with --grad_accum_steps > 1 needs --drop_remainder, "
                       "so that no micro-batch is empty on every replica.")


def _one_of(flag, value, valid):
  if value not in valid:
    raise flag_error(flag, value, f"unknown; valid: {', '.join(valid)}.")


def _positive(flag, value):
  if not (isinstance(value, int) and value > 0):
    raise flag_error(flag, value, "must be a positive integer.")


def _non_negative(flag, value):
  if not (isinstance(value, int) and value >= 0):
    raise flag_error(flag, value, "must be a non-negative integer.")
