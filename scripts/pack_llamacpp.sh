#!/usr/bin/env bash
# Pack llama.cpp's source, as vendored in the llama-cpp-python sdist, small enough to carry to the
# lent GPU machine (no network there; the carry limit is 64 MiB, shared with the ~8-20 MB .whl/):
# only what `llama-server` (CPU + CUDA backends) and the HF -> GGUF converter (convert_hf_to_gguf.py,
# conversion/, the in-tree gguf-py) need.
#   Usage: scripts/pack_llamacpp.sh [OUT.tar.gz] [VERSION]
#   OUT      default .llamacpp/llama.cpp.tar.gz (ignored by git: /.llamacpp/ in .gitignore;
#            the GPU calls carry it)
#   VERSION  llama-cpp-python version; pinned to 0.3.36 (the newest on the package index on
#            2026-12-01; its vendored llama.cpp converts qwen3_5_moe and its MTP block)
# The tarball unpacks to llama.cpp/ and holds PACKED_FROM (the sdist it came from).
set -euo pipefail
LLAMA_CPP_PYTHON_VERSION=0.3.36
out=$(realpath -m "${1:-.llamacpp/llama.cpp.tar.gz}")
version=${2:-$LLAMA_CPP_PYTHON_VERSION}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")"
pip download --quiet --no-deps --no-binary=:all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cd "$src"
# NOTE: weights, docs, tests and every GPU backend but CUDA are not needed to build llama-server
rm -rf models docs media benches tests examples pocs app skills ci .github .devops tools/server/bench \
    tools/server/tests tools/server/webui gguf-py/tests build-xcframework.sh flake.nix
find ggml/src -mindepth 1 -maxdepth 1 -type d -name 'ggml-*' ! -name ggml-cpu ! -name ggml-cuda -exec rm -rf {} +
# the web UI's sources: with LLAMA_BUILD_UI=OFF only its CMake files are read
find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name '*.in' ! -name '*.cmake' -exec rm -rf {} +
# the examples and tests folders are still named by CMakeLists.txt; empty ones keep configure quiet
mkdir -p examples tests && : > examples/CMakeLists.txt && : > tests/CMakeLists.txt
echo "llama-cpp-python==$version sdist, vendor/llama.cpp, stripped by scripts/pack_llamacpp.sh" > PACKED_FROM
cd ..
tar czf "$out" llama.cpp
echo "packed llama-cpp-python $version: $(du -h "$out" | cut -f1) into $out"
