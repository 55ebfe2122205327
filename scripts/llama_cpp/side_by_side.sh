#!/usr/bin/env bash
# fluxtide and llama.cpp on the same machine, the same weights, one `ft bench` call per kind
# (one record per server, and a side-by-side table of ratios).
# Usage: scripts/llama_cpp/side_by_side.sh CHECKPOINT MODEL.gguf LLAMA_SERVER OUTDIR
#   CHECKPOINT  the HF checkpoint fluxtide serves (the one MODEL.gguf was converted from)
#   FT_SERVE_ARGS  ft serve options (default: CUDA, 22 GiB budget, 16 running requests)
#   LLAMA_ARGS     llama-server options (default: all layers on the GPU, every expert in host memory,
#                  like ours; tune --n-cpu-moe / -ot so both use the same VRAM: OUTDIR/vram.csv)
#   KINDS          ft bench subcommands (default: ladder probe prefill; a KV sweep needs fluxtide's
#                  rebuild API, run it on fluxtide alone)   BENCH_ARGS  extra ft bench options
set -euo pipefail
ckpt=${1:?usage: side_by_side.sh CHECKPOINT MODEL.gguf LLAMA_SERVER OUTDIR}
gguf=${2:?MODEL.gguf}
llama=${3:?llama-server binary}
out=${4:?OUTDIR}
mkdir -p "$out"
FT_SERVE_ARGS=${FT_SERVE_ARGS:---device cuda --gpu-budget-gib 22 --max-running-requests 16}
LLAMA_ARGS=${LLAMA_ARGS:--ngl 999 --cpu-moe -c 65536 -np 16}
KINDS=${KINDS:-ladder probe prefill}
ft_url=http://127.0.0.1:19191
llama_url=http://127.0.0.1:19192

# shellcheck disable=SC2086  # the option strings are meant to split
python -m app serve --model "$ckpt" --port 19191 $FT_SERVE_ARGS > "$out/ft_serve.log" 2>&1 &
ft_pid=$!
# shellcheck disable=SC2086
"$llama" -m "$gguf" --host 127.0.0.1 --port 19192 --metrics $LLAMA_ARGS > "$out/llama_server.log" 2>&1 &
llama_pid=$!
trap 'kill "$ft_pid" "$llama_pid" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

wait_ok() {  # URL PID NAME: until /health answers 200, or the server has exited
    until python -c "import httpx,sys; sys.exit(httpx.get('$1/health', timeout=5).status_code != 200)" 2>/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "$3 exited; see $out" >&2; exit 1; }
        sleep 2
    done
}
wait_ok "$ft_url" "$ft_pid" "ft serve"
wait_ok "$llama_url" "$llama_pid" "llama-server"
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$out/vram.csv"
    echo "ft serve pid $ft_pid, llama-server pid $llama_pid" >> "$out/vram.csv"
fi
status=0
for kind in $KINDS; do
    # shellcheck disable=SC2086
    python -m app bench "$kind" --base-url "$ft_url" --base-url "$llama_url" --model-dir "$ckpt" \
        --out "$out/$kind.json" ${BENCH_ARGS:-} || status=$?
done
exit "$status"
