#!/usr/bin/env bash
# Mixed batches (issue 9, docs/adr/0011-mixed-step-budget.md) through the HTTP API on a CUDA host: the full-size
# Qwen3.6-35B-A3B block-FP8 checkpoint (ft synth) served with --prefill-kernels triton and 4 running requests;
# ft bench mixed (3 streams, one 8,192-token prompt, 3 repeats) at the new step budgets (--max-prefill-length
# 8192 / --mixed-prefill-length 512, the defaults) with and without --layered-prefill (docs/adr/0024-layered-prefill.md).
#   scripts/gpu_mixed_bench.sh [resident] [24gib]   (default: resident; each scenario is two server starts,
#                                                    ~4-5 min: one scenario per 10-minute device call)
#   resident: every expert resident (--gpu-budget-gib $RESIDENT_BUDGET_GIB, 64k KV): the ADR's cost model
#   24gib:    --gpu-budget-gib $BUDGET_GIB, 16k KV: the issue's card, the prefill streams what is not resident
#   MIXED_BUDGETS="8192:512 8192:512:layered" (max:mixed[:layered] per server; the old single budget is 2048:2048),
#   MIXED_ARGS (extra ft bench mixed arguments)
#   PROFILE_STEPS="mixed&prefill<=32" (a step filter, adapters/cuda_exec/step_profiler.py): each server profiles the
#   steps it matches (FLUXTIDE_PROFILE_DIR=$OUT/step-profiles/<record name>, PROFILE_MAX of them, default 8; a
#   gzipped chrome trace and a JSON summary each), packed into $OUT/step-profiles.tar at the end with one line per
#   step printed. Profiled steps run slower: such a run's gaps and TTFT are no benchmark (docs/serving.md).
# Records: $OUT/mixed_<scenario>_<max>-<mixed>[-layered].json, the server logs beside them (serve_mixed_*.log).
# Sources gpu_http_bench.sh for the checkpoint, the server start and the budgets (carry .whl/ as there).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/gpu_http_bench.sh"
export PREFILL_KERNELS=${PREFILL_KERNELS:-triton}
MIXED_BUDGETS=${MIXED_BUDGETS:-8192:512 8192:512:layered}
MIXED_ARGS=${MIXED_ARGS:---repeats 3}

mixed_summary() {  # one line from a record: the gaps in the window against the target, the prompt's TTFT
  python3 - "$1" <<'EOF'
import json, sys
try:
    rec = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"{sys.argv[1]}: no record ({exc})")
s = rec.get("summary") or {}
w, b = s.get("window") or {}, s.get("baseline") or {}
after = ((rec.get("server_after") or {}).get("stats") or {}).get("scheduler") or {}
print(f"{sys.argv[1]}: budgets {s.get('server_step_budgets')} (layer groups after the run: {after.get('layer_groups')}); window gaps {w.get('count')} p50 {w.get('p50_ms')} "
      f"p99 {w.get('p99_ms')} max {w.get('max_ms')} ms (target {(s.get('target') or {}).get('gap_p99_ms')}: "
      f"met={s.get('meets_target')}, not issue 9's scenario in {sorted(s.get('target_conditions_differ') or {})}); baseline p99 {b.get('p99_ms')} ms; TTFT p50 {s.get('ttft_s_median')} s; "
      f"failures {len(rec.get('failures') or [])}")
EOF
}

profile_lines() {  # profile_lines DIR: one line per step profile summary under DIR (step_profiler.py's JSON)
  python3 - "$1" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/step-*.json")):
    try:
        s = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"{path}: unreadable ({exc})"); continue
    d, h, y = s.get("device_time") or {}, s.get("host") or {}, s.get("host_syncs") or {}
    gaps = s.get("idle_gaps") or {}
    g = (gaps.get("largest") or [{}])[0]
    slow = h.get("slow_ops") or {}
    top = ", ".join(f"{o['name']} {o['dur_ms']}" for o in (slow.get("ops") or [])[:3])
    print(f"{path.parent.name}/{path.name}: wall {s.get('wall_ms')} ms, device busy {d.get('busy_union_ms')} ms, "
          f"kernels {d.get('kernel_sum_ms')} ms in {d.get('kernels')}, host outside ops {h.get('outside_ops_ms')} ms, "
          f"syncs {y.get('count')} ({y.get('total_ms')} ms), idle {gaps.get('total_ms')} ms (largest {g.get('dur_ms')} "
          f"ms before {g.get('next_work')}), host ops >= 1 ms: {slow.get('count')} ({slow.get('total_ms')} ms; {top})"
          f"{' ERROR ' + s['summary_error'] if 'summary_error' in s else ''}")
EOF
}

run_scenario() {  # run_scenario NAME PORT: one server per budget pair, ft bench mixed against each
  local scen=$1 port=$2 shape pair max mixed layered name rest
  case $scen in
    resident) shape="--gpu-budget-gib $RESIDENT_BUDGET_GIB --kv-tokens 64k" ;;
    24gib) shape="--gpu-budget-gib $BUDGET_GIB --kv-tokens 16k" ;;
    *) echo "unknown scenario $scen (resident | 24gib)"; return 2 ;;
  esac
  for pair in $MIXED_BUDGETS; do
    max=${pair%%:*} rest=${pair#*:} mixed=${rest%%:*} layered=off name=mixed_${scen}_${pair//:/-}
    [[ $rest == *:layered ]] && layered=on
    if [[ -n ${PROFILE_STEPS:-} ]]; then  # the server started below profiles the steps the filter picks
      export FLUXTIDE_PROFILE_DIR="$OUT/step-profiles/$name" FLUXTIDE_PROFILE_STEPS="$PROFILE_STEPS"
      export FLUXTIDE_PROFILE_MAX="${PROFILE_MAX:-8}"
    fi
    # shellcheck disable=SC2086  # shape is a list of options
    if serve "$port" "$OUT/serve_$name.log" $shape --max-running-requests 4 --max-prefill-length "$max" \
        --mixed-prefill-length "$mixed" --layered-prefill "$layered"; then
      # shellcheck disable=SC2086
      timeout "$BENCH_TIMEOUT" python3 -m app bench mixed --base-url "http://127.0.0.1:$port" --model-dir "$CKPT" \
        --quiet --out "$OUT/$name.json" $MIXED_ARGS 2>&1 | grep -v "^INFO" | tail -5
      mixed_summary "$OUT/$name.json"
      kill "$SERVER"; wait "$SERVER" 2>/dev/null
    fi
    port=$((port + 1))
  done
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  # layered prefill's executor path on CUDA first (the decode graph, then the group eager; ~1 min): bitwise the chunk
  # alone, or the benchmark below measures a wrong path
  python3 -m pytest -q -p no:cacheprovider tests/adapters/test_layered_prefill.py -k "cuda or fast_path" \
    2>&1 | tail -5 | tee "$OUT/pytest_layered_prefill.log"
  synth_ckpt
  SECONDS=0
  port=8111
  for scen in "${@:-resident}"; do
    echo "=== mixed $scen"
    run_scenario "$scen" "$port"
    port=$((port + 10))
  done
  grep -h -E "Error|error|Traceback" "$OUT"/serve_mixed_*.log | head -10 || true
  if [[ -n ${PROFILE_STEPS:-} && -d $OUT/step-profiles ]]; then
    profile_lines "$OUT/step-profiles"
    # NOTE: one file back (a call returns only a few from $OUT); the traces inside are gzipped already
    tar cf "$OUT/step-profiles.tar" -C "$OUT" step-profiles && rm -rf "$OUT/step-profiles"
  fi
fi
