"""The training recipe against a constant learning rate, on real digits.

    python -m benchmarks.recipe
    python -m benchmarks.recipe --write_digits=DIR # only write the folder

The digits (1,797 8x8 grey scans, values 0-16: the test set of the UCI
"Optical Recognition of Handwritten Digits" data, Alpaydin and Kaynak 1998,
CC BY 4.0, in the order scikit-learn's `load_digits` gives them) are
benchmarks/data/digits.npz (`images` [1797, 8, 8] uint8, `labels` [1797]
uint8; written from scikit-learn 1.9.1's copy, so nothing is downloaded and
scikit-learn need not be installed: where it is, Keras imports it with
TensorFlow, 0.9 s more for every process that starts TensorFlow). They
are written once as a `--dataset=folder:` data set (one sub-directory per
class, PNG files in that order). The
folder source interleaves the classes round-robin, so `train[:80%]` and
`train[80%:]` are a fixed, class-balanced split (1,437 / 360 images).

Two trainings of small_cnn at 32 px then run as CLI subprocesses,
`python -m engine.main ...`, with the same seed, model, optimizer, batch and
steps:
  constant  --learning_rate=LR
  recipe    the same peak LR with RECIPE_FLAGS: linear warmup, cosine decay,
            label smoothing 0.1 and pad-and-crop augmentation (no flip: a
            mirrored digit is often another symbol)
and both final eval accuracies and their difference are printed. The recipe
arm's flags can be replaced with --recipe_flags="...".
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLITS = ("--train_split=train[:80%]", "--eval_split=train[80%:]")
RECIPE_FLAGS = ("--lr_schedule=cosine --warmup_steps={warmup} "
                "--label_smoothing=0.1 --augment=crop")


def _png(pixels: np.ndarray) -> bytes:
  """An 8-bit greyscale PNG of `pixels` [H, W] uint8 (no imaging library)."""
  def chunk(kind, data):
    body = kind + data
    return (len(data).to_bytes(4, "big") + body +
            zlib.crc32(body).to_bytes(4, "big"))
  height, width = pixels.shape
  header = (width.to_bytes(4, "big") + height.to_bytes(4, "big") +
            bytes([8, 0, 0, 0, 0]))  # 8 bits, greyscale, no interlace
  rows = b"".join(b"\0" + row.tobytes() for row in pixels)  # filter: none
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) +
          chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


DIGITS = os.path.join(ROOT, "benchmarks", "data", "digits.npz")


def write_digits(root: str) -> int:
  """Writes the digits as root/<digit>/<index>.png; returns N."""
  with np.load(DIGITS) as digits:
    scans, labels = digits["images"], digits["labels"]
  images = np.round(scans * (255.0 / 16.0)).astype(np.uint8)
  for i, (image, label) in enumerate(zip(images, labels)):
    directory = os.path.join(root, str(label))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{i:05d}.png"), "wb") as f:
      f.write(_png(image))
  return len(images)


def train(name: str, digits: str, work: str, args, extra) -> dict:
  """One CLI training; returns its summary.json."""
  model_dir = os.path.join(work, name)
  cmd = [sys.executable, "-m", "engine.main", "--model=small_cnn",
         f"--dataset=folder:{digits}", *SPLITS, "--image_size=32",
         f"--batch_size_per_replica={args.batch_size}",
         f"--train_steps={args.steps}", f"--eval_every={args.steps}",
         f"--optimizer={args.optimizer}", f"--momentum={args.momentum}",
         f"--learning_rate={args.learning_rate}", f"--seed={args.seed}",
         f"--cpu_devices={args.cpu_devices}", "--steps_per_loop=50",
         "--summary_every=0", "--noexport", "--noprogress",
         f"--model_dir={model_dir}", *extra]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=3600, check=False)
  if proc.returncode:
    sys.exit(f"{name} failed ({proc.returncode}):\n{' '.join(cmd)}\n"
             f"{proc.stderr[-2000:]}")
  with open(os.path.join(model_dir, "summary.json")) as f:
    return json.load(f)


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--digits_dir", default="",
                 help="A folder written by --write_digits (default: write "
                      "one in a temporary directory).")
  p.add_argument("--write_digits", default="",
                 help="Only write the digits folder here, then exit.")
  p.add_argument("--steps", type=int, default=6000)
  p.add_argument("--warmup_steps", type=int, default=200)
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--optimizer", default="sgd")
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--learning_rate", type=float, default=0.1)
  p.add_argument("--cpu_devices", type=int, default=0)
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--recipe_flags", default=RECIPE_FLAGS,
                 help="The recipe arm's flags ({warmup} is --warmup_steps).")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse(argv)
  if args.write_digits:
    print(f"wrote {write_digits(args.write_digits)} digits to "
          f"{args.write_digits}")
    return {}
  with tempfile.TemporaryDirectory(prefix="recipe_") as work:
    digits = args.digits_dir
    if not digits:
      digits = os.path.join(work, "digits")
      write_digits(digits)
    recipe = shlex.split(args.recipe_flags.format(warmup=args.warmup_steps))
    result = {}
    for name, extra in (("constant", []), ("recipe", recipe)):
      summary = train(name, digits, work, args, extra)
      result[name] = summary["eval_accuracy"]
      print(f"{name:9s} eval_accuracy {summary['eval_accuracy']:.4f} "
            f"eval_loss {summary['eval_loss']:.4f} "
            f"({' '.join(extra) or 'constant learning rate'})", flush=True)
  result["difference"] = result["recipe"] - result["constant"]
  print(f"recipe - constant: {result['difference']:+.4f} eval accuracy "
        f"({args.steps} steps, global batch {args.batch_size} x replicas, "
        f"{args.optimizer} lr {args.learning_rate})")
  print("RESULT " + json.dumps(result))
  return result


if __name__ == "__main__":
  main()
