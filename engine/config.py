"""The run's configuration: frozen sections by concern, defaults in one place.

Each component receives the section it reads (or plain arguments), never the
whole `Config`. The command line (engine/cli.py) builds one from flags whose
names are the field names; Python users build one without absl:

    config = engine.Config.create(train_steps=1000, batch_size_per_replica=64,
                                  model_dir="/tmp/run")
    config = config.replace(learning_rate=0.01)

Every section validates itself when it is made, naming the flag and the value
of the first bad field; `Config` checks the combinations across sections.
"""
import dataclasses
import os
import re
from typing import Any, Dict, Optional, Tuple, Union

from engine.errors import ConfigError, flag_error

STRATEGIES = ("one_device", "mirrored", "multi_worker")
CROSS_DEVICE_OPS = ("auto", "nccl", "ring", "hierarchical_copy",
                    "reduce_to_one_device")
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop", "lion")
LR_SCHEDULES = ("constant", "cosine", "linear", "exponential", "piecewise")
LR_SCALINGS = ("none", "linear")
# Decoupled weight decay spares biases and normalization scales and offsets
# (Keras names them gamma and beta), matched on variable paths such as
# "dense/bias" or "batch_normalization/gamma".
WEIGHT_DECAY_EXCLUDE = r"(^|/)(bias|gamma|beta)$"
GRAD_COMPRESSIONS = ("none", "fp16", "bf16")
MIXED_PRECISIONS = ("none", "mixed_float16", "mixed_bfloat16")
_COPY_OPS = ("hierarchical_copy", "reduce_to_one_device")
MODES = ("train_and_eval", "train", "eval")
# --seed: TensorFlow takes a global seed modulo 2**31 - 1, so larger seeds
# would repeat smaller ones' orders and weights.
SEED_MAX = 2**31 - 2


def _one_of(flag, value, valid):
  if value not in valid:
    raise flag_error(flag, value, f"unknown; valid: {', '.join(valid)}.")


def _positive(section, *names):
  for name in names:
    value = getattr(section, name)
    if not (isinstance(value, int) and value > 0):
      raise flag_error(name, value, "must be a positive integer.")


def _non_negative(section, *names):
  for name in names:
    value = getattr(section, name)
    if not (isinstance(value, int) and value >= 0):
      raise flag_error(name, value, "must be a non-negative integer.")


def _regex(flag, value):
  try:
    re.compile(value)
  except re.error as e:
    raise flag_error(flag, value, f"is not a regular expression ({e}).") from e


def _positive_float(section, *names):
  for name in names:
    value = getattr(section, name)
    if not (isinstance(value, (int, float)) and value > 0):
      raise flag_error(name, value, "must be positive.")


@dataclasses.dataclass(frozen=True)
class DistributionConfig:
  """Replicas, workers and what travels between them."""
  strategy: str = "mirrored"
  cross_device_ops: str = "auto"
  devices: Tuple[str, ...] = ()
  cpu_devices: int = 0
  # Multi-worker cluster (read when strategy == "multi_worker").
  worker_hosts: Tuple[str, ...] = ()
  task_index: int = -1
  init_timeout: float = 180.0
  collective_timeout: float = 60.0
  bytes_per_pack: int = 0
  grad_compression: str = "none"  # dtype of gradients on the wire
  sync_batchnorm: bool = False  # BatchNormalization over the global batch

  def __post_init__(self):
    _one_of("strategy", self.strategy, STRATEGIES)
    _one_of("cross_device_ops", self.cross_device_ops, CROSS_DEVICE_OPS)
    _one_of("grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
    _non_negative(self, "cpu_devices", "bytes_per_pack")
    _positive_float(self, "init_timeout", "collective_timeout")
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
    if self.strategy == "multi_worker" and self.cross_device_ops in _COPY_OPS:
      raise flag_error("cross_device_ops", self.cross_device_ops,
                       "is a MirroredStrategy option; multi_worker takes "
                       "auto, ring or nccl.")
    if self.strategy == "multi_worker" and (self.devices or self.cpu_devices):
      raise flag_error("cpu_devices" if self.cpu_devices else "devices",
                       self.cpu_devices or ",".join(self.devices),
                       "is not used by --strategy=multi_worker, which takes "
                       "every local GPU, else one CPU, per worker; drop it.")
    if self.bytes_per_pack and self.cross_device_ops in _COPY_OPS:
      raise flag_error("bytes_per_pack", self.bytes_per_pack,
                       f"--cross_device_ops={self.cross_device_ops} does not "
                       "pack; packing needs a collective all-reduce (auto, "
                       "ring or nccl).")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """How the engine batches the task's examples."""
  batch_size_per_replica: int = 64
  shuffle_buffer: int = 1024  # training examples shuffled per epoch; 0: none
  drop_remainder: bool = False  # drop each epoch's partial last batch
  # Each worker reads only its own files (engine/core/sharded_inputs.py):
  # reading falls as 1/N, but the global batch depends on the worker count.
  shard_files: bool = False

  def __post_init__(self):
    _positive(self, "batch_size_per_replica")
    _non_negative(self, "shuffle_buffer")


@dataclasses.dataclass(frozen=True)
class OptimizationConfig:
  """The optimizer and how each update is computed."""
  optimizer: str = "adam"
  learning_rate: float = 0.001
  momentum: float = 0.0
  grad_accum_steps: int = 1  # micro-batches summed locally per all-reduce
  mixed_precision: str = "none"  # Keras dtype policy of the model
  jit_compile: bool = False  # XLA for the forward/backward pass
  nesterov: bool = False  # sgd only
  # Decoupled weight decay (Keras's `weight_decay`); 0 = none.
  weight_decay: float = 0.0
  weight_decay_exclude: str = WEIGHT_DECAY_EXCLUDE  # regex over variable paths
  clip_global_norm: float = 0.0  # of the all-reduced gradient; 0 = off
  # The learning-rate schedule (engine/core/schedules.py), in optimizer
  # updates; cross-field checks that need the run's length happen there.
  lr_schedule: str = "constant"
  warmup_steps: int = 0
  warmup_epochs: int = 0
  lr_scaling: str = "none"  # linear: x global batch / base_batch_size
  base_batch_size: int = 256
  lr_boundaries: Tuple[int, ...] = ()  # piecewise: steps
  lr_values: Tuple[float, ...] = ()  # piecewise: len(lr_boundaries) + 1
  lr_decay_rate: float = 0.0  # exponential: factor per lr_decay_steps
  lr_decay_steps: int = 0
  # BatchNormalization on TF's fused kernel in training (engine/core/
  # batchnorm.py); False: Keras's own layer.
  fused_batchnorm: bool = True

  def __post_init__(self):
    _one_of("optimizer", self.optimizer, OPTIMIZERS)
    _one_of("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
    _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
    _one_of("lr_scaling", self.lr_scaling, LR_SCALINGS)
    _positive(self, "grad_accum_steps", "base_batch_size")
    _non_negative(self, "warmup_steps", "warmup_epochs", "lr_decay_steps")
    _positive_float(self, "learning_rate")
    if not 0.0 <= self.momentum < 1.0:
      raise flag_error("momentum", self.momentum, "must be in [0, 1).")
    _check_update_rule(self)
    _check_schedule(self)


def _non_negative_float(section, *names):
  for name in names:
    value = getattr(section, name)
    if not (isinstance(value, (int, float)) and value >= 0):
      raise flag_error(name, value, "must not be negative.")


def _check_update_rule(opt: "OptimizationConfig") -> None:
  """Nesterov, weight decay and clipping, each only where it means something."""
  _non_negative_float(opt, "weight_decay", "clip_global_norm")
  if opt.nesterov and (opt.optimizer != "sgd" or opt.momentum == 0):
    raise flag_error("nesterov", True, "needs --optimizer=sgd with "
                     "--momentum > 0 (it is Nesterov momentum).")
  if opt.optimizer == "adamw" and opt.weight_decay == 0:
    raise flag_error("weight_decay", opt.weight_decay,
                     "--optimizer=adamw needs a positive --weight_decay "
                     "(without one it is adam), e.g. 0.05.")
  _regex("weight_decay_exclude", opt.weight_decay_exclude)


def _check_schedule(opt: "OptimizationConfig") -> None:
  """What can be checked without the run's length (see schedules.py)."""
  if opt.warmup_steps and opt.warmup_epochs:
    raise flag_error("warmup_epochs", opt.warmup_epochs,
                     "cannot be combined with --warmup_steps; set one.")
  _non_negative_float(opt, "lr_decay_rate")
  exponential = opt.lr_schedule == "exponential"
  for name in ("lr_decay_rate", "lr_decay_steps"):
    if exponential and not getattr(opt, name) > 0:
      raise flag_error(name, getattr(opt, name), "--lr_schedule=exponential "
                       "needs a positive value.")
    if not exponential and getattr(opt, name):
      raise flag_error(name, getattr(opt, name), "is used only by "
                       "--lr_schedule=exponential.")
  bounds, values = opt.lr_boundaries, opt.lr_values
  text = lambda items: ",".join(str(v) for v in items)
  if opt.lr_schedule != "piecewise":
    if bounds or values:
      raise flag_error("lr_boundaries" if bounds else "lr_values",
                       text(bounds or values),
                       "is used only by --lr_schedule=piecewise.")
    return
  if not all(isinstance(b, int) and b > 0 for b in bounds) or any(
      a >= b for a, b in zip(bounds, bounds[1:])):
    raise flag_error("lr_boundaries", text(bounds), "must be strictly "
                     "increasing positive steps, e.g. 1000,2000.")
  if len(values) != len(bounds) + 1:
    raise flag_error("lr_values", text(values), f"needs {len(bounds) + 1} "
                     f"values (one more than the {len(bounds)} "
                     "--lr_boundaries), e.g. 0.1,0.01,0.001 for 2.")
  if not all(isinstance(v, (int, float)) and v > 0 for v in values):
    raise flag_error("lr_values", text(values), "must be positive.")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """How long to train, how steps are grouped, when to evaluate."""
  epochs: int = 5
  train_steps: int = 0  # 0 = run `epochs` epochs
  # Steps per host call, or "auto": about one call a second
  # (engine/core/pace.py).
  steps_per_loop: Union[int, str] = "auto"
  eval_every: int = 0  # steps between evaluations; 0 = at each epoch's end
  seed: int = 42  # weights and data order
  # Host memory: keep large CPU tensors in malloc's heap
  # (engine/distribute/memory.py).
  malloc_tuning: bool = True
  mode: str = "train_and_eval"  # or "train" (no evaluation), "eval" (only)
  # Decay of an exponential moving average of the trainable weights
  # (engine/core/ema.py); 0 = none. Evaluation and export use the average.
  ema_decay: float = 0.0
  # Stop after N evaluations without improvement of --keep_best's metric
  # (eval_loss when none is named); 0 = never.
  early_stopping_patience: int = 0

  def __post_init__(self):
    loop = self.steps_per_loop
    if loop != "auto" and not (isinstance(loop, int) and loop > 0):
      raise flag_error("steps_per_loop", loop, "must be a positive integer "
                       "or auto (about one host call a second).")
    _non_negative(self, "epochs", "train_steps", "eval_every",
                  "early_stopping_patience")
    _one_of("mode", self.mode, MODES)
    if not (isinstance(self.seed, int) and 0 <= self.seed <= SEED_MAX):
      raise flag_error("seed", self.seed, f"must be an integer from 0 to "
                       f"{SEED_MAX} (TensorFlow takes seeds modulo "
                       "2**31 - 1).")
    if self.epochs == 0 and self.train_steps == 0:
      raise flag_error("epochs", 0, "must be positive when --train_steps=0; "
                       "set one of them")
    if not (isinstance(self.ema_decay, (int, float)) and
            (self.ema_decay == 0 or 0 < self.ema_decay < 1)):
      raise flag_error("ema_decay", self.ema_decay,
                       "must be 0 (no average) or in (0, 1), e.g. 0.999.")
    if self.mode == "train" and (self.early_stopping_patience or
                                 self.eval_every):
      flag = ("early_stopping_patience" if self.early_stopping_patience
              else "eval_every")
      raise flag_error(flag, getattr(self, flag),
                       "needs evaluation, which --mode=train skips; use "
                       "--mode=train_and_eval.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Where results go, checkpoints and resume."""
  model_dir: str = "/tmp/tfengine"
  checkpoint_every: int = 0  # steps; 0 = only at the end
  keep_checkpoints: int = 5
  allow_resume_change: bool = False
  # Exchange the stop flag after every host call (coordinated preemption).
  preemption_sync: bool = True
  weights_out: str = ""  # file name in model_dir for final weights (.npz)
  # An evaluation metric ("eval_accuracy", "eval_loss", ...): the best
  # evaluation's checkpoint and export go to model_dir/best; "" = none.
  keep_best: str = ""
  # --mode=eval: the checkpoint to evaluate (a path prefix such as
  # .../checkpoints/ckpt-100, or a directory: its latest); "" = the latest
  # in model_dir/checkpoints.
  checkpoint: str = ""

  def __post_init__(self):
    _non_negative(self, "checkpoint_every")
    _positive(self, "keep_checkpoints")
    if self.keep_best and not self.keep_best.startswith("eval_"):
      raise flag_error("keep_best", self.keep_best,
                       "names an evaluation metric, e.g. eval_loss or "
                       "eval_accuracy.")
    if os.path.basename(self.weights_out) != self.weights_out:
      raise flag_error("weights_out", self.weights_out,
                       "is a file name inside --model_dir, not a path.")


@dataclasses.dataclass(frozen=True)
class ReportingConfig:
  """What users see: logs, progress, TensorBoard, profiler, export."""
  log_every: int = 10
  summary_every: int = 10  # TensorBoard scalars every N steps; 0 = none
  progress: bool = True  # a progress bar when stdout is a terminal
  profile_steps: Tuple[int, ...] = ()  # (START, END): trace those steps
  export: bool = True  # write the model for serving at the end
  export_dir: str = ""  # "" = model_dir/export

  def __post_init__(self):
    _positive(self, "log_every")
    _non_negative(self, "summary_every")
    if self.profile_steps and not (
        len(self.profile_steps) == 2 and
        all(isinstance(s, int) for s in self.profile_steps) and
        1 <= self.profile_steps[0] <= self.profile_steps[1]):
      raise flag_error("profile_steps",
                       ",".join(str(s) for s in self.profile_steps),
                       "must be START,END with 1 <= START <= END (steps "
                       "counted from 1), e.g. 10,20.")


def _check_modes(loop: LoopConfig, ckpt: CheckpointConfig) -> None:
  """--mode against the checkpoint flags that only some modes read."""
  if loop.mode == "train" and ckpt.keep_best:
    raise flag_error("keep_best", ckpt.keep_best,
                     "needs evaluation, which --mode=train skips; use "
                     "--mode=train_and_eval.")
  if loop.mode != "eval" and ckpt.checkpoint:
    raise flag_error("checkpoint", ckpt.checkpoint,
                     "is read by --mode=eval only; training resumes from "
                     "--model_dir.")
@dataclasses.dataclass(frozen=True)
class InitializationConfig:
  """Where the weights start: fine-tuning (engine/core/init_weights.py)."""
  # A .weights.h5 / .keras file, Keras's legacy ImageNet .h5 (mobilenet_v2),
  # or a run's model_dir, checkpoints/ dir or checkpoint prefix; "" = random.
  init_weights: str = ""
  freeze: str = ""  # regex over layer names: those layers are not trained

  def __post_init__(self):
    path = self.init_weights
    if path and not (os.path.exists(path) or
                     os.path.exists(path + ".index")):
      raise flag_error("init_weights", path,
                       "does not exist; pass a .weights.h5 or .keras file, "
                       "a run's model_dir or a checkpoint prefix.")
    _regex("freeze", self.freeze)


SECTIONS = {
    "distribution": DistributionConfig,
    "data": DataConfig,
    "optimization": OptimizationConfig,
    "loop": LoopConfig,
    "checkpoints": CheckpointConfig,
    "reporting": ReportingConfig,
    "initialization": InitializationConfig,
}


def field_sections(sections=None) -> Dict[str, str]:
  """Flat field name -> the section that holds it (names are unique)."""
  out = {}
  for section, cls in (sections or SECTIONS).items():
    for f in dataclasses.fields(cls):
      out[f.name] = section
  return out


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything the engine needs for one run, in sections by concern."""
  distribution: DistributionConfig = DistributionConfig()
  data: DataConfig = DataConfig()
  optimization: OptimizationConfig = OptimizationConfig()
  loop: LoopConfig = LoopConfig()
  checkpoints: CheckpointConfig = CheckpointConfig()
  reporting: ReportingConfig = ReportingConfig()
  initialization: InitializationConfig = InitializationConfig()

  def __post_init__(self):
    _check_modes(self.loop, self.checkpoints)
    dist, opt, data = self.distribution, self.optimization, self.data
    if opt.jit_compile and dist.sync_batchnorm:
      # Synchronized BatchNorm all-reduces inside the forward pass, and a
      # collective cannot run inside the XLA-compiled function (merge_call).
      raise flag_error("jit_compile", True,
                       "cannot be combined with --sync_batchnorm, whose "
                       "all-reduces inside the forward pass XLA cannot "
                       "compile here; drop one of them.")
    if (dist.sync_batchnorm and opt.grad_accum_steps > 1 and
        not data.drop_remainder):
      # A partial batch could leave a micro-batch empty on every replica;
      # its statistics would then pull the moving averages towards zero.
      raise flag_error("sync_batchnorm", True,
                       "with --grad_accum_steps > 1 needs --drop_remainder, "
                       "so that no micro-batch is empty on every replica.")

  @classmethod
  def create(cls, **fields) -> "Config":
    """A Config from flat field names (the flag names), defaults elsewhere.

    Raises:
      ConfigError: an unknown name or a bad value.
    """
    return cls().replace(**fields)

  def replace(self, **fields) -> "Config":
    """A copy with the given flat fields changed; see `create`."""
    where = field_sections()
    unknown = sorted(set(fields) - set(where))
    if unknown:
      raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; "
                        f"valid: {', '.join(sorted(where))}.")
    changes: Dict[str, Dict[str, Any]] = {}
    for name, value in fields.items():
      if isinstance(value, list):
        value = tuple(value)
      changes.setdefault(where[name], {})[name] = value
    return dataclasses.replace(self, **{
        section: dataclasses.replace(getattr(self, section), **values)
        for section, values in changes.items()})

  def flat(self) -> Dict[str, Any]:
    """{field name: value} over all sections (the flag view)."""
    return {name: getattr(getattr(self, section), name)
            for name, section in field_sections().items()}


def get_field(config: Config, name: str, default: Optional[Any] = None):
  """A field by its flat name (for tools that list flags by name)."""
  section = field_sections().get(name)
  return default if section is None else getattr(getattr(config, section),
                                                 name)
