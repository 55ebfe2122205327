#!/usr/bin/env bash
# Convert a Hugging Face checkpoint (e.g. `ft synth` output, nested or flat layout) to GGUF with
# llama.cpp's own converter. Usage: scripts/llama_cpp/convert.sh LLAMA_CPP_SRC CHECKPOINT OUT.gguf [OUTTYPE]
# OUTTYPE defaults to q8_0 (closest to block FP8). `ft synth` writes the MTP block real Qwen3.5/3.6
# checkpoints carry (mtp.*); a checkpoint that declares mtp_num_hidden_layers but has no mtp.* tensor
# (made by an older ft synth, or with --no-mtp) is converted with --no-mtp, which the converter needs then.
# Neither server uses the MTP layer here (llama-server loads it only for --spec-type draft-mtp).
# Write OUT to /dev/shm on the GPU machine: its disk writes at ~27 MB/s. CONVERT_PYTHON: the interpreter
# (numpy, torch, transformers; default python3).
set -euo pipefail
src=$(realpath "${1:?usage: convert.sh LLAMA_CPP_SRC CHECKPOINT OUT.gguf [OUTTYPE]}")
ckpt=${2:?checkpoint folder}
out=${3:?output .gguf}
extra=()
has_mtp=$(python3 - "$ckpt" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
index = d / "model.safetensors.index.json"
if index.exists():
    names = json.loads(index.read_text())["weight_map"]
else:  # one shard: its JSON header lists the names
    raw = (d / "model.safetensors").open("rb")
    n = int.from_bytes(raw.read(8), "little")
    names = json.loads(raw.read(n))
print(int(any(n.startswith(("mtp.", "model.mtp.")) for n in names)))
PY
)
if [ "$has_mtp" = 0 ]; then
    echo "convert.sh: $ckpt has no mtp.* tensors; converting with --no-mtp"
    extra=(--no-mtp)
fi
# convert_parallel.py runs the converter unchanged, its tensors evaluated ahead of the writer by
# CONVERT_THREADS threads (default: cores - 2; 1 = the converter's own sequential loop)
PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}" \
    "${CONVERT_PYTHON:-python3}" "$(dirname "$0")/convert_parallel.py" "$src" "$ckpt" --outtype "${4:-q8_0}" \
    --outfile "$out" "${extra[@]}"
