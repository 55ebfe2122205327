#!/usr/bin/env bash
# The fast path's GPU checks in phases that each fit one 10-minute device call (pick them by name):
#   tests    GPU pytest of the fast-path kernels and executors (-v: each result is in the log even if
#            the time limit cuts the run before pytest's summary)
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
      timeout 300 python3 -m pytest -v -p no:cacheprovider -m "not slow" -o addopts="" -rfE \
        tests/adapters/test_kernels_prefill.py tests/adapters/test_kernel_dense_gemm.py \
        tests/adapters/test_kernels_moe_grouped.py tests/adapters/test_prefill_linear.py \
        tests/adapters/test_fast_executor.py tests/adapters/test_expert_pool_paths.py \
        tests/adapters/test_expert_pool_grouped.py tests/adapters/test_kernels_moe.py \
        tests/adapters/test_kernel_moe_router.py tests/adapters/test_device_residency.py \
        > "$OUT/gpu_pytest_fast_path.log" 2>&1
      echo "pytest exit $?"; tail -15 "$OUT/gpu_pytest_fast_path.log" ;;
    kernels) timeout 240 python3 scripts/bench_kernels.py --out "$OUT" 2>&1 | tail -3 ;;
    decode)
      timeout 400 python3 scripts/bench_decode.py --out "$OUT" --synth-dir "$CKPT" --reuse --batch 1,4,16 \
        --plans resident --warmup 16 --steps 32 --parity-steps 2 2>&1 | grep -E "^resident|parity|Error" | cut -c1-300 ;;
    http) PREFILL_KERNELS=triton timeout 500 "$(dirname "$0")/gpu_http_bench.sh" 2>&1 | grep -v "^INFO" | tail -8 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
