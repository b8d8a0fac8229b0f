"""Runs benchmark variants in their own processes, rounds alternating the order.

Logical devices are configured once per process, so each variant of a
benchmark runs as `python -m <module> --variant=<name> ...` and prints one
line `RESULT {"rate": ...}`; the best rate of each variant is kept.
"""
import json
import os
import subprocess
import sys


def best_results(module: str, variants, rounds: int, child_flags,
                 trees=None) -> dict:
  """{variant: the RESULT dict of its best-rate run}, printing each rate.

  Args:
    trees: {variant name: (the variant the child runs, source tree)} for
      variants run from another checkout (cwd and PYTHONPATH there), e.g.
      the engine as it was before a change; the others run from here.

  Exits with the child's stderr tail if a variant fails.
  """
  trees = trees or {}
  best = {}
  for r in range(rounds):
    for v in (variants if r % 2 == 0 else variants[::-1]):
      child, tree = trees.get(v, (v, None))
      env = dict(os.environ, PYTHONPATH=tree) if tree else None
      proc = subprocess.run(
          [sys.executable, "-m", module, f"--variant={child}", *child_flags],
          capture_output=True, text=True, timeout=1800, check=False,
          cwd=tree, env=env)
      found = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not found:
        sys.exit(f"variant {v} failed:\n{proc.stderr[-3000:]}")
      result = json.loads(found[0][len("RESULT "):])
      print(f"round {r + 1}: {v:14s} {result['rate']:8.1f} examples/s",
            flush=True)
      if v not in best or result["rate"] > best[v]["rate"]:
        best[v] = result
  return best


def best_rates(module: str, variants, rounds: int, child_flags) -> dict:
  """{variant: best examples/s over `rounds`}; see `best_results`."""
  return {v: r["rate"] for v, r in
          best_results(module, variants, rounds, child_flags).items()}
