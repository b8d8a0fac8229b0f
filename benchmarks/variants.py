"""Runs benchmark variants in their own processes, rounds alternating the order.

Logical devices are configured once per process, so each variant of a
benchmark runs as `python -m <module> --variant=<name> ...` (or any command
line, `run_rounds`) and prints one line `RESULT {"rate": ...}`.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional


class Command(NamedTuple):
  """How to start one variant: its argv, environment and directory."""
  argv: List[str]
  env: Optional[Dict[str, str]] = None  # None: this process's environment
  cwd: Optional[str] = None


def run_rounds(commands: Dict[str, Command], rounds: int) -> dict:
  """{variant: [RESULT dict of each round]}, printing each rate.

  Round r runs the variants in order, r + 1 in reverse, and so on, so that
  no variant always follows the same one. Exits with the child's stderr
  tail if a variant fails. Each RESULT gets "cpu_seconds": the CPU time
  (user + system, all threads) of the variant's whole process, start-up
  included: on a shared machine it moves far less with the load than the
  rate does.
  """
  results = {v: [] for v in commands}
  names = list(commands)
  for r in range(rounds):
    for v in (names if r % 2 == 0 else names[::-1]):
      cmd = commands[v]
      before = _children_cpu()
      proc = subprocess.run(cmd.argv, capture_output=True, text=True,
                            timeout=1800, check=False, cwd=cmd.cwd,
                            env=cmd.env)
      cpu = _children_cpu() - before
      found = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not found:
        sys.exit(f"variant {v} failed:\n{proc.stderr[-3000:]}")
      result = json.loads(found[0][len("RESULT "):])
      result["cpu_seconds"] = cpu
      print(f"round {r + 1}: {v:14s} {result['rate']:8.1f} examples/s "
            f"{cpu:7.1f} CPU s", flush=True)
      results[v].append(result)
  return results


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def median_rates(results: dict) -> dict:
  """{variant: median rate} of `run_rounds`'s results."""
  return {v: statistics.median(r["rate"] for r in rs)
          for v, rs in results.items()}


def best_results(module: str, variants, rounds: int, child_flags,
                 trees=None) -> dict:
  """{variant: the RESULT dict of its best-rate run}, printing each rate.

  Args:
    trees: {variant name: (the variant the child runs, source tree)} for
      variants run from another checkout (cwd and PYTHONPATH there), e.g.
      the engine as it was before a change; the others run from here.
  """
  trees = trees or {}
  commands = {}
  for v in variants:
    child, tree = trees.get(v, (v, None))
    commands[v] = Command(
        [sys.executable, "-m", module, f"--variant={child}", *child_flags],
        dict(os.environ, PYTHONPATH=tree) if tree else None, tree)
  return {v: max(rs, key=lambda r: r["rate"])
          for v, rs in run_rounds(commands, rounds).items()}


def best_rates(module: str, variants, rounds: int, child_flags) -> dict:
  """{variant: best examples/s over `rounds`}; see `best_results`."""
  return {v: r["rate"] for v, r in
          best_results(module, variants, rounds, child_flags).items()}
