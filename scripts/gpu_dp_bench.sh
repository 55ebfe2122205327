#!/usr/bin/env bash
# Data-parallel serving measured through the HTTP API on a 2-GPU host (issue 15 target: c16 aggregate
# with --data-parallel 2 >= 1.8x one GPU). Full-size Qwen3.6-35B-A3B block-FP8 (ft synth, random
# weights, every expert resident on an H200), ft bench ladder c1..c16 (128-token outputs):
# 1. one GPU: ft serve --max-running-requests 16;
# 2. both GPUs: ft serve --data-parallel 2 --max-running-requests 16 (16 per worker; the front sends each
#    request to the least-loaded worker). The records, the servers' logs and a summary land in $OUT.
# Host RAM: each worker loads its own copy of the checkpoint (~35 GB each here).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
CKPT=${CKPT:-/tmp/qwen36-fp8}
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.csv" 2>&1
[ -f "$CKPT/config.json" ] || timeout 180 python3 -m app synth --geometry ${GEOMETRY:-qwen3.6-35b-a3b} \
  --format fp8_block --device cuda --out "$CKPT" 2>&1 | tail -2

serve() {  # serve PORT LOG ARGS... ; waits for /health 200 (every worker ready) or gives up
  local port=$1 log=$2; shift 2
  python3 -m app serve --model "$CKPT" --device cuda --executor ${EXECUTOR:-cuda-graph} --port "$port" \
    --gpu-budget-gib 130 --kv-tokens 64k --max-running-requests 16 "$@" >"$log" 2>&1 &
  SERVER=$!
  wait_healthy "$port" "$SERVER" "$log" 120
}

ladder() {  # ladder PORT NAME
  timeout 240 python3 -m app bench ladder --base-url "http://127.0.0.1:$1" --model-dir "$CKPT" --quiet \
    --levels ${LEVELS:-1,4,16} --out "$OUT/ladder_$2.json" 2>&1 | tail -8
  python3 -c "import httpx,json; print(json.dumps(httpx.get('http://127.0.0.1:$1/v1/stats').json(), indent=1))" \
    > "$OUT/stats_$2.json" 2>&1
}

SECONDS=0
if CUDA_VISIBLE_DEVICES=0 serve 8201 "$OUT/serve_one_gpu.log"; then
  ladder 8201 one_gpu; kill $SERVER; wait $SERVER 2>/dev/null
fi
if serve 8202 "$OUT/serve_dp2.log" --data-parallel 2; then
  ladder 8202 dp2
  python3 -c "import httpx,json; print(json.dumps(httpx.get('http://127.0.0.1:8202/health').json(), indent=1))" > "$OUT/health_dp2.json"
  kill $SERVER; wait $SERVER 2>/dev/null
fi
# summary: aggregate output tok/s per rung and the speed-up (the record's rungs; printed and kept)
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def rungs(name):
    p = out / f"ladder_{name}.json"
    if not p.exists():
        return {}
    data = json.loads(p.read_text())
    rows = data.get("results") or data.get("rungs") or data.get("points") or []
    return {r.get("concurrency"): r for r in rows if isinstance(r, dict)}
one, dp = rungs("one_gpu"), rungs("dp2")
for c in sorted(set(one) | set(dp), key=lambda c: c or 0):
    a = (one.get(c) or {}).get("aggregate_tok_s"); b = (dp.get(c) or {}).get("aggregate_tok_s")
    ratio = f"{b / a:.2f}x" if a and b else "n/a"
    print(f"c{c}: one GPU {a} tok/s, --data-parallel 2 {b} tok/s, speed-up {ratio}")
PY
grep -h -E "Error|error|exited" "$OUT"/serve_*.log | head -10 || true
