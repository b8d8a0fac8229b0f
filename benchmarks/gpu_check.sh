#!/usr/bin/env bash
# Issue 6 on one GPU, under 8 minutes: MobileNetV2 at 224x224, batch 64 and
# 256, with and without mixed precision and XLA (images/s from summary.json's
# steady-state examples_per_sec), then benchmarks.allreduce on the GPU(s).
#
#   bash benchmarks/gpu_check.sh [python] [out_dir]
#
# Each run is bounded by `timeout`; a failed run is reported, not fatal.
set -u
PY=${1:-.venv/bin/python}
OUT=${2:-/tmp/gpu_check}
STEPS=${STEPS:-40}
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
for batch in 64 256; do
  for mp in none mixed_float16; do
    for xla in nojit_compile jit_compile; do
      name="b${batch}_${mp}_${xla}"
      echo "== $name"
      timeout 150 "$PY" -m engine.main --strategy=one_device --devices=/gpu:0 \
        --model=mobilenet_v2 --image_size=224 --dataset=synthetic \
        --synthetic_examples=$((batch * STEPS)) --batch_size_per_replica=$batch \
        --train_steps=$STEPS --steps_per_loop=10 --log_every=10 \
        --mixed_precision=$mp --$xla --model_dir="$OUT/$name" \
        > "$OUT/$name.log" 2>&1 || echo "   failed (exit $?), see $OUT/$name.log"
    done
  done
done
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
print("%-34s %12s" % ("run", "images/s"))
for name in sorted(os.listdir(out)):
  path = os.path.join(out, name, "summary.json")
  if os.path.exists(path):
    s = json.load(open(path))
    print("%-34s %12.1f" % (name, s["examples_per_sec"] or float("nan")))
PYEOF
echo "== benchmarks.allreduce on the GPU(s)"
timeout 120 "$PY" -m benchmarks.allreduce --workers=0 --iters=10 \
  2>&1 | grep -v "^[WI]0000" | tee "$OUT/allreduce.txt"
