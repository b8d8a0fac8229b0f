"""The code's shape: no import cycles, the engine's core apart from the
built-in task, every path the docs and docstrings name exists, and every
name the code uses is bound (pyflakes) and every import of ours resolves.

Read from the sources (no import), so it costs a fraction of a second.
"""
import ast
import os
import re
import subprocess

from conftest import ROOT

# Folder -> the package it is imported as (pyproject.toml's mapping).
PACKAGES = {"engine": "engine", "models": "engine.models",
            "data": "engine.data"}
# The built-in image task and what only it (and the entry points that run or
# document it) may import.
TASK_SIDE = ("engine.tasks", "engine.models", "engine.data")
ENTRY_POINTS = ("engine.main", "engine.reference")


def _modules():
  """{module name: path} of everything the wheel installs."""
  found = {}
  for folder, package in PACKAGES.items():
    base = os.path.join(ROOT, folder)
    for dirpath, dirnames, files in os.walk(base):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3]
          parts = [p for p in rel.split(os.sep) if p != "__init__"]
          found[".".join([package, *parts])] = os.path.join(dirpath, f)
  return found


def _imports(path, modules):
  """The modules of ours `path` imports, at the top or inside functions."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in
                 modules else node.module for a in node.names)
  return {m for m in out if m in modules}


def _graph():
  modules = _modules()
  return {m: _imports(p, modules) - {"engine"} for m, p in modules.items()
          if m != "engine"}  # engine/__init__ only names the public API


def _unit(module):
  """A subpackage counts as one unit; a top-level module as itself."""
  parts = module.split(".")
  return ".".join(parts[:2]) if len(parts) > 2 or module in (
      "engine.core", "engine.distribute", "engine.host", "engine.report",
      "engine.tasks", "engine.models", "engine.data") else module


def _cycle(graph):
  """One cycle of `graph` as a list of nodes, or None."""
  state = {}

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt, path + [nxt])
        if found:
          return found
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node, [node])
      if found:
        return found
  return None


def test_no_import_cycles_between_modules_or_packages():
  graph = _graph()
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))
  units = {}
  for module, deps in graph.items():
    units.setdefault(_unit(module), set()).update(
        _unit(d) for d in deps if _unit(d) != _unit(module))
  assert _cycle(units) is None, " -> ".join(_cycle(units))


def test_the_engine_imports_nothing_of_the_built_in_task():
  for module, deps in _graph().items():
    if module.startswith(TASK_SIDE) or module in ENTRY_POINTS:
      continue
    task_side = sorted(d for d in deps if d.startswith(TASK_SIDE))
    assert not task_side, f"{module} imports {task_side}"


# Paths in the checkout: engine/core/run.py, README's links into docs/, ...
_PATH = re.compile(r"(?<![\w/.-])((?:engine|data|models|benchmarks|tests|"
                   r"examples|docs)/[\w/.-]*\w\.(?:py|md|sh))\b")
_MODULE = re.compile(
    r"python -m ((?:engine|benchmarks|examples)(?:\.[a-z_][a-z0-9_]*)*)")


def _tracked(*suffixes):
  files = subprocess.run(["git", "ls-files", "--cached", "--others",
                          "--exclude-standard"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
  return [f for f in files if f.endswith(suffixes) and os.path.exists(
      os.path.join(ROOT, f))]


def test_every_path_and_module_the_code_and_docs_name_exists():
  # RESULTS.md is a dated record of what was measured with the code of its
  # day; its commands name that day's files.
  missing = []
  modules = _modules()
  for name in _tracked(".py", ".md"):
    if name == "benchmarks/RESULTS.md":
      continue
    text = open(os.path.join(ROOT, name)).read()
    base = os.path.dirname(os.path.join(ROOT, name))
    for path in _PATH.findall(text):
      if not (os.path.exists(os.path.join(ROOT, path)) or
              os.path.exists(os.path.join(base, path))):
        missing.append(f"{name}: {path}")
    for module in _MODULE.findall(text):
      file = os.path.join(ROOT, *module.split("."))
      if module not in modules and not (os.path.exists(file + ".py") or
                                        os.path.isdir(file)):
        missing.append(f"{name}: python -m {module}")
  assert not missing, "\n".join(missing)


def _defined_at_top(tree):
  """Names a module binds at its top level (also under if/try there), or
  None when it defines a module `__getattr__` (any name may resolve)."""
  names = set()

  def bind(statements):
    for node in statements:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                           ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [
            node.target]
        for target in targets:
          names.update(n.id for n in ast.walk(target)
                       if isinstance(n, ast.Name))
      elif isinstance(node, (ast.Import, ast.ImportFrom)):
        names.update((a.asname or a.name).split(".")[0] for a in node.names)
      elif isinstance(node, (ast.If, ast.Try, ast.With)):
        bind(node.body)
        bind(getattr(node, "orelse", []))
        bind(getattr(node, "finalbody", []))
        for handler in getattr(node, "handlers", []):
          bind(handler.body)
  bind(tree.body)
  return None if "__getattr__" in names else names


# Forward references in string annotations, which pyflakes reads as names.
_ANNOTATIONS = {("engine/cli.py", "Task"),
                ("engine/tasks/image_classification.py", "engine")}


def test_every_name_the_code_uses_is_defined_and_every_import_resolves():
  """What only running a rarely run path would show (a benchmark's variant,
  an error branch): a name used but never bound (pyflakes), or an import of
  one of our modules that names what the module does not define."""
  from pyflakes import checker, messages  # pylint: disable=g-import-not-at-top
  modules = _modules()
  tops = {}
  problems = []
  for name in _tracked(".py"):
    tree = ast.parse(open(os.path.join(ROOT, name)).read(), name)
    for m in checker.Checker(tree, filename=name).messages:
      if isinstance(m, (messages.UndefinedName, messages.UndefinedLocal,
                        messages.UndefinedExport)) and (
                            name, m.message_args[0]) not in _ANNOTATIONS:
        problems.append(f"{name}:{m.lineno}: {m.message % m.message_args}")
    for node in ast.walk(tree):
      if not (isinstance(node, ast.ImportFrom) and node.module in modules
              and node.module != "engine"):  # engine/__init__ maps lazily
        continue
      if node.module not in tops:
        tops[node.module] = _defined_at_top(
            ast.parse(open(modules[node.module]).read()))
      for alias in node.names:
        if (f"{node.module}.{alias.name}" not in modules and
            tops[node.module] is not None and
            alias.name not in tops[node.module]):
          problems.append(f"{name}:{node.lineno}: {node.module} has no "
                          f"{alias.name!r}")
  assert not problems, "\n".join(problems)
