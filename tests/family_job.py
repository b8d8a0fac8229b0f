"""A user's script training one family of benchmarks/families.py (test size),
for the model matrix's launcher runs (tests/test_model_matrix.py).

    python -m engine.launch --num_workers=2 --script=tests/family_job.py -- \\
        --family=b --train_steps=6 --model_dir=...
"""
from absl import flags

import engine
from benchmarks import families

if __name__ == "__main__":
  flags.DEFINE_enum("family", None, sorted(families.FAMILIES),
                    "benchmarks/families.py's family to train.")
  flags.mark_flag_as_required("family")
  engine.cli.run(lambda config: families.FAMILIES[flags.FLAGS.family](
      "test").task())
