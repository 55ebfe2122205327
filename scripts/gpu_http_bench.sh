#!/usr/bin/env bash
# The fast path measured through the HTTP API on a CUDA host (the customer's method, ft bench):
# 1. full-size Qwen3.6-35B-A3B block-FP8 (ft synth, random weights), every expert resident:
#    ft bench ladder c1..c16 (128-token outputs) with --max-running-requests 16;
# 2. the same checkpoint under --gpu-budget-gib 24 from 8k KV: ft bench sweep (live rebuild to 64k, bs 1, 3, 4, 6).
# Records land in $OUT. PREFILL_KERNELS=triton|reference overrides ft serve's default (auto, ADR 0020);
# PREFILL_GRAPHS=on|off its --prefill-graphs (auto: on with the Triton prefill; off: the eager control run).
# Carry the serving wheels in .whl/ (the list is in gpu_env.sh; the first H200 attempt failed on the
# missing sniffio).
# Run with `resident` or `budget` it does only that half (the resident half also runs ft bench probe 127 / 255).
# Sourced (not run), it only defines the pieces below: scripts/gpu_llamacpp_side_by_side.sh measures
# llama.cpp with the same server shapes and the same ft bench arguments.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
CKPT=${CKPT:-/tmp/qwen36-fp8}
# the two server shapes and the ft bench arguments of each measurement
RESIDENT_BUDGET_GIB=${RESIDENT_BUDGET_GIB:-130}
RESIDENT_KV=${RESIDENT_KV:-64k}
RESIDENT_RUNNING=${RESIDENT_RUNNING:-16}
BUDGET_GIB=${BUDGET_GIB:-24}
BUDGET_RUNNING=${BUDGET_RUNNING:-6}
SWEEP_KV=${SWEEP_KV:-8k,64k}             # the budget server starts at the first size (the customer's "restart at 8k")
SWEEP_ARGS=${SWEEP_ARGS:---batch 1,3,4,6}  # bs3 and bs6: held-out points of the simulator
LADDER_ARGS=${LADDER_ARGS:-}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}      # seconds per ft bench run
READY_TRIES=${READY_TRIES:-150}          # /health polls, 2 s apart

synth_ckpt() {  # the checkpoint both engines serve (ft synth writes config.json last: its presence = complete)
  [ -f "$CKPT/config.json" ] || timeout 120 python3 -m app synth --out "$CKPT" --geometry ${GEOMETRY:-qwen3.6-35b-a3b} \
    --format fp8_block --device ${DEVICE:-cuda} 2>&1 | tail -2
  # NOTE: bench_decode.py and bench_prefill.py write the same directory without a tokenizer (they never
  # serve it); a server needs one, so a checkpoint they left gets the tokenizer files added here
  [ -f "$CKPT/tokenizer.json" ] || python3 -c "import pathlib, sys
from adapters.checkpoint.hf_tokenizer import write_tokenizer_files
write_tokenizer_files(pathlib.Path(sys.argv[1]))" "$CKPT"
}

serve_flags() {  # the ft serve options every fluxtide start shares (a word list: no value holds a space)
  echo "--model $CKPT --device ${DEVICE:-cuda} --executor ${EXECUTOR:-cuda-graph} --prefill-kernels ${PREFILL_KERNELS:-auto} --prefill-graphs ${PREFILL_GRAPHS:-auto} ${EXTRA_SERVE_ARGS:-}"
}

serve() {  # serve PORT LOG ARGS... ; sets SERVER, waits for /health ok (or gives up)
  local port=$1 log=$2; shift 2
  # shellcheck disable=SC2046  # serve_flags is a list of options
  python3 -m app serve $(serve_flags) --port "$port" "$@" >"$log" 2>&1 &
  SERVER=$!
  wait_healthy "$port" "$SERVER" "$log" "$READY_TRIES"
}

resident_serve_args() { echo "--gpu-budget-gib $RESIDENT_BUDGET_GIB --kv-tokens $RESIDENT_KV --max-running-requests $RESIDENT_RUNNING"; }
budget_serve_args() { echo "--gpu-budget-gib $BUDGET_GIB --kv-tokens ${SWEEP_KV%%,*} --max-running-requests $BUDGET_RUNNING"; }

bench_ladder() {  # bench_ladder BASE_URL OUT.json: the resident measurement's ft bench call
  # shellcheck disable=SC2086
  timeout "$BENCH_TIMEOUT" python3 -m app bench ladder --base-url "$1" --model-dir "$CKPT" --quiet \
    --out "$2" $LADDER_ARGS 2>&1 | tail -15
}

bench_sweep() {  # bench_sweep BASE_URL OUT.json KV: the budget measurement's ft bench call (KV: sizes or current)
  # shellcheck disable=SC2086
  timeout "$BENCH_TIMEOUT" python3 -m app bench sweep --base-url "$1" --model-dir "$CKPT" --quiet \
    --kv "$3" --out "$2" $SWEEP_ARGS 2>&1 | tail -15
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  part=${1:-both}  # resident | budget | both (default)
  synth_ckpt
  SECONDS=0
  # shellcheck disable=SC2046
  if [[ $part != budget ]] && serve 8101 "$OUT/serve_resident.log" $(resident_serve_args); then
    bench_ladder http://127.0.0.1:8101 "$OUT/ladder_resident.json"
    # the warmed single streams of issue 8's bs1 target, in the same server
    timeout "$BENCH_TIMEOUT" python3 -m app bench probe --base-url http://127.0.0.1:8101 --model-dir "$CKPT" \
      --quiet --lengths 127,255 --out "$OUT/probe_resident.json" 2>&1 | tail -3
    kill $SERVER; wait $SERVER 2>/dev/null
  fi
  # shellcheck disable=SC2046
  if [[ $part != resident ]] && serve 8102 "$OUT/serve_24gib.log" $(budget_serve_args); then
    bench_sweep http://127.0.0.1:8102 "$OUT/sweep_24gib.json" "$SWEEP_KV"
    kill $SERVER; wait $SERVER 2>/dev/null
  fi
  grep -h -E "captured|Error|error" "$OUT"/serve_*.log | head -10 || true  # none on a clean reference run
fi
