#!/usr/bin/env bash
# Expert-parallel serving measured through the HTTP API on a 2- or 4-GPU host, on the fast path (issue 15
# targets, bs1 at 24 GiB per GPU: --expert-parallel 2 >= 1.6x one GPU, 4 >= 2.5x). `ft synth` checkpoint
# (random weights, so routing is near uniform: compare with the simulator's `--routing uniform` line),
# ft bench ladder c1:
# 1. one GPU: ft serve --executor cuda-graph --gpu-budget-gib 24;
# 2. all N GPUs: ft serve --expert-parallel N --executor cuda-graph --gpu-budget-gib 24 (each rank 24 GiB: the
#    dense weights, the KV and state pools, and its share of the expert slots; each rank loads only its own
#    experts into pinned host RAM; rank 0 serves HTTP, the others follow; the MoE all-reduces run over NCCL
#    inside the captured decode graphs);
# 3. the same greedy prompts on both servers: the answers must be identical (correctness on GPUs + NCCL);
# 4. the simulator's prediction for the same points (python -m simulator expert-parallel), for the ADR;
# 5. record.json: the targets table's row (scenario, geometry, both tok/s, speed-up, target, met, answers
#    identical) with the GPUs, their topology and the prediction beside it.
# Env: N (ranks, default: every visible GPU, at most 4), GEOMETRY (qwen3.6-35b-a3b | synthetic-moe-155b),
# CKPT, EXECUTOR (cuda-graph; reference for the reference path), CAP_GIB (24), TOKENS (128).
# One geometry per run (each fits one 10-minute device call once its checkpoint exists):
#   GEOMETRY=qwen3.6-35b-a3b N=2 bash scripts/gpu_ep_bench.sh       # nvidia-h200-x2 (~35 GB disk, ~35 GB RAM)
#   GEOMETRY=synthetic-moe-155b N=2 bash scripts/gpu_ep_bench.sh    # nvidia-h200-x4: ~155 GB of disk (the x2
#     has 128 GiB) and the one-GPU server's whole bank pinned (155 GB of host RAM; the EP ranks ~78 GB each)
# The synth of the large geometry takes longer than one device call: run it first on its own
# (SYNTH_ONLY=1), then the benchmark.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
GEOMETRY=${GEOMETRY:-qwen3.6-35b-a3b}
CKPT=${CKPT:-/tmp/$GEOMETRY-fp8}
CAP_GIB=${CAP_GIB:-24}
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
N=${N:-$(( GPUS < 4 ? GPUS : 4 ))}
EXECUTOR=${EXECUTOR:-cuda-graph}
EXTRA=()
# NOTE: the fast path gathers misses from a pinned bank, so no --mmap-experts there; the reference path keeps
# the large geometry memory-mapped (one page-cached copy)
[ "$GEOMETRY" = synthetic-moe-155b ] && [ "$EXECUTOR" = reference ] && EXTRA+=(--mmap-experts)
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.csv" 2>&1
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1  # NVLink or PCIe between the GPUs: the exchange's cost
[ -f "$CKPT/config.json" ] || timeout 590 python3 -m app synth --geometry "$GEOMETRY" --format fp8_block \
  --device cuda --out "$CKPT" 2>&1 | tail -2
[ -n "${SYNTH_ONLY:-}" ] && { ls -la "$CKPT" | head; exit 0; }

python3 -m simulator expert-parallel --model "${GEOMETRY/qwen3.6-35b-a3b/qwen3.6-35b-a3b-fp8}" \
  --ranks "1,$N" --gpu-cap-gib "$CAP_GIB" --routing uniform --json > "$OUT/predicted.json" 2>&1
python3 -m simulator expert-parallel --model "${GEOMETRY/qwen3.6-35b-a3b/qwen3.6-35b-a3b-fp8}" \
  --ranks "1,$N" --gpu-cap-gib "$CAP_GIB" --routing uniform 2>&1 | tee "$OUT/predicted.txt"

serve() {  # serve PORT LOG ARGS... ; waits for /health 200 or gives up
  local port=$1 log=$2; shift 2
  python3 -m app serve --model "$CKPT" --device cuda --executor "$EXECUTOR" --port "$port" \
    --gpu-budget-gib "$CAP_GIB" --max-running-requests 1 --kv-tokens 16k "${EXTRA[@]}" "$@" >"$log" 2>&1 &
  SERVER=$!
  wait_healthy "$port" "$SERVER" "$log" 300
}

measure() {  # measure PORT NAME: greedy answers (the correctness check), then the bs1 ladder and stats
  python3 - "$1" "$OUT/answers_$2.json" <<'PY' 2>&1 | tail -2
import httpx, json, sys
url, out = f"http://127.0.0.1:{sys.argv[1]}", sys.argv[2]
prompts = ["Count from 1 to 20.", "Name three rivers.", "What is 17 * 3?", "Write a haiku about GPUs."]
answers = []
for p in prompts:
    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={"messages": [{"role": "user", "content": p}],
                   "max_tokens": 48, "temperature": 0})
    answers.append(r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}")
json.dump(answers, open(out, "w"), indent=1)
print(f"{len(answers)} greedy answers kept")
PY
  timeout 590 python3 -m app bench ladder --base-url "http://127.0.0.1:$1" --model-dir "$CKPT" --quiet \
    --levels 1 --tokens ${TOKENS:-128} --out "$OUT/ladder_$2.json" 2>&1 | tail -6
  for path in stats health; do
    python3 -c "import httpx,json; print(json.dumps(httpx.get('http://127.0.0.1:$1/${path/stats/v1/stats}').json(), indent=1))" \
      > "$OUT/${path}_$2.json" 2>&1
  done
}

SECONDS=0
if CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} serve 8301 "$OUT/serve_one_gpu.log"; then
  measure 8301 one_gpu; kill $SERVER; wait $SERVER 2>/dev/null
fi
if serve 8302 "$OUT/serve_ep$N.log" --expert-parallel "$N"; then
  measure 8302 "ep$N"; kill $SERVER; wait $SERVER 2>/dev/null
fi
python3 - "$OUT" "$N" "$GEOMETRY" "$EXECUTOR" "$CAP_GIB" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, sys, pathlib
out, n, geometry, executor, cap = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
def tok_s(name):
    p = out / f"ladder_{name}.json"
    if not p.exists():
        return None
    data = json.loads(p.read_text())
    rows = data.get("results") or data.get("rungs") or data.get("points") or []
    return next((r.get("aggregate_tok_s") for r in rows if isinstance(r, dict) and r.get("concurrency") == 1), None)
def answers(name):
    p = out / f"answers_{name}.json"
    return json.loads(p.read_text()) if p.exists() else None
def text(name):
    p = out / name
    return p.read_text() if p.exists() else None
one, ep = tok_s("one_gpu"), tok_s(f"ep{n}")
speedup = round(ep / one, 3) if one and ep else None
target = {2: 1.6, 4: 2.5}.get(n)
a, b = answers("one_gpu"), answers(f"ep{n}")
same = a is not None and a == b
print(f"{geometry} ({executor}), bs1 at {cap} GiB per GPU: one GPU {one} tok/s, --expert-parallel {n} {ep} tok/s, "
      f"speed-up {speedup}x (target {target}x)")
print("greedy answers identical:", same)
try:
    pred = json.loads((out / "predicted.json").read_text())
    print("predicted (simulator, uniform routing):", [(r["ranks"], round(r["decode_tok_s"], 1), r["speedup"]) for r in pred])
except (OSError, ValueError, KeyError) as exc:
    pred = None
    print("no prediction:", exc)
record = {"scenario": f"expert-parallel, {n} GPUs, each capped at {cap} GiB, bs1", "geometry": geometry,
          "executor": executor, "gpu_cap_gib": float(cap), "ranks": n, "one_gpu_tok_s": one, "ep_tok_s": ep,
          "speedup": speedup, "target_speedup": target, "met": speedup is not None and target is not None
          and speedup >= target, "greedy_answers_identical": same, "predicted": pred,
          "gpus": text("gpus.csv"), "topology": text("topology.txt")}
(out / "record.json").write_text(json.dumps(record, indent=1))
PY
grep -h -E "Error|error|exited" "$OUT"/serve_*.log | head -10 || true
