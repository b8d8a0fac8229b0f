"""Command line: `python -m engine.main --flag=value ...`.

The only module that defines or reads flags. It validates them into a frozen
`Config`, sets up the host before TensorFlow runs any op, and calls
`engine.train.train`. Bad input ends with one line on stderr and exit code 2.
"""
import dataclasses
import signal
import sys

from absl import app
from absl import flags
from absl import logging

from engine import config as config_lib
from engine.errors import ClusterError, ConfigError, flag_error

# A peer was lost or a collective got stuck (2 is bad input, 4 divergence).
EXIT_CLUSTER = 3

# Defaults live in the dataclass, not here.
_DEF = {f.name: f.default for f in dataclasses.fields(config_lib.Config)}

flags.DEFINE_enum("strategy", _DEF["strategy"], config_lib.STRATEGIES,
                  "tf.distribute strategy.")
flags.DEFINE_enum("cross_device_ops", _DEF["cross_device_ops"],
                  config_lib.CROSS_DEVICE_OPS,
                  "All-reduce implementation (see README for what each does).")
flags.DEFINE_list("devices", list(_DEF["devices"]),
                  "Replica devices, e.g. /gpu:0,/gpu:1 (default: all GPUs, "
                  "else the CPU).")
flags.DEFINE_integer("cpu_devices", _DEF["cpu_devices"],
                     "Split the host CPU into N logical devices and use them "
                     "as replicas (machines with no GPU).")
flags.DEFINE_list("worker_hosts", list(_DEF["worker_hosts"]),
                  "multi_worker: host:port of every worker, in task order.")
flags.DEFINE_integer("task_index", _DEF["task_index"],
                     "multi_worker: this worker's index in --worker_hosts.")
flags.DEFINE_float("init_timeout", _DEF["init_timeout"],
                   "multi_worker: seconds to wait for all workers to join.")
flags.DEFINE_float("collective_timeout", _DEF["collective_timeout"],
                   "Seconds after which a stuck all-reduce fails.")
flags.DEFINE_integer("bytes_per_pack", _DEF["bytes_per_pack"],
                     "Pack gradients into all-reduces of about this many "
                     "bytes (0: TensorFlow's choice).")
flags.DEFINE_string("model", _DEF["model"], "mobilenet_v2 or small_cnn.")
flags.DEFINE_string("dataset", _DEF["dataset"],
                    "synthetic, folder:/path (one sub-directory per class) or "
                    "any TensorFlow Datasets name (cats_vs_dogs, ...).")
flags.DEFINE_string("data_dir", _DEF["data_dir"], "TensorFlow Datasets dir.")
flags.DEFINE_string("train_split", _DEF["train_split"],
                    "tfds split expression for training, e.g. train[:80%].")
flags.DEFINE_boolean("download", _DEF["download"],
                     "Let tfds download and prepare a missing data set.")
flags.DEFINE_integer("image_size", _DEF["image_size"], "Image side, pixels.")
flags.DEFINE_integer("num_classes", _DEF["num_classes"],
                     "Classes of the synthetic data set.")
flags.DEFINE_integer("synthetic_examples", _DEF["synthetic_examples"],
                     "Examples in one epoch of the synthetic data set.")
flags.DEFINE_integer("shuffle_buffer", _DEF["shuffle_buffer"],
                     "tfds shuffle buffer (the seed uses 1024).")
flags.DEFINE_boolean("drop_remainder", _DEF["drop_remainder"],
                     "Drop each epoch's partial last batch.")
flags.DEFINE_integer("epochs", _DEF["epochs"], "Epochs to train.")
flags.DEFINE_integer("train_steps", _DEF["train_steps"],
                     "Steps to train; 0 = run --epochs epochs.")
flags.DEFINE_integer("batch_size_per_replica", _DEF["batch_size_per_replica"],
                     "Examples per replica per step.")
flags.DEFINE_enum("optimizer", _DEF["optimizer"], config_lib.OPTIMIZERS,
                  "Optimizer.")
flags.DEFINE_float("learning_rate", _DEF["learning_rate"], "Learning rate.")
flags.DEFINE_float("momentum", _DEF["momentum"], "SGD momentum.")
flags.DEFINE_integer("steps_per_loop", _DEF["steps_per_loop"],
                     "Steps per host call (one compiled tf.range loop).")
flags.DEFINE_integer("log_every", _DEF["log_every"],
                     "Log a progress line every N steps.")
flags.DEFINE_string("model_dir", _DEF["model_dir"],
                    "Where summary.json and checkpoints/ go (chief only).")
flags.DEFINE_string("weights_out", _DEF["weights_out"],
                    "If set, the chief saves the final trainable weights to "
                    "this .npz file name inside --model_dir.")
flags.DEFINE_integer("seed", _DEF["seed"], "Seed for weights and data order.")
flags.DEFINE_integer("checkpoint_every", _DEF["checkpoint_every"],
                     "Save a checkpoint every N steps (0: only at the end).")
flags.DEFINE_integer("keep_checkpoints", _DEF["keep_checkpoints"],
                     "Checkpoints to keep.")
flags.DEFINE_boolean("allow_resume_change", _DEF["allow_resume_change"],
                     "Resume even if the replica count or global batch "
                     "differs from the checkpointed run.")
# Preemption (issue 4).
flags.DEFINE_boolean("preemption_sync", _DEF["preemption_sync"],
                     "After every host call, agree with all workers whether "
                     "one got SIGTERM/SIGINT, so all save at the same step. "
                     "Turn off only to measure what the agreement costs.")
# Data sets, evaluation and the input pipeline (issue 5).
flags.DEFINE_string("eval_split", _DEF["eval_split"],
                    "Split expression to evaluate on, e.g. test or "
                    "train[80%:] (empty: no evaluation).")
flags.DEFINE_integer("eval_every", _DEF["eval_every"],
                     "Evaluate every N steps (0: at the end of each epoch); "
                     "always also at the last step.")
flags.DEFINE_string("cache", _DEF["cache"],
                    "Cache decoded images: memory, or a file path prefix "
                    "(empty: no cache).")

# What users see (issue 7).
flags.DEFINE_integer("summary_every", _DEF["summary_every"],
                     "Write TensorBoard scalars to model_dir/train every N "
                     "steps (0: none).")
flags.DEFINE_boolean("progress", _DEF["progress"],
                     "A progress bar per epoch when stdout is a terminal; "
                     "--noprogress logs a line every --log_every steps.")
flags.DEFINE_list("profile_steps", list(_DEF["profile_steps"]),
                  "START,END: capture a TensorFlow profiler trace of these "
                  "steps into model_dir/plugins/profile.")
flags.DEFINE_boolean("export", _DEF["export"],
                     "At the end, write model.keras and a serving SavedModel "
                     "to --export_dir.")
flags.DEFINE_string("export_dir", _DEF["export_dir"],
                    "Where the model is exported (default model_dir/export).")
# Communication and speed (issue 6).
flags.DEFINE_integer("grad_accum_steps", _DEF["grad_accum_steps"],
                     "Sum the gradients of K micro-batches of "
                     "--batch_size_per_replica locally, then all-reduce and "
                     "update once: one step of a K times larger batch.")
flags.DEFINE_enum("grad_compression", _DEF["grad_compression"],
                  config_lib.GRAD_COMPRESSIONS,
                  "Cast gradients to this dtype for the all-reduce (half the "
                  "bytes) and back after it.")
flags.DEFINE_enum("mixed_precision", _DEF["mixed_precision"],
                  config_lib.MIXED_PRECISIONS,
                  "Keras dtype policy: float16/bfloat16 compute, float32 "
                  "variables; mixed_float16 adds dynamic loss scaling.")
flags.DEFINE_boolean("jit_compile", _DEF["jit_compile"],
                     "Compile the forward/backward pass with XLA.")
flags.DEFINE_boolean("sync_batchnorm", _DEF["sync_batchnorm"],
                     "BatchNormalization over the global batch (Keras "
                     "synchronized=True): 1 and N replicas agree.")
flags.DEFINE_boolean("malloc_tuning", _DEF["malloc_tuning"],
                     "Undo TensorFlow's 128 KiB glibc mmap threshold, under "
                     "which every CPU tensor above it is mapped, faulted in "
                     "and unmapped on each use; glibc's own 32 MiB maximum "
                     "instead (engine/memory.py).")

FLAGS = flags.FLAGS

_TUPLE_FLAGS = ("devices", "worker_hosts")


def config_from_flags() -> config_lib.Config:
  values = {name: FLAGS[name].value for name in _DEF}
  for name in _TUPLE_FLAGS:
    values[name] = tuple(values[name] or ())
  values["profile_steps"] = _ints("profile_steps", FLAGS.profile_steps)
  return config_lib.Config(**values)


def _ints(flag, items):
  try:
    return tuple(int(v) for v in items or ())
  except ValueError as e:
    raise flag_error(flag, ",".join(items),
                     "must be integers, e.g. 10,20.") from e


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {' '.join(argv[1:])}; flags look like "
          "--name=value.")
  try:
    config = config_from_flags()
    # SIGTERM before the first step (from then on engine/preemption.py only
    # notes it, to save at an agreed step) exits through SystemExit, so
    # atexit clean-up (a non-chief's temporary directory) still runs.
    signal.signal(signal.SIGTERM,
                  lambda signum, _: sys.exit(128 + signum))
    # Logical devices must exist before TensorFlow runs any op.
    from engine import devices  # pylint: disable=g-import-not-at-top
    devices.configure_host(config.cpu_devices)
    from engine import train  # pylint: disable=g-import-not-at-top
    from engine import checkpoint  # pylint: disable=g-import-not-at-top
    from engine import resources  # pylint: disable=g-import-not-at-top
    try:
      train.train(config)
    except checkpoint.Preempted as e:
      logging.flush()
      print(f"preempted: {e}", file=sys.stderr)
      sys.exit(checkpoint.PREEMPTED_EXIT_CODE)
    except checkpoint.ResourceStop as e:
      _fail(str(e), code=resources.RESOURCE_EXIT_CODE)
    except (MemoryError, tf_errors().ResourceExhaustedError) as e:
      # Raised inside a step, whose update may be half applied: no new
      # checkpoint; a rerun resumes from the latest one.
      text = str(e).strip().splitlines()
      _fail(f"out of memory ({type(e).__name__}: "
            f"{text[-1] if text else 'no details'}); the latest checkpoint "
            f"in {config.model_dir}/checkpoints is intact. Lower "
            "--batch_size_per_replica or free memory.",
            code=resources.RESOURCE_EXIT_CODE)
    except FloatingPointError as e:
      _fail(f"training diverged: {e}; the latest checkpoint in "
            f"{config.model_dir}/checkpoints holds the last finite weights. "
            "Lower --learning_rate.", code=4)
  except ConfigError as e:
    _fail(str(e))
  except ClusterError as e:
    # A lost peer or a stuck collective, named by engine/hang.py.
    _fail(str(e), code=EXIT_CLUSTER)
  except (tf_errors().UnavailableError, tf_errors().DeadlineExceededError,
          tf_errors().CancelledError, tf_errors().AbortedError) as e:
    # A collective failed: a peer died or hung. One line, non-zero exit.
    from engine import cluster  # pylint: disable=g-import-not-at-top
    logging.flush()
    print("error: " + cluster.failure_line(e, FLAGS.collective_timeout),
          file=sys.stderr, flush=True)
    sys.exit(EXIT_CLUSTER)


def tf_errors():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.errors


def _fail(message: str, code: int = 2):
  logging.flush()
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def run():
  app.run(main)


if __name__ == "__main__":
  run()
