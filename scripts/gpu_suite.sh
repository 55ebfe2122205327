#!/usr/bin/env bash
# Everything that needs a CUDA device, in one go (for the lent H200; see docs/gpu-validation.md):
# the GPU-marked pytest files, bf16/fp32 parity against transformers, and the full-size FP8
# Qwen3.6-35B-A3B geometry loaded under a 24 GiB budget. Results land in $OUT.
# The device image lacks the serving stack: carry the wheels gpu_env.sh lists in .whl/.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/adapters/test_loader_gpu.py tests/app/test_gpu_serve.py \
  2>&1 | tee "$OUT/gpu_pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_pytest.log"
python3 scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
