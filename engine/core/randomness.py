"""Seeds: the data order's, and the randomness inside the model.

The model's randomness (Keras `Dropout`, `SpatialDropout1D/2D/3D`,
`GaussianNoise`, `GaussianDropout`, `AlphaDropout`, the `Random*`
preprocessing layers, and any layer that draws through `keras.random`) is
drawn per row of the global batch, as a function of (--seed, the step, the
row's position in the global batch, the draw's place in the model). N
replicas and N workers then draw for each example exactly what one replica
draws for it, and a resumed run draws what an uninterrupted one would have.
Keras's own draws would not: each replica draws from the same mirrored seed
state, so replica k's row i gets replica 0's row i mask.

How: while the engine traces a training forward pass (`RowRandomness.rows`),
Keras's TensorFlow random functions (`keras.random.uniform`, `normal`,
`randint`, `dropout`, which every layer above calls) draw from a
counter-based generator (Philox) instead: the key is (seed, the draw's
ordinal in the trace), the counter's high word the step and its low word the
element's index in the draw over the whole global batch, so a replica draws
only its own rows' elements and gets the same numbers as one device would.
A draw whose leading dimension is not the batch (a value per batch or per
channel) is one draw per (seed, step, site), the same on every replica, as on
one device. Outside those traces the functions are Keras's own.

Random ops that do not go through those functions (`tf.random.*`, a
`tf.random.Generator`, `keras.random.shuffle` and the like) cannot be keyed
by row: they are found in the trace and named (`dependent`), once in the log
and in summary.json (`replica_dependent_randomness`).
"""
import contextlib
import functools
import re
import threading
from typing import Dict, Iterable

from absl import logging
import keras
import tensorflow as tf

from engine.config import SEED_MAX

# --seed=0's data order (`shuffle_seeds`).
_ZERO_GLOBAL_SEED = SEED_MAX
_ZERO_OP_OFFSET = 2**62
# The engine's draws are made under this name scope (not reported).
_SCOPE = "row_keyed_random"
_PHILOX = 1  # tf.random.Algorithm.PHILOX
# Philox gives 4 numbers per counter value.
_PER_COUNTER = 4
# Op types that draw random numbers.
_RANDOM_OPS = frozenset((
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomShuffle",
    "RandomCrop", "Multinomial", "RandomGamma", "RandomPoisson",
    "RandomPoissonV2", "StatelessRandomUniform", "StatelessRandomUniformInt",
    "StatelessRandomUniformFullInt", "StatelessRandomNormal",
    "StatelessTruncatedNormal", "StatelessMultinomial",
    "StatelessParameterizedTruncatedNormal", "StatelessRandomBinomial",
    "StatelessRandomGammaV2", "StatelessRandomGammaV3",
    "StatelessRandomPoisson", "StatelessRandomUniformV2",
    "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
    "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
    "StatelessShuffle", "StatefulUniform", "StatefulUniformInt",
    "StatefulUniformFullInt", "StatefulStandardNormal",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal",
    "StatefulRandomBinomial", "RandomIndexShuffle"))


def shuffle_seeds(seed: int):
  """(TensorFlow's global seed, an offset for every shuffle's op seed) that
  seed the data order of --seed.

  A shuffle's order is seeded by the pair (global seed, op seed); the engine
  sets the global seed to --seed and gives each shuffle its own op seed (per
  epoch, per worker), a tensor inside tf.data functions. TensorFlow compares
  the pair with (0, 0) in Python (random_seed.get_seed), which fails for a
  tensor op seed when the global seed is 0; so --seed=0 takes the global seed
  SEED_MAX with its op seeds moved up by 2**62, a pair no other seed's
  shuffles use (theirs stay below 2**52). Every other seed keeps its order.
  """
  if seed:
    return seed, 0
  return _ZERO_GLOBAL_SEED, _ZERO_OP_OFFSET


_state = threading.local()  # the trace in progress on this thread


class RowRandomness:
  """The run's model randomness: its seed, and what could not be keyed.

  `dependent` maps a layer (or name scope) to the random op types it draws
  outside `keras.random`, filled as the training step is traced.
  """

  def __init__(self, seed: int, rows_per_replica: int):
    """`rows_per_replica`: the most rows one replica's batch spans in the
    global batch (--batch_size_per_replica x --grad_accum_steps)."""
    self.seed = seed
    self.rows_per_replica = rows_per_replica
    self.dependent: Dict[str, str] = {}
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def rows(self, rows, model=None):
    """Keras's random draws of the forward pass traced inside are keyed by
    `rows` = (steps, positions), int64 [n] each: the step that trains each
    row and its position in the global batch."""
    _install()
    steps, positions = rows
    trace = _Trace(self, tf.reduce_max(tf.concat([steps, [0]], axis=0)),
                   positions)
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    outer, _state.trace = getattr(_state, "trace", None), trace
    try:
      yield
    finally:
      _state.trace = outer
    found = _foreign_random_ops(graph, graph.get_operations()[first:])
    self._record(found, model)

  def _record(self, found: Dict[str, str], model) -> None:
    names = _layer_names(model) if model is not None else set()
    with self._lock:  # replicas trace on threads of their own
      for scope, op_type in found.items():
        layer = _layer_of(scope, names)
        if layer not in self.dependent:
          self.dependent[layer] = op_type
          logging.warning(
              "Layer %s draws random numbers with %s, which the engine "
              "cannot key by example: its draws depend on the number of "
              "replicas and workers (draw through keras.random, e.g. "
              "keras.random.uniform(shape, seed=self.seed_generator), to "
              "key them; summary.json: replica_dependent_randomness).",
              layer, op_type)

  def summary(self) -> list:
    """summary.json's `replica_dependent_randomness`: sorted layer names."""
    return sorted(self.dependent)


class _Trace:
  """One traced forward pass: the draws' sites are numbered in order."""

  def __init__(self, owner: RowRandomness, step, positions):
    self.owner = owner
    self.step = tf.cast(step, tf.int64)
    self.positions = tf.cast(positions, tf.int64)
    self.sites = 0

  def draw(self, kind: str, shape) -> tf.Tensor:
    """float32 numbers of `shape` (uniform in [0, 1), or standard normal)."""
    with tf.name_scope(_SCOPE):
      shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
      self.sites += 1
      key = tf.constant([self.owner.seed * 2**20 + self.sites], tf.uint64)
      if shape.shape[0] == 0:  # a scalar
        return self._whole(kind, key, shape)
      per_row = tf.equal(shape[0], tf.size(self.positions, out_type=tf.int64))
      if tf.get_static_value(per_row) is not None:
        return (self._per_row if tf.get_static_value(per_row) else
                self._whole)(kind, key, shape)
      return tf.cond(per_row,
                     lambda: self._per_row(kind, key, shape),
                     lambda: self._whole(kind, key, shape))

  def _whole(self, kind, key, shape):
    """The same draw on every replica: a function of (seed, step, site)."""
    count = tf.reduce_prod(shape)
    flat = _philox(kind, key, tf.constant(0, tf.int64), self.step, count)
    return tf.reshape(flat, shape)

  def _per_row(self, kind, key, shape):
    """Row i's numbers are elements [p_i * m, (p_i + 1) * m) of one draw
    over the global batch (m numbers per row): this replica draws the span
    of its rows (at most `rows_per_replica` rows) from the first one's
    counter, and takes its rows."""
    per_row = tf.reduce_prod(shape[1:])
    rows = tf.size(self.positions, out_type=tf.int64)
    first = tf.where(rows > 0, tf.reduce_min(self.positions), 0)
    start = first * per_row
    skip = start % _PER_COUNTER
    span = self.owner.rows_per_replica * per_row
    flat = _philox(kind, key, start // _PER_COUNTER, self.step,
                   span + _PER_COUNTER - 1)
    table = tf.reshape(tf.slice(flat, [skip], [span]),
                       tf.stack([self.owner.rows_per_replica, per_row]))
    return tf.reshape(tf.gather(table, self.positions - first), shape)


def _philox(kind, key, counter_low, counter_high, count):
  op = (tf.raw_ops.StatelessRandomUniformV2 if kind == "uniform" else
        tf.raw_ops.StatelessRandomNormalV2)
  counter = tf.cast(tf.stack([counter_low, counter_high]), tf.uint64)
  return op(shape=tf.reshape(count, [1]), key=key, counter=counter,
            alg=_PHILOX, dtype=tf.float32)


# Keras's TensorFlow random functions the engine replaces inside `rows`
# (keras/src/backend/tensorflow/random.py; the same arguments).
def _uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
  del seed
  low, high = (tf.cast(v, tf.float32) for v in (minval, maxval))
  u = _state.trace.draw("uniform", shape)
  return tf.cast(low + u * (high - low), dtype or keras.config.floatx())


def _normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
  del seed
  mean, stddev = (tf.cast(v, tf.float32) for v in (mean, stddev))
  z = _state.trace.draw("normal", shape)
  return tf.cast(mean + stddev * z, dtype or keras.config.floatx())


def _randint(shape, minval, maxval, dtype="int32", seed=None):
  del seed
  low, high = (tf.cast(v, tf.float32) for v in (minval, maxval))
  u = _state.trace.draw("uniform", shape)
  return tf.cast(tf.minimum(tf.floor(low + u * (high - low)), high - 1),
                 dtype)


def _dropout(inputs, rate, noise_shape=None, seed=None):
  del seed
  if rate == 1.0:
    return tf.zeros_like(inputs)
  if rate == 0.0:
    return inputs
  if noise_shape is None:
    shape = tf.shape(inputs)
  else:  # None: that dimension of the inputs, as Keras reads it
    shape = tf.stack([tf.shape(inputs)[i] if d is None else d
                      for i, d in enumerate(noise_shape)])
  keep = _state.trace.draw("uniform", shape) >= rate
  scale = tf.cast(1.0 / (1.0 - rate), inputs.dtype)
  return inputs * scale * tf.cast(keep, inputs.dtype)


_REPLACEMENTS = {"uniform": _uniform, "normal": _normal,
                 "randint": _randint, "dropout": _dropout}
_install_lock = threading.Lock()


def _install() -> None:
  """Routes Keras's TensorFlow random functions through `_state.trace`
  while one is set on the calling thread; once per process."""
  from keras.src.backend.tensorflow import random as keras_random  # pylint: disable=g-import-not-at-top
  with _install_lock:
    for name, replacement in _REPLACEMENTS.items():
      original = getattr(keras_random, name)
      if getattr(original, "_row_keyed", False):
        continue

      def routed(*args, _original=original, _replacement=replacement,
                 **kwargs):
        if getattr(_state, "trace", None) is None:
          return _original(*args, **kwargs)
        return _replacement(*args, **kwargs)
      routed = functools.wraps(original)(routed)
      routed._row_keyed = True  # pylint: disable=protected-access
      setattr(keras_random, name, routed)


def _foreign_random_ops(graph, operations: Iterable) -> Dict[str, str]:
  """{name scope: op type} of the random ops among `operations` (and in the
  functions they call: conditionals, loops) not drawn by the engine."""
  found = {}
  for op in operations:
    _scan_node(graph, op.name, op.type, op.node_def.attr, found, set())
  return found


def _scan_node(graph, name, op_type, attrs, found, seen) -> None:
  if any(re.fullmatch(_SCOPE + r"(_\d+)?", part) for part in name.split("/")):
    return
  if op_type in _RANDOM_OPS:
    found.setdefault(name.rsplit("/", 1)[0] if "/" in name else name,
                     op_type)
  for value in attrs.values():
    functions = ([value.func.name] if value.HasField("func") else
                 [f.name for f in value.list.func])
    for fn_name in functions:
      if fn_name in seen:
        continue
      seen.add(fn_name)
      fn = graph._get_function(fn_name)  # pylint: disable=protected-access
      if fn is None:
        continue
      prefix = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
      for node in fn.cached_definition.node_def:
        _scan_node(graph, prefix + node.name, node.op, node.attr, found,
                   seen)


def _layer_names(model) -> set:
  return {layer.name for layer in model._flatten_layers()}  # pylint: disable=protected-access


def _layer_of(scope: str, layer_names: set) -> str:
  """The innermost layer named in `scope` ("functional/noise_1/...": noise,
  name scopes of a layer traced twice get a _N suffix), else the scope."""
  for part in reversed(scope.split("/")):
    for candidate in (part, re.sub(r"_\d+$", "", part)):
      if candidate in layer_names:
        return candidate
  return scope
