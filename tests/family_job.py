"""A user's script training families of benchmarks/families.py (test size),
for the model matrix's launcher runs (tests/test_model_matrix.py).

    python -m engine.launch --num_workers=2 --script=tests/family_job.py -- \\
        --families=a,b,c,d,e --train_steps=6 --model_dir=...

One family trains as its own task. Several train as one task (`together`):
their models side by side in one model, each on its own examples (the
families' data sets zipped), the loss the sum of their losses. Each family's
weights get the gradient of its own loss only, so one run on 2 workers
checks every family, with one TensorFlow start-up per worker instead of one
per family (a process can build MultiWorkerMirroredStrategy only once).
Each family's per-step loss and metrics are the task's metrics
(`<family>_loss`, `<family>_<metric>`).
"""
from absl import flags
import keras
import tensorflow as tf

import engine
from benchmarks import families
from engine.core.checks import checked


class Together(keras.Model):
  """The families' models side by side: {family: its outputs}."""

  def __init__(self, models):
    super().__init__()
    self.parts = models

  def call(self, features, training=False):
    return {n: m(features[n], training=training)
            for n, m in self.parts.items()}


class Families(engine.Task):
  """Several families trained as one task (see the module docstring)."""

  def __init__(self, names):
    super().__init__(name="families_" + "".join(names))
    self.tasks = {n: families.FAMILIES[n]("test").task() for n in names}

  def build_model(self):
    return Together({n: t.build_model() for n, t in self.tasks.items()})

  def build_inputs(self, split, context):
    zipped = tf.data.Dataset.zip({n: t.build_inputs(split, context)
                                  for n, t in self.tasks.items()})
    return zipped.map(lambda e: ({n: f for n, (f, _) in e.items()},
                                 {n: l for n, (_, l) in e.items()}))

  def per_example_loss(self, labels, outputs):
    return tf.add_n([checked(t, "the loss", t.per_example_loss, labels[n],
                             outputs[n]) for n, t in self.tasks.items()])

  def build_metrics(self):
    out = {}
    for n, t in self.tasks.items():
      out[f"{n}_loss"] = (lambda y, p, n=n, t=t:
                          checked(t, "the loss", t.per_example_loss, y[n],
                                  p[n]))
      for name, fn in t.build_metrics().items():
        out[f"{n}_{name}"] = (lambda y, p, n=n, t=t, name=name, fn=fn:
                              checked(t, f"metric {name!r}", fn, y[n], p[n]))
    return out


def make_task(names):
  names = list(names)
  if len(names) == 1:
    return families.FAMILIES[names[0]]("test").task()
  return Families(names)


if __name__ == "__main__":
  flags.DEFINE_list("families", None, "benchmarks/families.py's families "
                    "to train (several: as one task).")
  flags.mark_flag_as_required("families")
  engine.cli.run(lambda config: make_task(flags.FLAGS.families))
