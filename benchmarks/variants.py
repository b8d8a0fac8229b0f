"""Runs benchmark variants in their own processes, rounds alternating the order.

Logical devices are configured once per process, so each variant of a
benchmark runs as `python -m <module> --variant=<name> ...` and prints one
line `RESULT {"rate": ...}`; the best rate of each variant is kept.
"""
import json
import subprocess
import sys


def best_rates(module: str, variants, rounds: int, child_flags) -> dict:
  """{variant: best examples/s over `rounds`}, printing each run's rate.

  Exits with the child's stderr tail if a variant fails.
  """
  best = dict.fromkeys(variants, 0.0)
  for r in range(rounds):
    for v in (variants if r % 2 == 0 else variants[::-1]):
      proc = subprocess.run(
          [sys.executable, "-m", module, f"--variant={v}", *child_flags],
          capture_output=True, text=True, timeout=1800, check=False)
      found = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not found:
        sys.exit(f"variant {v} failed:\n{proc.stderr[-3000:]}")
      rate = json.loads(found[0][len("RESULT "):])["rate"]
      print(f"round {r + 1}: {v:8s} {rate:8.1f} examples/s", flush=True)
      best[v] = max(best[v], rate)
  return best
