#!/usr/bin/env bash
# The fast path's GPU checks in phases that each fit one 10-minute device call (pick them by name):
#   tests    GPU pytest of the fast-path kernels and executors, one pytest per file with a 60 s limit per test
#            (-v -rfE: each result and every failure's message is in the log, a hang costs one test)
#   kernels  scripts/bench_kernels.py (kernels one by one, GEMV/GEMM crossovers)
#   decode   scripts/bench_decode.py resident bs1/4/16 with the profile and fp32 parity
#   http     scripts/gpu_http_bench.sh with the Triton prefill (PREFILL_KERNELS=triton)
# Usage: ./scripts/gpu_fast_path.sh tests kernels   (carry the serving wheels in .whl/ for http)
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
export OUT
CKPT=${CKPT:-/tmp/qwen36-fp8}
for phase in "$@"; do
  echo "=== $phase"
  case $phase in
    tests)
      # NOTE: one pytest per file, appended to one log: a hanging test costs its own 60 s (pytest-timeout
      # fails it with its stack) instead of the phase, and every file's failures and summary reach the log.
      # A file gets at most 240 s (SIGINT first, so pytest still prints what ran); files past 480 s of the
      # phase are skipped, and said so, to leave the summary inside one 10-minute device call.
      log="$OUT/gpu_pytest_fast_path.log"; : > "$log"
      per_test=(--timeout 60)
      python3 -c "import pytest_timeout" 2>/dev/null || { per_test=(); echo "pytest-timeout missing: no per-test limit" | tee -a "$log"; }
      start=$SECONDS
      for f in tests/adapters/test_kernels_prefill.py tests/adapters/test_kernel_dense_gemm.py \
               tests/adapters/test_kernels_moe_grouped.py tests/adapters/test_prefill_linear.py \
               tests/adapters/test_fast_executor.py tests/adapters/test_prefill_warmup.py \
               tests/adapters/test_expert_pool_paths.py tests/adapters/test_expert_pool_grouped.py \
               tests/adapters/test_kernels_moe.py tests/adapters/test_kernel_moe_router.py \
               tests/adapters/test_device_residency.py; do
        if (( SECONDS - start > 480 )); then echo "SKIPPED $f (phase past 480 s)" | tee -a "$log"; continue; fi
        echo "=== $f" >> "$log"
        t0=$SECONDS; lines=$(wc -l < "$log")
        timeout -k 10 -s INT 240 python3 -m pytest -v -p no:cacheprovider -m "not slow" -o addopts="" -rfE \
          ${per_test[@]+"${per_test[@]}"} "$f" >> "$log" 2>&1
        rc=$?
        summary=$(tail -n +"$((lines + 1))" "$log" | grep -E "^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* =+$" | tail -1)
        echo "=== $f exit $rc in $((SECONDS - t0)) s" >> "$log"
        echo "$f: exit $rc in $((SECONDS - t0)) s ${summary:-(no pytest summary: killed?)}"
      done
      grep -E "^(FAILED|ERROR) |Timeout" "$log" | cut -c1-300 ;;
    kernels) timeout 240 python3 scripts/bench_kernels.py --out "$OUT" 2>&1 | tail -3 ;;
    decode)
      timeout 400 python3 scripts/bench_decode.py --out "$OUT" --synth-dir "$CKPT" --reuse --batch 1,4,16 \
        --plans resident --warmup 16 --steps 32 --parity-steps 2 2>&1 | grep -E "^resident|parity|Error" | cut -c1-300 ;;
    http) PREFILL_KERNELS=triton timeout 500 "$(dirname "$0")/gpu_http_bench.sh" 2>&1 | grep -v "^INFO" | tail -8 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
