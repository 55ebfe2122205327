#!/usr/bin/env bash
# Convert a Hugging Face checkpoint (e.g. `ft synth --layout flat` output) to GGUF with llama.cpp's
# own converter. Usage: scripts/llama_cpp/convert.sh LLAMA_CPP_SRC CHECKPOINT OUT.gguf [OUTTYPE]
# OUTTYPE defaults to q8_0 (closest to block FP8). --no-mtp: `ft synth` declares an MTP layer
# (mtp_num_hidden_layers) without writing its tensors, and neither server uses it for this benchmark.
# Write OUT to /dev/shm on the GPU machine: its disk writes at ~27 MB/s.
set -euo pipefail
src=$(realpath "${1:?usage: convert.sh LLAMA_CPP_SRC CHECKPOINT OUT.gguf [OUTTYPE]}")
ckpt=${2:?checkpoint folder}
out=${3:?output .gguf}
PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}" \
    python "$src/convert_hf_to_gguf.py" "$ckpt" --outtype "${4:-q8_0}" --outfile "$out" --no-mtp
