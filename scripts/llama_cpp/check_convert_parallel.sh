#!/usr/bin/env bash
# Check that convert_parallel.py writes the converter's own bytes: convert CHECKPOINT with the converter's
# sequential loop (CONVERT_THREADS=1) and with THREADS tensor threads, and compare the two files byte for byte.
#   Usage: scripts/llama_cpp/check_convert_parallel.sh LLAMA_CPP_SRC CHECKPOINT [THREADS] [OUTTYPE]
# (a CPU machine is enough: `ft synth --geometry tiny --format fp8_block --device cpu` makes a checkpoint in seconds)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${1:?usage: check_convert_parallel.sh LLAMA_CPP_SRC CHECKPOINT [THREADS] [OUTTYPE]}
ckpt=${2:?checkpoint folder}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
CONVERT_THREADS=1 "$here/convert.sh" "$src" "$ckpt" "$work/sequential.gguf" "${4:-q8_0}" > "$work/sequential.log" 2>&1
CONVERT_THREADS=${3:-4} "$here/convert.sh" "$src" "$ckpt" "$work/parallel.gguf" "${4:-q8_0}" > "$work/parallel.log" 2>&1
cmp "$work/sequential.gguf" "$work/parallel.gguf"
echo "identical: $(stat -c %s "$work/parallel.gguf") bytes, ${3:-4} threads against the sequential loop"
