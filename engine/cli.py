"""Your script as a command line: the engine's flags next to your own.

    # train_mine.py
    from absl import flags
    import engine

    flags.DEFINE_float("dropout", 0.1, "My model's dropout.")

    def make_task(config: engine.Config) -> engine.Task:
      return MyTask(dropout=flags.FLAGS.dropout)

    if __name__ == "__main__":
      engine.cli.run(make_task)

    python train_mine.py --dropout=0.2 --cpu_devices=2 --train_steps=500
    python -m engine.launch --num_workers=2 --script=train_mine.py -- ...

Importing the engine defines no flag: `define_flags` (which `run` calls)
defines them, at the caller's module so that `--help` lists them with the
script's own, and skips any name the script already defined: your
`--learning_rate` or `--seed` stays yours, and the engine's field keeps its
default (set it in `make_task` by returning `(task, config.replace(...))`).

Outcomes, as README's exit-code table says: 0 done; 2 bad input (one line on
stderr, before any training; absl's own flag errors too); 3 a lost peer or a
stuck collective; 4 training diverged; 5 a host resource ran out (a
checkpoint saved where one could be); 75 preempted (checkpoint saved).
"""
import dataclasses
import inspect
import signal
import sys
import traceback
from typing import Callable, List, Optional, Tuple, Union

from absl import app
from absl import flags
from absl import logging

from engine import config as config_lib
from engine.errors import ClusterError, ConfigError, flag_error

EXIT_BAD_INPUT = 2
EXIT_CLUSTER = 3
EXIT_DIVERGED = 4

_ENUMS = {
    "strategy": config_lib.STRATEGIES,
    "cross_device_ops": config_lib.CROSS_DEVICE_OPS,
    "optimizer": config_lib.OPTIMIZERS,
    "grad_compression": config_lib.GRAD_COMPRESSIONS,
    "mixed_precision": config_lib.MIXED_PRECISIONS,
    "lr_schedule": config_lib.LR_SCHEDULES,
    "lr_scaling": config_lib.LR_SCALINGS,
    "mode": config_lib.MODES,
}
_LISTS = ("devices", "worker_hosts", "profile_steps", "lr_boundaries",
          "lr_values")

HELP = {
    # Distribution.
    "strategy": "tf.distribute strategy.",
    "cross_device_ops": "All-reduce implementation (see README for what "
                        "each does).",
    "devices": "Replica devices, e.g. /gpu:0,/gpu:1 (default: all GPUs, else "
               "the CPU).",
    "cpu_devices": "Split the host CPU into N logical devices and use them as "
                   "replicas (machines with no GPU).",
    "worker_hosts": "multi_worker: host:port of every worker, in task order.",
    "task_index": "multi_worker: this worker's index in --worker_hosts.",
    "init_timeout": "multi_worker: seconds to wait for all workers to join.",
    "collective_timeout": "The longest a step may wait on its peers (seconds) "
                          "before the run ends with exit code 3.",
    "bytes_per_pack": "Pack gradients into all-reduces of about this many "
                      "bytes (0: TensorFlow's choice).",
    "grad_compression": "Cast gradients to this dtype for the all-reduce "
                        "(half the bytes) and back after it.",
    "sync_batchnorm": "BatchNormalization over the global batch (Keras "
                      "synchronized=True): 1 and N replicas agree.",
    # Data.
    "batch_size_per_replica": "Examples per replica per step.",
    "shuffle_buffer": "Training examples shuffled per epoch (the seed uses "
                      "1024; 0: the task's order).",
    "drop_remainder": "Drop each epoch's partial last batch.",
    "shard_files": "Each worker reads only its own files of a tfds training "
                   "set (1/N of the reading); the global batches then depend "
                   "on the number of workers. Whole batches only.",
    # Optimization.
    "optimizer": "Optimizer (Keras's, applying the engine's all-reduced "
                 "gradients).",
    "learning_rate": "Peak learning rate (before --lr_scaling).",
    "momentum": "Momentum of sgd and rmsprop.",
    "nesterov": "Nesterov momentum for --optimizer=sgd.",
    "weight_decay": "Decoupled weight decay: each update first subtracts "
                    "variable x this x the learning rate (0: none).",
    "weight_decay_exclude": "Regular expression searched in variable paths "
                            "(e.g. dense/bias); matching variables are not "
                            "decayed. Default: biases and normalization "
                            "gamma/beta.",
    "clip_global_norm": "Clip the all-reduced mean gradient to this global "
                        "norm (0: no clipping); grad_norm reports it before "
                        "clipping.",
    "lr_schedule": "Learning rate after warmup, by optimizer update: constant, "
                   "cosine or linear (to 0 at the last step), exponential "
                   "(--lr_decay_rate per --lr_decay_steps) or piecewise "
                   "(--lr_boundaries, --lr_values).",
    "warmup_steps": "Raise the learning rate linearly from 0 to its peak over "
                    "this many updates.",
    "warmup_epochs": "Warmup in epochs instead of --warmup_steps.",
    "lr_scaling": "linear: the peak learning rate is --learning_rate (or "
                  "--lr_values) x global batch / --base_batch_size.",
    "base_batch_size": "The global batch --learning_rate is meant for "
                       "(--lr_scaling=linear).",
    "lr_boundaries": "piecewise: strictly increasing steps where the learning "
                     "rate changes, e.g. 3000,6000.",
    "lr_values": "piecewise: the learning rates, one more than "
                 "--lr_boundaries, e.g. 0.1,0.01,0.001.",
    "lr_decay_rate": "exponential: the factor per --lr_decay_steps updates.",
    "lr_decay_steps": "exponential: updates per factor of --lr_decay_rate.",
    "grad_accum_steps": "Sum the gradients of K micro-batches of "
                        "--batch_size_per_replica locally, then all-reduce "
                        "and update once: one step of a K times larger batch.",
    "mixed_precision": "Keras dtype policy: float16/bfloat16 compute, float32 "
                       "variables; mixed_float16 adds dynamic loss scaling.",
    "jit_compile": "Compile the forward/backward pass with XLA.",
    "fused_batchnorm": "BatchNormalization on TensorFlow's fused kernel in "
                       "training (Keras's results, fewer ops; one all-reduce "
                       "per layer with --sync_batchnorm).",
    # Loop.
    "epochs": "Epochs to train.",
    "train_steps": "Steps to train; 0 = run --epochs epochs.",
    "steps_per_loop": "Steps per host call (one compiled tf.range loop), or "
                      "auto: about one call a second, measured as it runs "
                      "(every worker takes the chief's choice).",
    "eval_every": "Evaluate every N steps (0: at the end of each epoch); "
                  "always also at the last step.",
    "seed": "Seed for weights and data order.",
    "malloc_tuning": "Undo TensorFlow's 128 KiB glibc mmap threshold, under "
                     "which every CPU tensor above it is mapped, faulted in "
                     "and unmapped on each use; glibc's own 32 MiB maximum "
                     "instead (engine/distribute/memory.py).",
    "mode": "train_and_eval: train, evaluating on schedule; train: no "
            "evaluation; eval: evaluate the latest checkpoint in --model_dir "
            "(or --checkpoint) and write summary.json.",
    "ema_decay": "Keep an exponential moving average of the weights with "
                 "this decay (e.g. 0.999; 0: none); evaluation and export "
                 "use it.",
    "early_stopping_patience": "Stop after N evaluations without improvement "
                               "of --keep_best's metric (eval_loss if none); "
                               "0: never.",
    # Checkpoints.
    "model_dir": "Where summary.json and checkpoints/ go (chief only).",
    "checkpoint_every": "Save a checkpoint every N steps (0: only at the end).",
    "keep_checkpoints": "Checkpoints to keep.",
    "allow_resume_change": "Resume even where the results would change: "
                           "another global batch, or --shard_files with "
                           "another worker count (another replica or worker "
                           "count alone resumes without it).",
    "preemption_sync": "After every host call, agree with all workers whether "
                       "one got SIGTERM/SIGINT, so all save at the same step. "
                       "Turn off only to measure what the agreement costs.",
    "weights_out": "If set, the chief saves the final trainable weights to "
                   "this .npz file name inside --model_dir.",
    "keep_best": "Keep the checkpoint and export of the best evaluation by "
                 "this metric (e.g. eval_accuracy; losses and errors are "
                 "minimised) in model_dir/best.",
    "checkpoint": "--mode=eval: the checkpoint to evaluate (a ckpt-N path or "
                  "a directory: its latest); default: the latest in "
                  "--model_dir.",
    # Reporting.
    "log_every": "Log a progress line every N steps.",
    "summary_every": "Write TensorBoard scalars to model_dir/train every N "
                     "steps (0: none).",
    "progress": "A progress bar per epoch when stdout is a terminal; "
                "--noprogress logs a line every --log_every steps.",
    "profile_steps": "START,END: capture a TensorFlow profiler trace of these "
                     "steps into model_dir/plugins/profile.",
    "export": "At the end, write model.keras and a serving SavedModel to "
              "--export_dir.",
    "export_dir": "Where the model is exported (default model_dir/export).",
    # Initialization.
    "init_weights": "Start from these weights (variables matched by name and "
                    "shape) unless resuming: a .weights.h5 or .keras file, a "
                    "run's model_dir, checkpoints/ dir or checkpoint prefix; "
                    "for mobilenet_v2 also Keras's ImageNet .h5 file.",
    "freeze": "Regex over layer names: matching layers are not trained "
              "(their BatchNormalization runs in inference mode).",
}

MakeTask = Callable[[config_lib.Config], Union["Task", Tuple["Task", config_lib.Config]]]


def caller_module(depth: int = 2) -> str:
  """The module name absl files a flag under: the script's path for __main__."""
  name = inspect.stack()[depth].frame.f_globals.get("__name__", "__main__")
  return sys.argv[0] if name == "__main__" else name


def define_dataclass_flags(cls, help_texts, *, flag_values=flags.FLAGS,
                           module_name: Optional[str] = None,
                           enums=None, lists=()) -> List[str]:
  """Defines one flag per field of `cls` with its default; returns the names
  defined (a name the script already has is skipped)."""
  module_name = module_name or caller_module()
  enums = enums or {}
  defined = []
  for f in dataclasses.fields(cls):
    if f.name in flag_values:
      continue
    default, text = f.default, help_texts[f.name]
    kw = dict(flag_values=flag_values, module_name=module_name)
    if f.name in enums:
      flags.DEFINE_enum(f.name, default, enums[f.name], text, **kw)
    elif f.name in lists:
      flags.DEFINE_list(f.name, [str(v) for v in default], text, **kw)
    elif isinstance(default, bool):
      flags.DEFINE_boolean(f.name, default, text, **kw)
    elif isinstance(default, int):
      flags.DEFINE_integer(f.name, default, text, **kw)
    elif isinstance(default, float):
      flags.DEFINE_float(f.name, default, text, **kw)
    else:
      flags.DEFINE_string(f.name, default, text, **kw)
    defined.append(f.name)
  return defined


_defined: List[str] = []


def define_flags(flag_values=flags.FLAGS,
                 module_name: Optional[str] = None) -> List[str]:
  """Defines the engine's flags, skipping names already defined; idempotent.

  Returns:
    The names of the engine flags defined here.
  """
  module_name = module_name or caller_module()
  for cls in config_lib.SECTIONS.values():
    _defined.extend(define_dataclass_flags(
        cls, HELP, flag_values=flag_values, module_name=module_name,
        enums=_ENUMS, lists=_LISTS))
  return list(_defined)


def config_from_flags(flag_values=flags.FLAGS) -> config_lib.Config:
  """The Config of the parsed engine flags; defaults for the script's own.

  Raises:
    ConfigError: a bad value or combination, naming the flag.
  """
  values = {}
  for name in config_lib.field_sections():
    if name not in _defined:
      continue  # the script's own flag of that name; ours keeps its default
    value = flag_values[name].value
    if name in _LISTS:
      value = tuple(value or ())
    values[name] = value
  if "profile_steps" in values:
    values["profile_steps"] = _ints("profile_steps", values["profile_steps"])
  if values.get("steps_per_loop", "auto").strip().isdigit():  # else "auto"
    values["steps_per_loop"] = int(values["steps_per_loop"])
  if "lr_boundaries" in values:
    values["lr_boundaries"] = _ints("lr_boundaries", values["lr_boundaries"])
  if "lr_values" in values:
    values["lr_values"] = _floats("lr_values", values["lr_values"])
  shadowed = sorted(set(config_lib.field_sections()) - set(_defined))
  if shadowed:
    logging.info("Your script defines --%s itself; the engine's field(s) of "
                 "that name keep their defaults.", ", --".join(shadowed))
  return config_lib.Config.create(**values)


def _ints(flag, items):
  try:
    return tuple(int(v) for v in items)
  except ValueError as e:
    raise flag_error(flag, ",".join(items),
                     "must be integers, e.g. 10,20.") from e


def _floats(flag, items):
  try:
    return tuple(float(v) for v in items)
  except ValueError as e:
    raise flag_error(flag, ",".join(items),
                     "must be numbers, e.g. 0.1,0.01.") from e


def parse_flags(argv):
  """absl's parsing, with README's form for its errors: one line, exit 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    # absl prefixes some messages ("ERROR:: Unable to open flagfile: ...").
    fail(str(e).removeprefix("ERROR:: ").strip(), EXIT_BAD_INPUT)


def say_error(message: str) -> None:
  """README's form of a failure: one `error:` line on stderr."""
  logging.flush()
  print(f"error: {message}", file=sys.stderr, flush=True)


def fail(message: str, code: int = EXIT_BAD_INPUT):
  """Says the error and exits (before TensorFlow is loaded)."""
  say_error(message)
  sys.exit(code)


def run(make_task: MakeTask, argv=None, *, callbacks=()) -> None:
  """Defines the engine's flags, parses them and trains `make_task(config)`.

  `make_task` is called after the host is set up, before any training; it
  returns the task, or `(task, config)` to run with a changed config.
  `callbacks`: Keras callbacks (engine/core/callbacks.py), or a function of
  the final config returning them (e.g. a CSVLogger into its model_dir).
  """
  define_flags(module_name=caller_module())
  app.run(lambda args: main(make_task, args, callbacks=callbacks), argv=argv,
          flags_parser=parse_flags)


def main(make_task: MakeTask, argv, *, callbacks=()) -> None:
  """Runs one training job from parsed flags and exits with its code."""
  if len(argv) > 1:
    fail(f"unexpected arguments {' '.join(argv[1:])}; flags look like "
         "--name=value.")
  try:
    config = config_from_flags()
  except ConfigError as e:
    fail(str(e), EXIT_BAD_INPUT)
  # Before TensorFlow reads it: oneDNN off for the one combination it
  # computes wrong (engine/onednn.py).
  from engine import onednn  # pylint: disable=g-import-not-at-top
  onednn.turn_off_for(config)
  # Imported only now: a bad flag is refused without loading TensorFlow, and
  # the engine's environment defaults (engine/__init__.py) are already set.
  from engine import ending  # pylint: disable=g-import-not-at-top
  from engine.distribute import cluster  # pylint: disable=g-import-not-at-top
  code, agreed, config = _train(make_task, config, callbacks)
  if agreed:  # every worker ends this way: leave together (cluster.py)
    cluster.meet_peers(config.distribution.collective_timeout)
  # Everything is written: exit now, without TensorFlow's teardown, which can
  # wait a minute for tf.data's threads (engine/ending.py).
  ending.end(code)


def _train(make_task: MakeTask, config, callbacks):
  """Trains; returns (exit code, whether every worker ends with it alike,
  the config the task ran with).

  Every outcome but an unexpected error is one line on stderr (README's
  exit codes). "Alike": done, preempted, stopped for a resource and
  diverged are agreed by all workers at the same step; a lost peer, bad
  input or an out-of-memory step are one worker's own.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from engine.core import checkpoint  # pylint: disable=g-import-not-at-top
  from engine.core.run import run as run_task  # pylint: disable=g-import-not-at-top
  from engine.distribute import cluster, devices, resources  # pylint: disable=g-import-not-at-top
  try:
    # SIGTERM before the first step (from then on engine/core/preemption.py
    # only notes it, to save at an agreed step) exits with 128 + 15.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    # Logical devices must exist before TensorFlow runs any op.
    devices.configure_host(config.distribution.cpu_devices)
    made = make_task(config)
    task, config = made if isinstance(made, tuple) else (made, config)
    run_task(task, config, callbacks=(callbacks(config) if callable(callbacks)
                                      else callbacks))
    return 0, True, config
  except checkpoint.Preempted as e:
    logging.flush()
    print(f"preempted: {e}", file=sys.stderr, flush=True)
    return checkpoint.PREEMPTED_EXIT_CODE, True, config
  except checkpoint.ResourceStop as e:
    say_error(str(e))
    return resources.RESOURCE_EXIT_CODE, True, config
  except FloatingPointError as e:
    say_error(f"training diverged: {e}; the latest checkpoint in "
              f"{config.checkpoints.model_dir}/checkpoints holds the last "
              "finite weights. Lower --learning_rate.")
    return EXIT_DIVERGED, True, config
  except ConfigError as e:
    say_error(str(e))
    return EXIT_BAD_INPUT, False, config
  except ClusterError as e:
    # A lost peer or a stuck collective, named by engine/distribute/hang.py.
    say_error(str(e))
    return EXIT_CLUSTER, False, config
  except (MemoryError, tf.errors.ResourceExhaustedError) as e:
    # Raised inside a step, whose update may be half applied: no new
    # checkpoint; a rerun resumes from the latest one.
    text = str(e).strip().splitlines()
    say_error(f"out of memory ({type(e).__name__}: "
              f"{text[-1] if text else 'no details'}); the latest checkpoint "
              f"in {config.checkpoints.model_dir}/checkpoints is intact. "
              "Lower --batch_size_per_replica or free memory.")
    return resources.RESOURCE_EXIT_CODE, False, config
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.CancelledError, tf.errors.AbortedError) as e:
    # A collective failed: a peer died or hung. One line, non-zero exit.
    say_error(cluster.failure_line(e, config.distribution.collective_timeout))
    return EXIT_CLUSTER, False, config
  except SystemExit as e:  # the SIGTERM above, before the first step
    return e.code if isinstance(e.code, int) else 1, False, config
  except Exception:  # pylint: disable=broad-except
    # Not one of README's outcomes: the traceback, as Python would print it.
    traceback.print_exc()
    return 1, False, config
