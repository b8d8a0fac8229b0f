"""The listing cache of an image folder, a JSON file in the run's model_dir.

Listing a million files takes minutes on network storage; a restart after
preemption finds the list here instead. The file is keyed by the folder's
absolute path and holds the modification time of every directory the listing
read: adding, removing or renaming a file changes its directory's time, and a
new sub-directory changes its parent's, so comparing those times (one `stat`
per directory, not per file) tells whether the list is still the folder's.
A file rewritten in place keeps the list valid: only names are cached.
"""
import dataclasses
import hashlib
import json
import os
from typing import Optional, Tuple

from absl import logging

_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Listing:
  """The example list of a folder: paths[i] has label labels[i]."""
  class_names: Tuple[str, ...]
  paths: Tuple[str, ...]
  labels: Tuple[int, ...]


def path_for(cache_dir: str, root: str) -> str:
  key = hashlib.sha1(root.encode()).hexdigest()[:16]
  return os.path.join(cache_dir, "listings", f"{key}.json")


def _mtimes(dirs):
  return [os.stat(d).st_mtime_ns for d in dirs]


def load(cache_dir: Optional[str], root: str):
  """The cached Listing of `root`, or None (no cache, or the folder changed)."""
  if not cache_dir:
    return None
  path = path_for(cache_dir, root)
  try:
    with open(path) as f:
      saved = json.load(f)
    if (saved["version"] != _VERSION or saved["root"] != root or
        _mtimes(saved["dirs"]) != saved["mtimes"]):
      logging.info("Folder %s changed since its listing was cached; listing "
                   "it again.", root)
      return None
  except (OSError, ValueError, KeyError):  # no cache, or a directory is gone
    return None
  logging.info("Folder %s: listing from %s.", root, path)
  return Listing(tuple(saved["class_names"]), tuple(saved["paths"]),
                 tuple(saved["labels"]))


def save(cache_dir: str, root: str, listing, dirs) -> None:
  """Writes the listing atomically (a reader never sees half a file).

  Args:
    dirs: (directory, modification time in ns) of every directory read.
  """
  path = path_for(cache_dir, root)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  # `dirs`: (directory, time) pairs, each time read before the directory
  # was listed (data/folder.py), so a change made meanwhile is seen.
  record = {"version": _VERSION, "root": root, "dirs": [d for d, _ in dirs],
            "mtimes": [t for _, t in dirs], "class_names": list(listing.class_names),
            "paths": list(listing.paths), "labels": list(listing.labels)}
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
  os.replace(tmp, path)
