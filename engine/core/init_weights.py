"""Fine-tuning: `--init_weights=PATH` and `--freeze=REGEX`.

`load(model, path)` copies the variables of a saved model into `model`
before step 0 (engine/core/run.py skips it when the run resumes from its own
checkpoint). A variable is matched by its place in the model, the way Keras
and TensorFlow themselves restore: the layer path for Keras files, the object
path for checkpoints, the layer name for Keras's legacy ImageNet files. A
matched variable must have the same shape; a different shape is an error
(`ConfigError`, exit 2), as is a file that cannot be read or one of which
nothing matches. Variables the file lacks keep their fresh initialisation
(a new classifier head, say); both lists are logged.

Sources, told apart by their content:
  * Keras 3 `.weights.h5`, or a `.keras` archive (its model.weights.h5);
  * a checkpoint of an engine run: its model_dir, the checkpoints/ directory
    or a checkpoint prefix (latest checkpoint of a directory);
  * Keras's legacy `.h5` weight files (the ImageNet files
    keras.applications downloads: root attribute `layer_names`).
"""
import io
import os
import re
import tempfile
import zipfile
from typing import Dict, List, Tuple

from absl import logging
import h5py
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from engine.errors import ConfigError, flag_error

_FLAG = "init_weights"
_KERAS_WEIGHTS = "model.weights.h5"  # inside a .keras archive
_LISTED = 8  # names listed in a log line before "and N more"


def is_legacy_h5(path: str) -> bool:
  """Whether `path` is a Keras 2 / legacy weight file (e.g. ImageNet's)."""
  if not (path.endswith(".h5") and os.path.isfile(path)):
    return False
  try:
    with h5py.File(path, "r") as f:
      return "layer_names" in f.attrs or "model_weights" in f
  except OSError:
    return False


def initialize(model, initialization, *, resuming: bool) -> None:
  """`--init_weights` for a run that does not resume its own checkpoint
  (a resumed run continues from its own weights, whatever the flag says)."""
  if initialization.init_weights and not resuming:
    load(model, initialization.init_weights)


def load(model, path: str) -> Dict[str, List[str]]:
  """Copies the matching variables of the file or run at `path` into `model`.

  Returns:
    {"matched": [...], "missing": [...] (the model's, not in the file),
     "unused": [...] (the file's, not in the model)}: variable names.

  Raises:
    ConfigError: no such file, unreadable, a shape mismatch, nothing matched.
  """
  try:
    if is_legacy_h5(path):
      result = _load_legacy_h5(model, path)
    elif path.endswith(".keras") and os.path.isfile(path):
      with zipfile.ZipFile(path) as archive:
        data = archive.read(_KERAS_WEIGHTS)
      result = _load_keras_h5(model, io.BytesIO(data), path)
    elif path.endswith(".h5") and os.path.isfile(path):
      result = _load_keras_h5(model, path, path)
    else:
      result = _load_checkpoint(model, _checkpoint_prefix(path), path)
  except (OSError, KeyError, zipfile.BadZipFile, tf.errors.OpError) as e:
    raise flag_error(_FLAG, path, f"cannot be read ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200] if str(e) else ''})."
                     ) from e
  if not result["matched"]:
    raise flag_error(_FLAG, path, "no variable of the model matches one in "
                     "it (by name and shape); is it another model's?")
  logging.info("--init_weights=%s: loaded %d variable(s): %s", path,
               len(result["matched"]), _listing(result["matched"]))
  logging.info("--init_weights: %d of the model's variable(s) not in the "
               "file keep their initial values: %s", len(result["missing"]),
               _listing(result["missing"]))
  if result["unused"]:
    logging.info("--init_weights: %d variable(s) of the file are not in the "
                 "model: %s", len(result["unused"]),
                 _listing(result["unused"]))
  return result


def freeze(model, pattern: str) -> List[str]:
  """Sets `trainable = False` on the layers whose name `pattern` searches.

  Keras 3 runs a non-trainable BatchNormalization in inference mode (its
  moving statistics are used and not updated), which is what freezing it
  means for fine-tuning.

  Returns:
    The frozen layers' names.

  Raises:
    ConfigError: no layer's name matches.
  """
  regex = re.compile(pattern)
  frozen = [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if regex.search(layer.name)]
  if not frozen:
    raise flag_error("freeze", pattern,
                     f"matches no layer of model {model.name} (layer names "
                     f"are e.g. {_listing([l.name for l in model.layers])}).")
  for layer in frozen:
    layer.trainable = False
  names = [layer.name for layer in frozen]
  logging.info("--freeze=%s: %d layer(s) not trained: %s", pattern,
               len(names), _listing(names))
  return names


def _listing(names) -> str:
  shown = ", ".join(names[:_LISTED])
  more = len(names) - _LISTED
  return (shown + (f" and {more} more" if more > 0 else "")) or "none"


def _match(ours: Dict[str, Tuple[str, tuple]], theirs: Dict[str, tuple],
           path: str) -> Tuple[List[str], Dict[str, List[str]]]:
  """Keys present on both sides, after checking their shapes.

  Args:
    ours: key -> (the variable's name for logs, shape).
    theirs: key -> shape in the file.
  """
  keys = [k for k in ours if k in theirs]
  for key in keys:
    name, shape = ours[key]
    if tuple(shape) != tuple(theirs[key]):
      raise flag_error(_FLAG, path, f"variable {name} has shape "
                       f"{list(theirs[key])} in the file but "
                       f"{list(shape)} in the model; use weights of the same "
                       "architecture (a different head? start from a file "
                       "without it).")
  return keys, {
      "matched": [ours[k][0] for k in keys],
      "missing": [ours[k][0] for k in ours if k not in theirs],
      "unused": [k for k in theirs if k not in ours]}


def _load_keras_h5(model, source, path: str) -> Dict[str, List[str]]:
  """Keras 3 weights: matched by their h5 path (layer path + index).

  The model's own weights are written to a temporary file in the same
  layout; matched datasets are overwritten there and Keras loads the file,
  so Keras maps h5 paths to variables itself.
  """
  with tempfile.TemporaryDirectory(prefix="tfengine_init_") as tmp:
    mine = os.path.join(tmp, "model.weights.h5")
    model.save_weights(mine)
    with h5py.File(source, "r") as src, h5py.File(mine, "r+") as dst:
      theirs, ours = _datasets(src), _datasets(dst)
      names = _h5_variable_names(model, dst)
      keys, result = _match(
          {k: (names.get(k, k), d.shape) for k, d in ours.items()},
          {k: d.shape for k, d in theirs.items()}, path)
      for key in keys:
        dst[key][...] = theirs[key][...]
    model.load_weights(mine)
  return result


def _datasets(f) -> Dict[str, "h5py.Dataset"]:
  found = {}

  def visit(name, obj):  # returns None: a value would end the visit
    if isinstance(obj, h5py.Dataset):
      found[name] = obj
  f.visititems(visit)
  return found


def _h5_variable_names(model, f) -> Dict[str, str]:
  """h5 path -> variable path, for logs (each `vars` group names its layer)."""
  layers = {}
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    layers.setdefault(layer.name, layer)
  names = {}
  for key in _datasets(f):
    group, _, index = key.rpartition("/")
    layer = layers.get(f[group].attrs.get("name", ""))
    if layer is None:
      continue
    own = {}
    layer.save_own_variables(own)  # {"0": variable, ...}, Keras's order
    if index in own and hasattr(own[index], "path"):
      names[key] = own[index].path
  return names


def _load_legacy_h5(model, path: str) -> Dict[str, List[str]]:
  """Keras 2 layout: a group per layer name, its weights in layer order."""
  ours, variables = {}, {}
  for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
    weights = layer.trainable_weights + layer.non_trainable_weights
    for i, v in enumerate(weights):
      key = f"{layer.name}/{i}"
      ours[key], variables[key] = (v.path, tuple(v.shape)), v
  with h5py.File(path, "r") as f:
    root = f["model_weights"] if "model_weights" in f else f
    theirs, arrays = {}, {}
    for layer_name in root.attrs["layer_names"]:
      layer_name = _text(layer_name)
      group = root[layer_name]
      for i, weight_name in enumerate(group.attrs.get("weight_names", [])):
        key = f"{layer_name}/{i}"
        arrays[key] = group[_text(weight_name)]
        theirs[key] = arrays[key].shape
    keys, result = _match(ours, theirs, path)
    for key in keys:
      variables[key].assign(np.asarray(arrays[key]))
  return result


def _text(value) -> str:
  return value.decode("utf8") if isinstance(value, bytes) else str(value)


def _checkpoint_prefix(path: str) -> str:
  """A checkpoint prefix from a model_dir, a checkpoints/ dir or a prefix."""
  if os.path.isdir(path):
    for directory in (os.path.join(path, "checkpoints"), path):
      latest = tf.train.latest_checkpoint(directory)
      if latest:
        return latest
    raise flag_error(_FLAG, path, "holds no checkpoint (nor checkpoints/); "
                     "pass a run's model_dir, a .weights.h5 or .keras file.")
  if os.path.exists(path + ".index"):
    return path
  raise flag_error(_FLAG, path, "is neither a .weights.h5, .keras or legacy "
                   ".h5 file nor a checkpoint.")


def _load_checkpoint(model, prefix: str, path: str) -> Dict[str, List[str]]:
  """An engine checkpoint (tf.train.Checkpoint(model=..., ...)): variables
  matched by their object path under `model/`, the first path found
  breadth-first on both sides (the same graph gives the same paths)."""
  reader = tf.train.load_checkpoint(prefix)
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
  theirs, keys_in_file = {}, {}
  shapes = reader.get_variable_to_shape_map()
  for node_path, node in _proto_paths(graph):
    for attribute in node.attributes:
      if attribute.name == "VARIABLE_VALUE" and node_path not in theirs:
        theirs[node_path] = tuple(shapes[attribute.checkpoint_key])
        keys_in_file[node_path] = attribute.checkpoint_key
  ours, variables = {}, {}
  by_id = {id(v): v for v in model.weights}
  for node_path, obj in _object_paths(model):
    if id(obj) in by_id and node_path not in ours:
      ours[node_path] = (obj.path, tuple(obj.shape))
      variables[node_path] = obj
  keys, result = _match(ours, theirs, path)
  for key in keys:
    variables[key].assign(reader.get_tensor(keys_in_file[key]))
  return result


def _proto_paths(graph):
  """(path, node) breadth-first from the checkpoint's `model` child."""
  nodes = graph.nodes
  start = [c.node_id for c in nodes[0].children if c.local_name == "model"]
  if not start:
    raise KeyError("the checkpoint holds no `model`")
  queue, seen = [("model", start[0])], {start[0]}
  while queue:
    node_path, node_id = queue.pop(0)
    yield node_path, nodes[node_id]
    for child in nodes[node_id].children:
      if child.node_id not in seen:
        seen.add(child.node_id)
        queue.append((f"{node_path}/{child.local_name}", child.node_id))


def _object_paths(model):
  """(path, object) breadth-first from `model`, as a Checkpoint names them."""
  view = tf.train.TrackableView
  queue, seen = [("model", model)], {id(model)}
  while queue:
    node_path, obj = queue.pop(0)
    yield node_path, obj
    for name, child in view(obj).children(obj).items():
      if id(child) not in seen:
        seen.add(id(child))
        queue.append((f"{node_path}/{name}", child))
