#!/usr/bin/env bash
# Every GPU check in one pass of at most 6 minutes on one H200 (no network, no pip; JAX 0.11.2
# and the project preinstalled), so a 15-minute device lease can run it twice:
#   part             budget  what
#   device-info        10 s  GPU, driver, JAX's view of its memory
#   kernel-tests       45 s  both Pallas kernels (pallas, pallas_pages) natively against the
#                            reference, with windows, sinks and soft-caps too, and in the
#                            engine on random and real (demo) weights
#   bench-kernels      30 s  decode attention bandwidth of both kernels vs copy bandwidth (the
#                            goal cases, then a window at 4x its context, gpt-oss's sinks
#                            with and without its window, Gemma 2's soft-cap), then a tile
#                            sweep (--tune) in what is left
#   mla-decode         30 s  DeepSeek-V3's MLA kernel over latent pages (latent_attention_pallas):
#                            natively against its reference (bf16, int8 and fp8 rows), then
#                            decode latent GB/s vs copy bandwidth at H=16/128, batch 1/32/128,
#                            context 1k/8k, as many as fit (scripts/bench_mla_decode.py). Its
#                            30 s come out of what moe-grouped, last, is left
#   engine-8b-cold     80 s  Llama-3.1-8B-shaped bf16 dummy engine, default memory sizing
#                            (the plan, peak memory), cold warm-up, decode tok/s at batch
#                            1/64/256 over steps where the whole batch decodes, and per
#                            batch the host's phases, the device alone and the host time
#                            on the path (what the device waits for between steps)
#   engine-8b-warm     35 s  the same engine restarted: warm-up from the compilation cache
#   engine-8b-sync     30 s  engine-8b-cold's decode with --no-async-scheduling (warm)
#   quant-hlo          20 s  the GEMM XLA chose for int8 / fp8 weights (8B MLP shape)
#   quant-hlo-blocks   40 s  fp8 with 128 x 128 block scales (DeepSeek-V3's form) against fp8
#                            per channel and bf16 at DeepSeek-V3's expert shapes, 7168 x 2048
#                            and 2048 x 7168, at 1/16/64/1024 rows: the GEMM XLA chose, time,
#                            weight bandwidth (rows written as they finish)
#   serve-8b           45 s  `python -m serving serve` on that model: /health, one streamed
#                            completion
#   tensor-parallel    90 s  (after engine-8b-warm) only with more than one GPU: the 8B-shaped engine at TP=1 and at
#                            TP=N (N = the GPUs, at most 8), decode tok/s at batch 1/64
#   moe-grouped        60 s  a Qwen3-30B-A3B-shaped expert MLP (hidden 2048, 128 experts, top-8,
#                            bf16) at 16/64/256/1024 tokens, then DeepSeek-V3's (hidden 7168,
#                            256 experts, expert intermediate 2048) at 16/64/256: ragged_dot
#                            and our Pallas grouped matmul (the MoE block's GPU default,
#                            --moe-backend) vs the same FLOPs dense and vs every token through
#                            every expert; which op XLA made of the ragged dot; then the
#                            ragged dot again with XLA's cuDNN ragged-dot fusion flag. Last,
#                            so that it only takes what the parts before leave of the pass
#                            (rows are written as they finish)
# Each part runs under `timeout` (its budget, cut to what is left of the pass); a part that
# fails or times out is reported and the others still run. One table: $1, else
# $OUT/gpu_check.txt if OUT is set, else ./gpu_check.txt; printed at the end.
#
#   bash scripts/gpu_check.sh [TABLE_FILE]
# GPU_CHECK_SMOKE=1 JAX_PLATFORMS=cpu: the same script on tiny configs (checks it on a CPU).
set -u
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"  # tests/conftest.py would default to cpu
PY="${PYTHON:-$(command -v python3 || command -v python)}"
PASS_SECONDS="${GPU_CHECK_SECONDS:-355}"

if [ $# -ge 1 ]; then TABLE="$1"
elif [ -n "${OUT:-}" ]; then TABLE="$OUT/gpu_check.txt"
else TABLE="$PWD/gpu_check.txt"; fi
mkdir -p "$(dirname "$TABLE")" && : > "$TABLE"
LOGDIR="$(dirname "$TABLE")/gpu_check_logs"
WORK="$(mktemp -d)"
mkdir -p "$LOGDIR"
trap 'rm -rf "$WORK"' EXIT

SUMMARY=()
note() { echo "$*" | tee -a "$TABLE"; }

# run NAME BUDGET CMD...: CMD's output goes to the console and to $LOGDIR/NAME.log.
run() {
  local name="$1" budget="$2"; shift 2
  local left=$((PASS_SECONDS - SECONDS)) limit="$budget"
  [ "$left" -lt "$limit" ] && limit="$left"
  note ""
  if [ "$limit" -lt 5 ]; then
    SUMMARY+=("$name | SKIPPED (pass budget spent) | 0 s of $budget s")
    note "## $name: skipped, the pass's ${PASS_SECONDS}s are spent"
    return
  fi
  note "## $name (budget ${budget}s, limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=3 "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  local status="ok"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT"
  elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; fi
  SUMMARY+=("$name | $status | $((SECONDS - t0)) s of $budget s")
  note "## $name: $status after $((SECONDS - t0)) s"
}

COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
[ -n "$(git status --porcelain 2>/dev/null | head -1)" ] && COMMIT="$COMMIT+uncommitted"
note "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $COMMIT"

run device-info 10 bash -c '
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

MODEL="$WORK/llama-8b"
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
  SHAPE=(--tiny) BATCHES=1,4 KERNEL_ARGS=(--quick) HLO_ARGS=(--k 256 --n 512 --m 1,4 --iters 3)
  KERNEL_TESTS=(tests/test_kernels.py -k "page_block_tiles or block_sizes")
  SERVE_SHAPE=tiny NATIVE=0  # the kernel tests in the interpreter
  MOE_ARGS=(--smoke) MLA_ARGS=(--smoke) DEEPSEEK_MOE_ARGS=(--smoke --tokens 4)
  BLOCK_SHAPES=(256x512 512x256) BLOCK_ARGS=(--m 1,4 --iters 3)
else
  SHAPE=() BATCHES=1,64,256 KERNEL_ARGS=(--cases 9 --no-reference --tune) HLO_ARGS=(--k 4096 --n 14336 --m 1,64)
  KERNEL_TESTS=(tests/test_kernels.py tests/test_attention_variants.py
                -k "pallas or page_block or kernel_matches")
  SERVE_SHAPE=8b NATIVE=1
  MOE_ARGS=() MLA_ARGS=() DEEPSEEK_MOE_ARGS=(--hidden 7168 --intermediate 2048 --experts 256
                                             --tokens 16,64,256)
  BLOCK_SHAPES=(7168x2048 2048x7168) BLOCK_ARGS=(--m 1,16,64,1024 --iters 20)
fi

XLASERVE_KERNELS_NATIVE=$NATIVE run kernel-tests 45 "$PY" -m pytest -q -rfEs -p no:cacheprovider \
  "${KERNEL_TESTS[@]}"
grep -E "passed|failed|error|FAILED|ERROR|SKIPPED" "$LOGDIR/kernel-tests.log" | tail -15 \
  >> "$TABLE" || true

run bench-kernels 30 "$PY" scripts/bench_kernels.py "${KERNEL_ARGS[@]}" --max-seconds 24 \
  --out "$TABLE"

run mla-decode 30 "$PY" scripts/bench_mla_decode.py "${MLA_ARGS[@]}" --max-seconds 25 \
  --out "$TABLE"

DECODE=("$PY" scripts/bench_decode.py "${SHAPE[@]}" --default-sizing --prompt-len 128
        --max-model-len 1024 --compilation-cache-dir "$WORK/jax-cache" --out "$TABLE")
run engine-8b-cold 80 "${DECODE[@]}" --batch-sizes "$BATCHES" --output-len 64 \
  --max-seconds 68
run engine-8b-warm 35 "${DECODE[@]}" --batch-sizes "$BATCHES" --warmup-only
# The same decode with each step fetched before the next is scheduled: against
# engine-8b-cold's rows, what async scheduling takes off the path.
run engine-8b-sync 30 "${DECODE[@]}" --batch-sizes "$BATCHES" --output-len 32 \
  --max-seconds 22 --no-async-scheduling

# Tensor parallelism needs GPUs to split over; with one GPU nothing runs (not even a line).
NUM_GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU")
if [ "$NUM_GPUS" -gt 1 ]; then
  TP=8
  while [ "$TP" -gt "$NUM_GPUS" ]; do TP=$((TP / 2)); done  # 32 heads, 8 KV heads: 2, 4, 8
  for n in 1 "$TP"; do
    run "tensor-parallel-$n" 45 "$PY" scripts/bench_decode.py "${SHAPE[@]}" \
      --tensor-parallel-size "$n" --batch-sizes 1,64 --prompt-len 128 --output-len 32 \
      --max-model-len 1024 --max-seconds 40 --out "$TABLE"
  done
fi

run quant-hlo 20 "$PY" -m quant.hlo "${HLO_ARGS[@]}" --out "$TABLE"
run quant-hlo-blocks 40 bash -c '
  py="$1" table="$2" shapes="$3"; shift 3
  for s in $shapes; do
    "$py" -m quant.hlo --k "${s%x*}" --n "${s#*x}" --schemes "bf16,fp8 channel,fp8 block" \
      "$@" --out "$table" || exit $?
  done' _ "$PY" "$TABLE" "${BLOCK_SHAPES[*]}" "${BLOCK_ARGS[@]}"

run serve-8b 45 "$PY" scripts/serve_check.py --shape "$SERVE_SHAPE" --folder "$MODEL" \
  --out "$TABLE"

# The flagged run is a second process (XLA reads XLA_FLAGS once); if the flag makes XLA
# fail or crash, that is a result, written to the table, and the part's status is the
# first run's.
FUSION_FLAG=--xla_gpu_experimental_use_ragged_dot_fusion=true
# DeepSeek-V3's shape is a second process under its own timeout (its ragged_dot, densified,
# does 256x the work); its rows go to the table as they finish, its status joins the part's.
run moe-grouped 60 bash -c '
  py="$1" table="$2" flag="$3" n="$4"; shift 4
  qwen=("${@:1:$n}") deepseek=("${@:$((n + 1))}")
  "$py" scripts/gpu_moe_check.py "${qwen[@]}" --max-seconds 24 --out "$table"; rc=$?
  timeout --kill-after=2 20 "$py" scripts/gpu_moe_check.py "${deepseek[@]}" \
    --max-seconds 14 --label "DeepSeek-V3 experts" --out "$table" || {
    s=$?; echo "# DeepSeek-V3 experts: exit $s" | tee -a "$table"; [ "$rc" -ne 0 ] || rc=$s; }
  XLA_FLAGS="$flag" timeout --kill-after=2 12 "$py" scripts/gpu_moe_check.py "${qwen[@]}" \
    --tokens 16,1024 --methods ragged_dot --iters 5 --repeats 2 --label "XLA_FLAGS=$flag" \
    --out "$table" || echo "# XLA_FLAGS=$flag: exit $?" | tee -a "$table"
  exit $rc' _ "$PY" "$TABLE" "$FUSION_FLAG" "${#MOE_ARGS[@]}" "${MOE_ARGS[@]}" \
  "${DEEPSEEK_MOE_ARGS[@]}"

note ""
note "## summary: part | status | time of budget (pass ${SECONDS} s of ${PASS_SECONDS} s)"
for line in "${SUMMARY[@]}"; do note "$line"; done
echo
echo "================ $TABLE ================"
cat "$TABLE"
