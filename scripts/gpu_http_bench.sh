#!/usr/bin/env bash
# The fast path measured through the HTTP API on a CUDA host (the customer's method, ft bench):
# 1. full-size Qwen3.6-35B-A3B block-FP8 (ft synth, random weights), every expert resident:
#    ft bench ladder c1..c16 (128-token outputs) with --max-running-requests 16;
# 2. the same checkpoint under --gpu-budget-gib 24 from 8k KV: ft bench sweep (live rebuild to 64k, bs 1 and 4).
# Records land in $OUT. PREFILL_KERNELS=triton serves with the Triton prefill (default: reference).
# Carry the serving wheels in .whl/ (the list is in gpu_env.sh; the first H200 attempt failed on the
# missing sniffio).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
CKPT=${CKPT:-/tmp/qwen36-fp8}
[ -f "$CKPT/config.json" ] || timeout 120 python3 -m app synth --out "$CKPT" --geometry ${GEOMETRY:-qwen3.6-35b-a3b} \
  --format fp8_block --device ${DEVICE:-cuda} 2>&1 | tail -2

serve() {  # serve PORT LOG ARGS... ; waits for /health ok (or gives up)
  local port=$1 log=$2; shift 2
  python3 -m app serve --model "$CKPT" --device ${DEVICE:-cuda} --executor ${EXECUTOR:-cuda-graph} \
    --prefill-kernels ${PREFILL_KERNELS:-reference} --port "$port" "$@" >"$log" 2>&1 &
  SERVER=$!
  wait_healthy "$port" "$SERVER" "$log" 150
}

SECONDS=0
if serve 8101 "$OUT/serve_resident.log" --gpu-budget-gib 130 --kv-tokens 64k --max-running-requests 16; then
  timeout 200 python3 -m app bench ladder --base-url http://127.0.0.1:8101 --model-dir "$CKPT" --quiet \
    --out "$OUT/ladder_resident.json" 2>&1 | tail -15
  kill $SERVER; wait $SERVER 2>/dev/null
fi
if serve 8102 "$OUT/serve_24gib.log" --gpu-budget-gib 24 --kv-tokens 8k --max-running-requests 4; then
  timeout 200 python3 -m app bench sweep --base-url http://127.0.0.1:8102 --model-dir "$CKPT" --quiet \
    --kv 8k,64k --batch 1,4 --out "$OUT/sweep_24gib.json" 2>&1 | tail -15
  kill $SERVER; wait $SERVER 2>/dev/null
fi
grep -h -E "captured|Error|error" "$OUT"/serve_*.log | head -10 || true  # none on a clean reference run
