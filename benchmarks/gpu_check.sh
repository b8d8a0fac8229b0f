#!/usr/bin/env bash
# Issue 6 on one GPU, under 10 minutes: MobileNetV2 at 224x224, batch 64 and
# 256, with and without mixed precision and XLA (images/s from summary.json's
# steady-state examples_per_sec), then benchmarks.allreduce on the GPU(s).
# Issue 20: the same runs have the fused BatchNorm (the default); b256 with
# --nofused_batchnorm (Keras's own layer), with and without XLA, measures it;
# b64 with TF_ENABLE_ONEDNN_OPTS=0 measures the engine's oneDNN default (on,
# TensorFlow's) against off on a GPU host (summary.json's onednn says which
# ran).
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
run() {  # name, then extra flags; env from the caller
  local name=$1; shift
  echo "== $name"
  timeout 150 "$PY" -m engine.main --strategy=one_device --devices=/gpu:0 \
    --model=mobilenet_v2 --image_size=224 --dataset=synthetic \
    --synthetic_examples=$((B * STEPS)) --batch_size_per_replica=$B \
    --train_steps=$STEPS --steps_per_loop=10 --log_every=10 \
    --model_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 \
    || echo "   failed (exit $?), see $OUT/$name.log"
}
for batch in 64 256; do
  for mp in none mixed_float16; do
    for xla in nojit_compile jit_compile; do
      B=$batch run "b${batch}_${mp}_${xla}" --mixed_precision=$mp --$xla
    done
  done
done
for xla in nojit_compile jit_compile; do
  B=256 run "b256_mixed_float16_${xla}_nofused" --mixed_precision=mixed_float16 \
    --$xla --nofused_batchnorm
done
B=64 TF_ENABLE_ONEDNN_OPTS=0 run "b64_none_nojit_compile_noonednn" \
  --mixed_precision=none --nojit_compile
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
print("%-44s %12s %7s" % ("run", "images/s", "oneDNN"))
for name in sorted(os.listdir(out)):
  path = os.path.join(out, name, "summary.json")
  if os.path.exists(path):
    s = json.load(open(path))
    print("%-44s %12.1f %7s" % (name, s["examples_per_sec"] or float("nan"),
                                s.get("onednn")))
PYEOF
echo "== benchmarks.allreduce on the GPU(s)"
timeout 120 "$PY" -m benchmarks.allreduce --workers=0 --iters=10 \
  2>&1 | grep -v "^[WI]0000" | tee "$OUT/allreduce.txt"
