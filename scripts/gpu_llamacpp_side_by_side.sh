#!/usr/bin/env bash
# fluxtide and llama.cpp (the customer's previous engine) on the same H200, the same weights and the same
# ft bench runs (docs/benchmarks.md, "Side by side with llama.cpp"). Phases, by name, each sized for one
# <= 10-minute device call on a warm machine (files in /tmp and /dev/shm live only while it stays warm):
#   build   in parallel: (a) llama-server for sm_90 from .llamacpp/llama.cpp.tar.gz (scripts/pack_llamacpp.sh)
#           into $LLAMA_BUILD, -j$JOBS; (b) ft synth of the full geometry ($CKPT, kept if there) and llama.cpp's
#           converter -> Q8_0 GGUF in /dev/shm. Each step is skipped when its output exists; both run detached
#           (setsid), so a call cut at its time limit loses nothing: `build` again waits for them.
#   llama   llama-server under the fluxtide budget (experts of the first --n-cpu-moe layers in host memory,
#           planned from the GGUF to fit $BUDGET_GIB GiB like `ft serve --gpu-budget-gib`), one start per KV
#           size of the sweep: `ft bench sweep --kv current`; then everything on the GPU: `ft bench ladder`
#           (LADDER=off: the sweeps only, the ladder left to `extras`).
#   ours    fluxtide the same way, with scripts/gpu_http_bench.sh's pieces (resident ladder, 24 GiB sweep;
#           LADDER=off: the sweep only).
#   report  the engines' records from every run in $WORK, then the side-by-side tables (ratio to llama.cpp)
#           -> $OUT/side_by_side.json
#   coldstart  fluxtide only: `ft bench cold-start` of the resident server (its start-up milestones)
#   extras  both resident servers up at once (~38 + ~42 GiB), then `ft bench probe` and `ft bench prefill`
#           against both in one call each (one record per server and a side-by-side table); with
#           EXTRAS_LADDER=on, then `ft bench ladder` of each server in turn (the other one idle beside it),
#           recorded as the engines' resident runs, so one pair of starts serves all three
#   bench   = llama ours report.   No phase: build bench.
# Each engine's phase writes $OUT/<engine>.json: its runs (server command, planned and measured VRAM,
# readiness time, the ft bench record); logs go to $OUT/logs_<phase>.tar.gz. Milestones print with times.
# Every measured start first waits (at most QUIET_WAIT_S, 240 s) until the page cache's dirty and writeback
# pages are under QUIET_DIRTY_MIB (512) and the CPUs under QUIET_CPU_PCT (20 %) busy, and each run's record keeps
# host_at_start / host_after: llama.cpp computes host-resident experts on every core, so a host still writing
# back the synthesized checkpoint slows it (2026-12-04: 30-45 % below 2026-12-02's same plan).
# --dry-run: the same steps on a CPU machine, tiny geometry, CPU build, tiny token counts (no GPU figures).
# Usage on the H200 (carry .llamacpp and .whl): scripts/gpu_llamacpp_side_by_side.sh build; ... bench
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DRY=0
phases=()
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    build|llama|ours|report|bench|coldstart|extras) phases+=("$arg") ;;
    *) echo "unknown phase $arg (build llama ours report bench coldstart extras, --dry-run)"; exit 2 ;;
  esac
done
[ ${#phases[@]} -gt 0 ] || phases=(build bench)
if [ $DRY = 1 ]; then  # a CPU machine: tiny everything; every default below can still be overridden
  : "${GEOMETRY:=tiny}" "${DEVICE:=cpu}" "${EXECUTOR:=reference}" "${CUDA:=OFF}" "${JOBS:=2}"
  : "${CKPT:=/tmp/sbs-dry/ckpt}" "${GGUF:=/tmp/sbs-dry/model-q8_0.gguf}" "${WORK:=/tmp/sbs-dry/work}"
  : "${LLAMA_SRC:=/tmp/sbs-dry/llama-src}" "${LLAMA_BUILD:=/tmp/sbs-dry/llama-build}"
  : "${RESIDENT_KV:=2k}" "${SWEEP_KV:=1k,2k}" "${BUDGET_GIB:=24}" "${LLAMA_MARGIN_GIB:=0}"
  # the tiny model's trunk is ~43 MB on a "GPU": a 0.041 GiB budget leaves room for some expert layers only,
  # so the --n-cpu-moe plan is exercised (a CPU build accepts the option and keeps everything in host memory)
  : "${LLAMA_BUDGET_GIB:=0.041}"
  : "${LADDER_ARGS:=--levels 1,2 --tokens 8 --warmup-tokens 4 --no-bandwidth}"
  : "${SWEEP_ARGS:=--batch 1,2 --tokens 8 --warmup-tokens 4 --warmup 1 --iterations 1 --no-bandwidth}"
  : "${BENCH_TIMEOUT:=300}" "${READY_TRIES:=120}" "${OUT:=/tmp/sbs-dry/out}"
  # a CPU decodes the tiny model at ~20 tok/s: the H200's probe lengths (127/255/1,023 x 3) outlast the timeout
  : "${PROBE_ARGS:=--lengths 15,31 --repeats 1 --warmup-tokens 4}" "${PREFILL_ARGS:=--sizes 256,1024 --repeats 1}"
  [ -x /tmp/llamacpp-conv-venv/bin/python ] && : "${CONVERT_PYTHON:=/tmp/llamacpp-conv-venv/bin/python}"
  export GEOMETRY DEVICE EXECUTOR CUDA CKPT RESIDENT_KV SWEEP_KV BUDGET_GIB LADDER_ARGS SWEEP_ARGS BENCH_TIMEOUT READY_TRIES OUT
  export CONVERT_PYTHON
fi
export CKPT=${CKPT:-/tmp/qwen36-fp8}
# NOTE: fluxtide runs ft serve's default prefill (auto: the Triton prefill for this block-FP8 checkpoint on CUDA,
# ADR 0020); the 2026-12-02 run had served the reference one (1.6 s TTFT of a 20-token prompt)
# shellcheck source=scripts/gpu_http_bench.sh
. "$HERE/gpu_http_bench.sh"  # gpu_env.sh ($OUT, wheels, wait_healthy) + the server shapes and ft bench calls
TARBALL=${TARBALL:-.llamacpp/llama.cpp.tar.gz}
LLAMA_SRC=${LLAMA_SRC:-/tmp/llama-src}           # the unpacked tree: the converter runs from it
LLAMA_BUILD=${LLAMA_BUILD:-/tmp/llama-build}     # -> $LLAMA_BUILD/bin/llama-server
LLAMA_SERVER=$LLAMA_BUILD/bin/llama-server
GGUF=${GGUF:-/dev/shm/qwen36-q8_0.gguf}
WORK=${WORK:-/tmp/sbs}                           # records and logs kept between the calls of a warm machine
JOBS=${JOBS:-14}
BUILD_WAIT=${BUILD_WAIT:-560}                    # seconds `build` waits for its detached jobs
LLAMA_BUDGET_GIB=${LLAMA_BUDGET_GIB:-$BUDGET_GIB}
LLAMA_MARGIN_GIB=${LLAMA_MARGIN_GIB:-1.5}        # CUDA context + compute buffers, outside the planned tensors
LLAMA_ARGS=${LLAMA_ARGS:-}                       # extra llama-server options for every start
DEADLINE=${DEADLINE:-570}                        # seconds into the call after which no new server starts
mkdir -p "$WORK/logs" "$OUT"
T0=$(date +%s)
mark() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
late() { [ $(( $(date +%s) - T0 )) -gt "$DEADLINE" ] && { mark "skipping $1: past the ${DEADLINE}s deadline"; return 0; }; return 1; }
count() { python3 -c "from app.units import parse_count; print(parse_count('$1'))"; }
host_state() {  # JSON: dirty + writeback page cache (MiB), CPU busy % over 1 s, 1-minute load, from /proc
  python3 - <<'PY'
import json, time
def cpu():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v), v[3] + v[4]  # all, idle + iowait
m = {}
for line in open("/proc/meminfo"):
    k, v = line.split(":", 1)
    m[k] = int(v.split()[0]) / 1024
(t0, i0), _ = cpu(), time.sleep(1)
t1, i1 = cpu()
print(json.dumps({"dirty_mib": round(m.get("Dirty", 0)), "writeback_mib": round(m.get("Writeback", 0)),
                  "cpu_busy_pct": round(100 * (1 - (i1 - i0) / max(1, t1 - t0)), 1),
                  "loadavg_1m": float(open("/proc/loadavg").read().split()[0])}))
PY
}
host_quiet() {  # host_quiet NAME: wait up to $QUIET_WAIT_S s for a quiet host before a measured start; sets HOST_STATE
  # NOTE: on 2026-12-04 llama.cpp's CPU-expert sweeps ran minutes after ft synth had written 35 GB and the
  # converter 38 GB, and decoded 30-45 % below the same plan on 2026-12-02: its 16 threads share the cores
  # with whatever the kernel still flushes. Measured starts now wait for the page cache to be written back
  # and the CPUs to be idle (busy over the last second, not the load average, which lags a minute behind)
  local waited=0
  HOST_STATE=$(host_state)
  while [ "$waited" -lt "${QUIET_WAIT_S:-240}" ] && ! python3 -c "import json,sys; h=json.loads(sys.argv[1])
sys.exit(h['dirty_mib'] + h['writeback_mib'] > ${QUIET_DIRTY_MIB:-512} or h['cpu_busy_pct'] > ${QUIET_CPU_PCT:-20})" "$HOST_STATE"; do
    [ $(( waited % 30 )) = 0 ] && mark "$1: waiting for a quiet host: $HOST_STATE"
    sleep 4; waited=$(( waited + 5 )); HOST_STATE=$(host_state)
  done
  mark "$1: host $HOST_STATE after ${waited}s"
}
gpu_mib() {  # MiB in use on GPU 0 (one server runs at a time), null without nvidia-smi
  local v; v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' ')
  echo "${v:-null}"
}

# ---- build ----------------------------------------------------------------------------------------------
detached() {  # detached NAME DONE_TEST COMMAND: run COMMAND under setsid unless DONE_TEST passes or it runs
  local name=$1 done_test=$2 cmd=$3 pidf="$WORK/$1.pid"
  if eval "$done_test"; then mark "$name: already done"; return; fi
  if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then mark "$name: still running, waiting"; return; fi
  rm -f "$WORK/$name.rc"
  setsid nohup bash -c "$cmd; echo \$? > '$WORK/$name.rc'" > "$WORK/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$pidf"
  mark "$name: started (log $WORK/logs/$name.log)"
}

job_state() {  # job_state NAME DONE_TEST: running | done | failed (rc N)
  local pidf="$WORK/$1.pid" rc
  if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then echo running; return; fi
  rc=$(cat "$WORK/$1.rc" 2>/dev/null)
  if [ -n "$rc" ] && [ "$rc" != 0 ]; then echo "failed (rc $rc)"; elif eval "$2"; then echo done; else echo "failed"; fi
}

phase_build() {
  # CMake finds the toolkit through nvcc; the image may leave it off PATH
  command -v nvcc > /dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && export PATH=$PATH:/usr/local/cuda/bin; }
  mark "nvcc: $(command -v nvcc || echo none) $(nvcc --version 2>/dev/null | tail -1)"
  mark "cmake: $(cmake --version 2>/dev/null | head -1); ninja: $(ninja --version 2>/dev/null || echo none); $(nproc) cores"
  [ -f "$TARBALL" ] || { echo "no $TARBALL: run scripts/pack_llamacpp.sh here and carry .llamacpp"; return 1; }
  mkdir -p "$LLAMA_SRC"
  [ -f "$LLAMA_SRC/llama.cpp/CMakeLists.txt" ] || tar xzf "$TARBALL" -C "$LLAMA_SRC"
  mark "source: $(cat "$LLAMA_SRC/llama.cpp/PACKED_FROM" 2>/dev/null)"
  detached llama_build "[ -x '$LLAMA_SERVER' ]" \
    "BUILD_DIR='$LLAMA_BUILD' CUDA=${CUDA:-ON} '$HERE/llama_cpp/build.sh' '$TARBALL' '$LLAMA_SRC' $JOBS"
  # NOTE: the converter writes $GGUF.part and renames it at the end: a present $GGUF is complete
  detached convert "[ -f '$GGUF' ]" \
    "set -e; synth_start=\$(date +%s); $(declare -f synth_ckpt); CKPT='$CKPT' GEOMETRY=${GEOMETRY:-qwen3.6-35b-a3b} DEVICE=${DEVICE:-cuda} synth_ckpt;
     echo \"synth done after \$(( \$(date +%s) - synth_start ))s\"; mkdir -p '$(dirname "$GGUF")';
     '$HERE/llama_cpp/convert.sh' '$LLAMA_SRC/llama.cpp' '$CKPT' '$GGUF.part' q8_0 && mv '$GGUF.part' '$GGUF';
     echo \"convert done after \$(( \$(date +%s) - synth_start ))s\";
     PYTHONPATH='$LLAMA_SRC/llama.cpp/gguf-py' python3 '$HERE/llama_cpp/sbs.py' layout '$GGUF'"
  local waited=0 b c
  while [ $waited -lt "$BUILD_WAIT" ]; do
    b=$(job_state llama_build "[ -x '$LLAMA_SERVER' ]")
    c=$(job_state convert "[ -f '$GGUF' ]")
    [ "$b" != running ] && [ "$c" != running ] && break
    if [ $(( waited % 30 )) = 0 ]; then
      mark "build: $b $(grep -o '^\[[0-9]*/[0-9]*\]' "$WORK/logs/llama_build.log" 2>/dev/null | tail -1); convert: $c" \
        "$(ls -la "$GGUF.part" 2>/dev/null | awk '{printf "%.1f GB written", $5/1e9}')"
    fi
    sleep 5; waited=$(( waited + 5 ))
  done
  mark "llama-server: $([ -x "$LLAMA_SERVER" ] && echo ready || echo "NOT ready ($b)"); GGUF: $([ -f "$GGUF" ] && du -h "$GGUF" | cut -f1 || echo "NOT ready ($c)")"
  grep -h -E "synth done|convert done|no mtp|Model successfully|error|Error" "$WORK/logs/convert.log" 2>/dev/null | tail -5
  [ -x "$LLAMA_SERVER" ] || tail -5 "$WORK/logs/llama_build.log"
  [ -x "$LLAMA_SERVER" ] && [ -f "$GGUF" ]
}

# ---- one measured run: start a server, bench it, keep what it used ---------------------------------------
run_meta() {  # run_meta FILE ENGINE ROLE NAME KV RECORD READY_S VRAM_IDLE VRAM_READY VRAM_AFTER PLAN_JSON CMD...
  # (HOST_STATE, from host_quiet before the start, and the host's state now go in as host_at_start / host_after)
  local file=$1; shift
  HOST_AT_START=${HOST_STATE:-} HOST_AFTER=$(host_state) python3 - "$@" > "$file" <<'PY'
import json, os, sys
engine, role, name, kv, record, ready, idle, ready_v, after, plan, *cmd = sys.argv[1:]
num = lambda s: None if s in ("", "null") else float(s)
host = lambda k: json.loads(os.environ[k]) if os.environ.get(k) else None
print(json.dumps({"engine": engine, "role": role, "name": name, "kv_tokens": num(kv), "record_path": record,
                  "ready_s": num(ready),
                  "vram_mib": {"idle_before": num(idle), "ready": num(ready_v), "after_bench": num(after)},
                  "host_at_start": host("HOST_AT_START"), "host_after": host("HOST_AFTER"),
                  "plan": json.loads(plan) if plan else None, "server_command": cmd}))
PY
}

llama_cmd() {  # llama_cmd PORT CTX PARALLEL: sets LLAMA_CMD, the server command every llama.cpp start shares
  LLAMA_CMD=("$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$1" --alias qwen36-q8_0 --metrics
             -ngl 999 -c "$2" -np "$3" --kv-unified --fit off)
}

llama_run() {  # llama_run ROLE NAME PORT CTX PARALLEL CPU_MOE|gpu KIND KVARG: one llama-server start, one ft bench
  local role=$1 name=$2 port=$3 ctx=$4 np=$5 moe=$6 kind=$7 kvarg=${8:-} plan="" idle ready_v after t
  late "llama.cpp $name" && return 1
  llama_cmd "$port" "$ctx" "$np"
  local cmd=("${LLAMA_CMD[@]}")
  if [ "$moe" != gpu ]; then
    plan=$(PYTHONPATH="$LLAMA_SRC/llama.cpp/gguf-py" python3 "$HERE/llama_cpp/sbs.py" plan "$GGUF" \
      --budget-gib "$LLAMA_BUDGET_GIB" --ctx "$ctx" --parallel "$np" --margin-gib "$LLAMA_MARGIN_GIB")
    local n; n=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['n_cpu_moe'])" "$plan") || return 1
    cmd+=(--n-cpu-moe "$n")
    mark "llama.cpp $name: plan $plan"
  fi
  # shellcheck disable=SC2206  # LLAMA_ARGS is a list of options
  cmd+=($LLAMA_ARGS)
  host_quiet "llama.cpp $name"
  idle=$(gpu_mib); t=$(date +%s)
  "${cmd[@]}" > "$WORK/logs/llama_$name.log" 2>&1 &
  SERVER=$!
  mark "llama.cpp $name: ${cmd[*]}"
  if wait_healthy "$port" "$SERVER" "$WORK/logs/llama_$name.log" "$READY_TRIES"; then
    ready_v=$(gpu_mib); mark "llama.cpp $name ready after $(( $(date +%s) - t ))s, GPU ${ready_v} MiB (idle ${idle})"
    if [ "$kind" = ladder ]; then bench_ladder "http://127.0.0.1:$port" "$WORK/llamacpp_$name.json"
    else bench_sweep "http://127.0.0.1:$port" "$WORK/llamacpp_$name.json" "$kvarg"; fi
    after=$(gpu_mib); mark "llama.cpp $name measured, GPU ${after} MiB"
  fi
  run_meta "$WORK/run_llamacpp_$name.json" llama.cpp "$role" "$name" "$ctx" "$WORK/llamacpp_$name.json" \
    "$(( $(date +%s) - t ))" "$idle" "${ready_v:-}" "${after:-}" "$plan" "${cmd[@]}"
  kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null
}

phase_llama() {
  [ -x "$LLAMA_SERVER" ] && [ -f "$GGUF" ] || { echo "llama: run the build phase first"; return 1; }
  mark "llama-server: $("$LLAMA_SERVER" --version 2>&1 | grep -i -E "version|built" | tr '\n' ' ')"
  local kv runs=()
  for kv in ${SWEEP_KV//,/ }; do  # the sweep's KV sizes: one start each, the budget re-planned for it
    llama_run sweep "budget-$kv" 8201 "$(count "$kv")" "$BUDGET_RUNNING" plan sweep current
    runs+=("$WORK/run_llamacpp_budget-$kv.json")
  done
  if [ "${LADDER:-on}" = on ]; then
    llama_run ladder resident 8202 "$(count "$RESIDENT_KV")" "$RESIDENT_RUNNING" gpu ladder
    runs+=("$WORK/run_llamacpp_resident.json")
  fi
  python3 "$HERE/llama_cpp/sbs.py" engine llama.cpp "$WORK/llamacpp.json" "${runs[@]}"
  cp "$WORK/llamacpp.json" "$OUT/"
}

ours_run() {  # ours_run ROLE NAME PORT KIND SERVE_ARGS...: gpu_http_bench.sh's serve + ft bench call
  local role=$1 name=$2 port=$3 kind=$4 idle ready_v after t; shift 4
  late "fluxtide $name" && return 1
  host_quiet "fluxtide $name"
  idle=$(gpu_mib); t=$(date +%s)
  mark "fluxtide $name: ft serve $*"
  if serve "$port" "$WORK/logs/ft_$name.log" "$@"; then
    ready_v=$(gpu_mib); mark "fluxtide $name ready after $(( $(date +%s) - t ))s, GPU ${ready_v} MiB (idle ${idle})"
    if [ "$kind" = ladder ]; then bench_ladder "http://127.0.0.1:$port" "$WORK/fluxtide_$name.json"
    else bench_sweep "http://127.0.0.1:$port" "$WORK/fluxtide_$name.json" "$SWEEP_KV"; fi
    after=$(gpu_mib); mark "fluxtide $name measured, GPU ${after} MiB"
  fi
  run_meta "$WORK/run_fluxtide_$name.json" fluxtide "$role" "$name" "" "$WORK/fluxtide_$name.json" \
    "$(( $(date +%s) - t ))" "$idle" "${ready_v:-}" "${after:-}" "" python3 -m app serve --model "$CKPT" "$@"
  kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null
}

phase_ours() {
  synth_ckpt
  # shellcheck disable=SC2046  # the shapes are option lists
  ours_run sweep budget 8101 sweep $(budget_serve_args)
  local runs=("$WORK/run_fluxtide_budget.json")
  if [ "${LADDER:-on}" = on ]; then
    # shellcheck disable=SC2046
    ours_run ladder resident 8102 ladder $(resident_serve_args)
    runs+=("$WORK/run_fluxtide_resident.json")
  fi
  python3 "$HERE/llama_cpp/sbs.py" engine fluxtide "$WORK/fluxtide.json" "${runs[@]}"
  cp "$WORK/fluxtide.json" "$OUT/"
}

phase_report() {
  # every run kept in $WORK, whichever phase and call made it (extras' ladders included)
  local engine name runs
  for engine in llamacpp fluxtide; do
    runs=("$WORK"/run_"$engine"_*.json)
    [ -f "${runs[0]}" ] || continue
    name=$([ $engine = llamacpp ] && echo llama.cpp || echo fluxtide)
    python3 "$HERE/llama_cpp/sbs.py" engine "$name" "$WORK/$engine.json" "${runs[@]}" && cp "$WORK/$engine.json" "$OUT/"
  done
  # llama.cpp first: the ratios read "fluxtide / llama.cpp"
  python3 "$HERE/llama_cpp/sbs.py" compare "$WORK/side_by_side.json" "$WORK/llamacpp.json" "$WORK/fluxtide.json" \
    && cp "$WORK/side_by_side.json" "$OUT/"
}

phase_coldstart() {  # start-up milestones of the resident fluxtide server, launched by ft bench itself
  synth_ckpt
  late "fluxtide cold start" && return 1
  # shellcheck disable=SC2046,SC2086  # the shapes are option lists
  timeout "$BENCH_TIMEOUT" python3 -m app bench cold-start --model-dir "$CKPT" --quiet --no-bandwidth \
    --start-timeout $(( READY_TRIES * 2 )) --out "$WORK/fluxtide_cold_start.json" -- $(serve_flags) \
    --port 8103 $(resident_serve_args) 2>&1 | tail -15
  cp "$WORK/fluxtide_cold_start.json" "$OUT/" 2>/dev/null
}

extras_ladder() {  # extras_ladder FILE_ENGINE ENGINE PORT KV CMD...: ft bench ladder of a server extras started
  local file=$1 engine=$2 port=$3 kv=$4 idle t; shift 4
  late "$engine ladder" && return 1
  host_quiet "$engine ladder"
  idle=$(gpu_mib); t=$(date +%s)
  bench_ladder "http://127.0.0.1:$port" "$WORK/${file}_resident.json"
  mark "$engine ladder measured (the other engine's server idle beside it)"
  # ready_s: the ladder's own time (the server came up with the other one, before the probes)
  run_meta "$WORK/run_${file}_resident.json" "$engine" ladder resident "$kv" "$WORK/${file}_resident.json" \
    "$(( $(date +%s) - t ))" "$idle" "$idle" "$(gpu_mib)" "" "$@"
}

phase_extras() {  # probe and prefill of both engines, every expert on the GPU, the two servers side by side
  [ -x "$LLAMA_SERVER" ] && [ -f "$GGUF" ] || { echo "extras: run the build phase first"; return 1; }
  synth_ckpt
  late "extras" && return 1
  host_quiet extras
  local llama ours ok=0
  llama_cmd 8204 "$(count "$RESIDENT_KV")" "$RESIDENT_RUNNING"
  # shellcheck disable=SC2086  # LLAMA_ARGS is a list of options
  "${LLAMA_CMD[@]}" $LLAMA_ARGS > "$WORK/logs/llama_extras.log" 2>&1 &
  llama=$!
  # NOTE: the server is killed below even when it never got healthy
  # shellcheck disable=SC2046
  serve 8104 "$WORK/logs/ft_extras.log" $(resident_serve_args) && ok=1
  ours=$SERVER
  wait_healthy 8204 "$llama" "$WORK/logs/llama_extras.log" "$READY_TRIES" || ok=0
  mark "extras: servers ready ($ok), GPU $(gpu_mib) MiB"
  if [ $ok = 1 ]; then  # llama.cpp first: the tables' ratios read "fluxtide / llama.cpp"
    local urls=(--base-url http://127.0.0.1:8204 --base-url http://127.0.0.1:8104)
    timeout "$BENCH_TIMEOUT" python3 -m app bench probe "${urls[@]}" --model-dir "$CKPT" --no-bandwidth \
      --out "$WORK/probe.json" ${PROBE_ARGS:-} 2>&1 | tail -12
    timeout "$BENCH_TIMEOUT" python3 -m app bench prefill "${urls[@]}" --model-dir "$CKPT" --no-bandwidth \
      --out "$WORK/prefill.json" ${PREFILL_ARGS:-} 2>&1 | tail -12
    mark "extras measured"
    if [ "${EXTRAS_LADDER:-off}" = on ]; then  # the resident role of both engines, on the servers already up
      extras_ladder llamacpp llama.cpp 8204 "$(count "$RESIDENT_KV")" "${LLAMA_CMD[@]}" $LLAMA_ARGS
      # shellcheck disable=SC2046
      extras_ladder fluxtide fluxtide 8104 "" python3 -m app serve $(serve_flags) --port 8104 $(resident_serve_args)
    fi
  fi
  kill "$llama" ${ours:+"$ours"} 2>/dev/null; wait "$llama" ${ours:+"$ours"} 2>/dev/null
  cp "$WORK"/probe*.json "$WORK"/prefill*.json "$OUT/" 2>/dev/null
  [ $ok = 1 ]
}

status=0
for phase in "${phases[@]}"; do
  [ "$phase" = bench ] && set -- llama ours report || set -- "$phase"
  for p in "$@"; do
    mark "=== $p"
    "phase_$p" || { status=1; mark "$p failed"; }
  done
  tar czf "$OUT/logs_$phase.tar.gz" -C "$WORK" logs 2>/dev/null
done
mark "done (exit $status); records in $WORK, copies in $OUT"
exit $status
