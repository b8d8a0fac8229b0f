"""The run's configuration: frozen sections by concern, one source per option.

Each field is declared once, with its default, its help, its choices and its
bounds (engine/options.py's `option`); the command line's flags and help (engine/cli.py) and
docs/reference/flags.md (engine/reference.py) are made from these fields,
and each section checks its own values against them when it is made. Each
component receives the section it reads (or plain arguments), never the
whole `Config`. Python users build one without absl, by flag name:

    config = engine.Config.create(train_steps=1000, batch_size_per_replica=64,
                                  model_dir="/tmp/run")
    config = config.replace(learning_rate=0.01)

A bad value is a ConfigError naming the flag and the value; `Config` checks
the combinations across sections.
"""
import dataclasses
import os
import re
from typing import Any, Dict, Tuple, Union

from engine.errors import ConfigError, flag_error
from engine.options import check_options, option

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
CPU_ALLOCATORS = ("bfc", "tensorflow")
# --seed: TensorFlow takes a global seed modulo 2**31 - 1, so larger seeds
# would repeat smaller ones' orders and weights.
SEED_MAX = 2**31 - 2


def _regex(flag, value):
  try:
    re.compile(value)
  except re.error as e:
    raise flag_error(flag, value, f"is not a regular expression ({e}).") from e


@dataclasses.dataclass(frozen=True)
class DistributionConfig:
  """Replicas and workers, and how gradients travel between them
  (engine/distribute/)."""
  strategy: str = option("mirrored", "tf.distribute strategy.",
                         choices=STRATEGIES)
  cross_device_ops: str = option(
      "auto", "All-reduce implementation (docs/guide/performance.md says "
      "what each does).", choices=CROSS_DEVICE_OPS)
  devices: Tuple[str, ...] = option(
      (), "Replica devices, e.g. /gpu:0,/gpu:1 (default: all GPUs, else the "
      "CPU).")
  cpu_devices: int = option(
      0, "Split the host CPU into N logical devices and use them as replicas "
      "(machines with no GPU; 0: do not split).", at_least=0)
  worker_hosts: Tuple[str, ...] = option(
      (), "multi_worker: host:port of every worker, in task order.")
  task_index: int = option(
      -1, "multi_worker: this worker's index in --worker_hosts.")
  init_timeout: float = option(
      180.0, "multi_worker: seconds to wait for all workers to join.",
      above=0)
  collective_timeout: float = option(
      60.0, "The longest a step may wait on its peers (seconds) before the "
      "run ends with exit code 3.", above=0)
  bytes_per_pack: int = option(
      0, "Pack gradients into all-reduces of about this many bytes (0: "
      "TensorFlow's choice).", at_least=0)
  grad_compression: str = option(
      "none", "Cast gradients to this dtype for the all-reduce (half the "
      "bytes) and back after it.", choices=GRAD_COMPRESSIONS)

  def __post_init__(self):
    check_options(self)
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
  """How the engine batches the task's examples (engine/core/inputs.py)."""
  batch_size_per_replica: int = option(
      64, "Examples per replica per step.", above=0)
  shuffle_buffer: int = option(
      1024, "Training examples shuffled per epoch (0: the task's order).",
      at_least=0)
  drop_remainder: bool = option(False,
                                "Drop each epoch's partial last batch.")
  shard_files: bool = option(
      False, "Each worker reads only its own files of a tfds training set "
      "(1/N of the reading); the global batches then depend on the number of "
      "workers. Whole batches only.")

  def __post_init__(self):
    check_options(self)


@dataclasses.dataclass(frozen=True)
class BatchNormConfig:
  """What the engine does to the model's BatchNormalization layers
  (engine/core/batchnorm.py)."""
  sync_batchnorm: bool = option(
      False, "BatchNormalization over the global batch (Keras "
      "synchronized=True): 1 and N replicas agree.")
  fused_batchnorm: bool = option(
      True, "BatchNormalization on TensorFlow's fused kernel in training "
      "(Keras's results, fewer ops; one all-reduce per layer with "
      "--sync_batchnorm).")

  def __post_init__(self):
    check_options(self)


@dataclasses.dataclass(frozen=True)
class OptimizationConfig:
  """The optimizer, its learning-rate schedule and how each update is
  computed (engine/core/optimizers.py, schedules.py, step.py, ema.py)."""
  optimizer: str = option(
      "adam", "Optimizer (Keras's, applying the engine's all-reduced "
      "gradients).", choices=OPTIMIZERS)
  learning_rate: float = option(
      0.001, "Peak learning rate (before --lr_scaling).", above=0)
  momentum: float = option(0.0, "Momentum of sgd and rmsprop.", at_least=0,
                           below=1)
  nesterov: bool = option(False, "Nesterov momentum for --optimizer=sgd.")
  weight_decay: float = option(
      0.0, "Decoupled weight decay: each update first subtracts variable x "
      "this x the learning rate (0: none).", at_least=0)
  weight_decay_exclude: str = option(
      WEIGHT_DECAY_EXCLUDE, "Regular expression searched in variable paths "
      "(e.g. dense/bias); matching variables are not decayed. Default: "
      "biases and normalization gamma/beta.")
  clip_global_norm: float = option(
      0.0, "Clip the all-reduced mean gradient to this global norm (0: no "
      "clipping); grad_norm reports it before clipping.", at_least=0)
  grad_accum_steps: int = option(
      1, "Sum the gradients of K micro-batches of --batch_size_per_replica "
      "locally, then all-reduce and update once: one step of a K times "
      "larger batch.", above=0)
  mixed_precision: str = option(
      "none", "Keras dtype policy: float16/bfloat16 compute, float32 "
      "variables; mixed_float16 adds dynamic loss scaling.",
      choices=MIXED_PRECISIONS)
  jit_compile: bool = option(
      False, "Compile the forward/backward pass with XLA.")
  ema_decay: float = option(
      0.0, "Keep an exponential moving average of the weights with this "
      "decay (e.g. 0.999; 0: none); evaluation and export use it.",
      at_least=0, below=1,
      problem="must be 0 (no average) or in (0, 1), e.g. 0.999.")
  # The learning-rate schedule, in optimizer updates; the checks that need
  # the run's length happen in engine/core/schedules.py.
  lr_schedule: str = option(
      "constant", "Learning rate after warmup, by optimizer update: "
      "constant, cosine or linear (to 0 at the last step), exponential "
      "(--lr_decay_rate per --lr_decay_steps) or piecewise (--lr_boundaries, "
      "--lr_values).", choices=LR_SCHEDULES)
  warmup_steps: int = option(
      0, "Raise the learning rate linearly from 0 to its peak over this many "
      "updates.", at_least=0)
  warmup_epochs: int = option(
      0, "Warmup in epochs instead of --warmup_steps.", at_least=0)
  lr_scaling: str = option(
      "none", "linear: the peak learning rate is --learning_rate (or "
      "--lr_values) x global batch / --base_batch_size.",
      choices=LR_SCALINGS)
  base_batch_size: int = option(
      256, "The global batch --learning_rate is meant for "
      "(--lr_scaling=linear).", above=0)
  lr_boundaries: Tuple[int, ...] = option(
      (), "piecewise: strictly increasing steps where the learning rate "
      "changes, e.g. 3000,6000.")
  lr_values: Tuple[float, ...] = option(
      (), "piecewise: the learning rates, one more than --lr_boundaries, "
      "e.g. 0.1,0.01,0.001.")
  lr_decay_rate: float = option(
      0.0, "exponential: the factor per --lr_decay_steps updates.",
      at_least=0)
  lr_decay_steps: int = option(
      0, "exponential: updates per factor of --lr_decay_rate.", at_least=0)

  def __post_init__(self):
    check_options(self)
    _check_update_rule(self)
    _check_schedule(self)

  @property
  def loss_scaling(self) -> bool:
    """Whether updates use dynamic loss scaling: float16's range is too small
    for small gradients; bfloat16's is not."""
    return self.mixed_precision == "mixed_float16"


def _check_update_rule(opt: "OptimizationConfig") -> None:
  """Nesterov, weight decay and clipping, each only where it means something."""
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
  """How long to train and how steps are grouped into host calls
  (engine/core/host_loop.py, engine/core/pace.py)."""
  epochs: int = option(5, "Epochs to train.", at_least=0)
  train_steps: int = option(0, "Steps to train; 0 = run --epochs epochs.",
                            at_least=0)
  steps_per_loop: Union[int, str] = option(
      "auto", "Steps per host call (one compiled tf.range loop), or auto: "
      "about one call a second, measured as it runs (every worker takes the "
      "chief's choice).")

  def __post_init__(self):
    check_options(self)
    loop = self.steps_per_loop
    if isinstance(loop, str) and loop.strip().isdigit():  # from the flag
      loop = int(loop)
      object.__setattr__(self, "steps_per_loop", loop)
    if loop != "auto" and not (isinstance(loop, int) and
                               not isinstance(loop, bool) and loop > 0):
      raise flag_error("steps_per_loop", loop, "must be a positive integer "
                       "or auto (about one host call a second).")
    if self.epochs == 0 and self.train_steps == 0:
      raise flag_error("epochs", 0, "must be positive when --train_steps=0; "
                       "set one of them")


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
  """Whether and when to evaluate, and what to do with the results
  (engine/core/evaluate.py, best.py, eval_only.py)."""
  mode: str = option(
      "train_and_eval", "train_and_eval: train, evaluating on schedule; "
      "train: no evaluation; eval: evaluate the latest checkpoint in "
      "--model_dir (or --checkpoint) and write eval.json.", choices=MODES)
  eval_every: int = option(
      0, "Evaluate every N steps (0: at the end of each epoch); always also "
      "at the last step.", at_least=0)
  keep_best: str = option(
      "", "Keep the checkpoint and export of the best evaluation by this "
      "metric (e.g. eval_accuracy; losses and errors are minimised) in "
      "model_dir/best.")
  early_stopping_patience: int = option(
      0, "Stop after N evaluations without improvement of --keep_best's "
      "metric (eval_loss if none); 0: never.", at_least=0)
  checkpoint: str = option(
      "", "--mode=eval: the checkpoint to evaluate (a ckpt-N path or a "
      "directory: its latest); default: the latest in --model_dir.")

  def __post_init__(self):
    check_options(self)
    if self.keep_best and not self.keep_best.startswith("eval_"):
      raise flag_error("keep_best", self.keep_best,
                       "names an evaluation metric, e.g. eval_loss or "
                       "eval_accuracy.")
    if self.mode == "train":
      for flag in ("keep_best", "early_stopping_patience", "eval_every"):
        if getattr(self, flag):
          raise flag_error(flag, getattr(self, flag),
                           "needs evaluation, which --mode=train skips; use "
                           "--mode=train_and_eval.")
    if self.mode != "eval" and self.checkpoint:
      raise flag_error("checkpoint", self.checkpoint,
                       "is read by --mode=eval only; training resumes from "
                       "--model_dir.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Where results go; checkpoints, resume and preemption
  (engine/core/checkpoint.py, preemption.py)."""
  model_dir: str = option(
      "/tmp/tfengine", "Where summary.json and checkpoints/ go (chief only).")
  checkpoint_every: int = option(
      0, "Save a checkpoint every N steps (0: only at the end).", at_least=0)
  keep_checkpoints: int = option(5, "Checkpoints to keep.", above=0)
  allow_resume_change: bool = option(
      False, "Resume even where the results would change: another global "
      "batch, or --shard_files with another worker count (another replica or "
      "worker count alone resumes without it).")
  preemption_sync: bool = option(
      True, "After every host call, agree with all workers whether one got "
      "SIGTERM/SIGINT, so all save at the same step. Turn off only to "
      "measure what the agreement costs.")
  weights_out: str = option(
      "", "If set, the chief saves the final trainable weights to this .npz "
      "file name inside --model_dir.")

  def __post_init__(self):
    check_options(self)
    if os.path.basename(self.weights_out) != self.weights_out:
      raise flag_error("weights_out", self.weights_out,
                       "is a file name inside --model_dir, not a path.")


@dataclasses.dataclass(frozen=True)
class ReportingConfig:
  """What users see: logs, progress, TensorBoard, profiler, export
  (engine/report/)."""
  log_every: int = option(10, "Log a progress line every N steps.", above=0)
  summary_every: int = option(
      10, "Write TensorBoard scalars to model_dir/train every N steps (0: "
      "none).", at_least=0)
  progress: bool = option(
      True, "A progress bar per epoch when stdout is a terminal; "
      "--noprogress logs a line every --log_every steps.")
  profile_steps: Tuple[int, ...] = option(
      (), "START,END: capture a TensorFlow profiler trace of these steps "
      "into model_dir/plugins/profile.")
  profile_all_workers: bool = option(
      False, "With --profile_steps on multi_worker, also trace workers k > 0 "
      "(into model_dir/worker_k, what benchmarks.worker_skew reads). Off by "
      "default: TensorFlow 2.21's profiler can crash a non-chief worker as "
      "its trace stops.")
  export: bool = option(
      True, "At the end, write model.keras and a serving SavedModel to "
      "--export_dir.")
  export_dir: str = option(
      "", "Where the model is exported (default model_dir/export).")

  def __post_init__(self):
    check_options(self)
    if self.profile_steps and not (
        len(self.profile_steps) == 2 and
        all(isinstance(s, int) for s in self.profile_steps) and
        1 <= self.profile_steps[0] <= self.profile_steps[1]):
      raise flag_error("profile_steps",
                       ",".join(str(s) for s in self.profile_steps),
                       "must be START,END with 1 <= START <= END (steps "
                       "counted from 1), e.g. 10,20.")


@dataclasses.dataclass(frozen=True)
class InitializationConfig:
  """Where the weights start: fine-tuning (engine/core/init_weights.py)."""
  init_weights: str = option(
      "", "Start from these weights (variables matched by name and shape) "
      "unless resuming: a .weights.h5 or .keras file, a run's model_dir, "
      "checkpoints/ dir or checkpoint prefix; for mobilenet_v2 also Keras's "
      "ImageNet .h5 file.")
  freeze: str = option(
      "", "Regex over layer names: matching layers are not trained (their "
      "BatchNormalization runs in inference mode).")

  def __post_init__(self):
    check_options(self)
    path = self.init_weights
    if path and not (os.path.exists(path) or
                     os.path.exists(path + ".index")):
      raise flag_error("init_weights", path,
                       "does not exist; pass a .weights.h5 or .keras file, "
                       "a run's model_dir or a checkpoint prefix.")
    _regex("freeze", self.freeze)


@dataclasses.dataclass(frozen=True)
class RandomnessConfig:
  """What every random draw of a run is a function of: the initial weights,
  the data order, the model's random layers and the task's augmentation
  (engine/core/randomness.py)."""
  seed: int = option(
      42, "Seed for weights, data order and the model's random layers.",
      at_least=0, at_most=SEED_MAX,
      problem=f"must be an integer from 0 to {SEED_MAX} (TensorFlow takes "
      "seeds modulo 2**31 - 1).")

  def __post_init__(self):
    check_options(self)


@dataclasses.dataclass(frozen=True)
class HostConfig:
  """This process's host: memory (engine/host/memory.py)."""
  malloc_tuning: bool = option(
      True, "Undo TensorFlow's 128 KiB glibc mmap threshold, under which "
      "every CPU tensor above it is mapped, faulted in and unmapped on each "
      "use; glibc's own 32 MiB maximum instead (engine/host/memory.py).")
  cpu_allocator: str = option(
      "bfc", "Where TensorFlow's CPU tensors come from: bfc, one pool that "
      "reuses its free blocks (memory stays flat over long runs), or "
      "tensorflow, TensorFlow's own choice (malloc, or its oneDNN "
      "allocator). Taken before TensorFlow's first op "
      "(engine/host/memory.py).",
      choices=CPU_ALLOCATORS)

  def __post_init__(self):
    check_options(self)


SECTIONS = {
    "distribution": DistributionConfig,
    "data": DataConfig,
    "batchnorm": BatchNormConfig,
    "optimization": OptimizationConfig,
    "loop": LoopConfig,
    "evaluation": EvaluationConfig,
    "checkpoints": CheckpointConfig,
    "reporting": ReportingConfig,
    "initialization": InitializationConfig,
    "randomness": RandomnessConfig,
    "host": HostConfig,
}


def field_sections(sections=None) -> Dict[str, str]:
  """Flat field name -> the section that holds it (names are unique)."""
  out = {}
  for section, cls in (sections or SECTIONS).items():
    for f in dataclasses.fields(cls):
      out[f.name] = section
  return out


def fields_by_name() -> Dict[str, dataclasses.Field]:
  """Flat field name -> its dataclasses.Field (help, choices, bounds)."""
  return {f.name: f for cls in SECTIONS.values()
          for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything the engine needs for one run, in sections by concern."""
  distribution: DistributionConfig = DistributionConfig()
  data: DataConfig = DataConfig()
  batchnorm: BatchNormConfig = BatchNormConfig()
  optimization: OptimizationConfig = OptimizationConfig()
  loop: LoopConfig = LoopConfig()
  evaluation: EvaluationConfig = EvaluationConfig()
  checkpoints: CheckpointConfig = CheckpointConfig()
  reporting: ReportingConfig = ReportingConfig()
  initialization: InitializationConfig = InitializationConfig()
  randomness: RandomnessConfig = RandomnessConfig()
  host: HostConfig = HostConfig()

  def __post_init__(self):
    opt, data = self.optimization, self.data
    if opt.jit_compile and self.batchnorm.sync_batchnorm:
      # Synchronized BatchNorm all-reduces inside the forward pass, and a
      # collective cannot run inside the XLA-compiled function (merge_call).
      raise flag_error("jit_compile", True,
                       "cannot be combined with --sync_batchnorm, whose "
                       "all-reduces inside the forward pass XLA cannot "
                       "compile here; drop one of them.")
    if (self.batchnorm.sync_batchnorm and opt.grad_accum_steps > 1 and
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
