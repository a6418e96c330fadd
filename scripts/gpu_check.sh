#!/usr/bin/env bash
# Every GPU check in one command (< 8 minutes, no network, no pip; JAX 0.11.2 preinstalled):
#   1. device info
#   2. the kernel tests, compiled on the GPU against the reference (XLASERVE_KERNELS_NATIVE=1)
#   3. scripts/bench_kernels.py: kernel bandwidth sweep vs copy bandwidth, plus a tile sweep
#   4. scripts/bench_decode.py: Llama-3.1-8B-shaped random-weight bf16 model, batch 1/16/64/256
#   5. quant.hlo: which GEMM XLA picks for int8 / fp8 weights (8B MLP shape), and its speed
#   6. scripts/bench_decode.py again with int8 and fp8 weights, batch 1 and 64
# Each part runs under its own `timeout`; a part that fails or times out is reported and the
# others still run. The combined table goes to $1, else $OUT/gpu_check.txt if OUT is set, else
# ./gpu_check.txt; it is also printed at the end.
#
#   bash scripts/gpu_check.sh [TABLE_FILE]
# GPU_CHECK_SMOKE=1 JAX_PLATFORMS=cpu: the same script on tiny configs (checks the script on CPU).
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"  # tests/conftest.py would default to cpu
PY="${PYTHON:-$(command -v python3 || command -v python)}"

if [ $# -ge 1 ]; then TABLE="$1"
elif [ -n "${OUT:-}" ]; then TABLE="$OUT/gpu_check.txt"
else TABLE="$PWD/gpu_check.txt"; fi
mkdir -p "$(dirname "$TABLE")" && : > "$TABLE"
LOGDIR="$(dirname "$TABLE")/gpu_check_logs"
mkdir -p "$LOGDIR"

SUMMARY=()
note() { echo "$*" | tee -a "$TABLE"; }

# run NAME SECONDS CMD...: CMD's output goes to the console and to $LOGDIR/NAME.log.
run() {
  local name="$1" limit="$2"; shift 2
  note ""
  note "## $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  local status="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT"
  elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; fi
  SUMMARY+=("$name | $status | $((SECONDS - t0)) s")
  note "## $name: $status after $((SECONDS - t0)) s"
}

COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
[ -n "$(git status --porcelain 2>/dev/null | head -1)" ] && COMMIT="$COMMIT+uncommitted"
note "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $COMMIT"

run device-info 30 bash -c '
  command -v nvidia-smi >/dev/null || echo "no nvidia-smi"
  command -v nvidia-smi >/dev/null && nvidia-smi --format=csv \
    --query-gpu=name,memory.total,driver_version,clocks.max.sm
  "'"$PY"'" -c "
import jax
print(\"jax\", jax.__version__, \"backend\", jax.default_backend())
for d in jax.devices():
    print(d, \"|\", d.device_kind, \"| cores\", getattr(d, \"core_count\", \"?\"),
          \"| memory\", (d.memory_stats() or {}).get(\"bytes_limit\"))
"'
grep -E "^(jax|cuda|NVIDIA|name)|\| memory" "$LOGDIR/device-info.log" >> "$TABLE" || true

# 2. Kernel tests on the GPU (the demo-model test needs gguf, absent here: deselected).
XLASERVE_KERNELS_NATIVE=1 run kernel-tests 70 "$PY" -m pytest -q -rfE -p no:cacheprovider \
  tests/test_kernels.py -k "not demo_model"
grep -E "passed|failed|error|FAILED|ERROR" "$LOGDIR/kernel-tests.log" | tail -15 >> "$TABLE" || true

if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  KERNEL_ARGS=(--quick) DECODE_ARGS=(--tiny --batch-sizes 1,4)
  HLO_ARGS=(--k 256 --n 512 --m 1,4 --iters 3) QDECODE_ARGS=(--tiny --batch-sizes 1,4)
else
  HLO_ARGS=(--k 4096 --n 14336 --m 1,64)
  QDECODE_ARGS=(--batch-sizes 1,64 --prompt-len 128 --output-len 64 --max-model-len 1024
                --dtype bfloat16)
  KERNEL_ARGS=(--tune) DECODE_ARGS=(--batch-sizes 1,16,64,256 --prompt-len 128 --output-len 64
                                    --max-model-len 1024 --dtype bfloat16)
fi

# 3. Kernel bandwidth sweep (rows land in the table as they finish).
run bench-kernels 80 "$PY" scripts/bench_kernels.py "${KERNEL_ARGS[@]}" --max-seconds 65 \
  --out "$TABLE"

# 4. End-to-end decode, 8B shape, bf16.
run bench-decode 120 "$PY" scripts/bench_decode.py "${DECODE_ARGS[@]}" --max-seconds 100 \
  --out "$TABLE"

# 5. Quantized matmuls: the GEMM XLA chose and its speed.
run quant-hlo 40 "$PY" -m quant.hlo "${HLO_ARGS[@]}" --out "$TABLE"

# 6. Decode with int8 / fp8 weights (bf16 is part 4).
for scheme in int8 fp8; do
  run "bench-decode-$scheme" 75 "$PY" scripts/bench_decode.py "${QDECODE_ARGS[@]}" \
    --quantize "$scheme" --max-seconds 60 --out "$TABLE"
done

note ""
note "## summary: part | status | time (total ${SECONDS} s)"
for line in "${SUMMARY[@]}"; do note "$line"; done
echo
echo "================ $TABLE ================"
cat "$TABLE"
