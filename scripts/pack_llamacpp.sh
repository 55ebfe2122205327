#!/usr/bin/env bash
# Pack llama.cpp's source (as vendored in the llama-cpp-python sdist) small enough to carry to the
# lent GPU machine, which has no network: only what llama-server (CPU + CUDA backends) and the
# HF -> GGUF converter need. Usage: scripts/llama_cpp/pack.sh OUT.tar.gz [VERSION]
# (VERSION pins llama-cpp-python; default 0.3.36, the one this was checked with).
set -euo pipefail
out=$(realpath -m "${1:?usage: pack.sh OUT.tar.gz [llama-cpp-python version]}")
version=${2:-0.3.36}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cd "$src"
# NOTE: weights, docs, tests and every GPU backend but CUDA are not needed to build llama-server
rm -rf models docs media benches tests examples pocs app skills ci .github tools/server/bench
find ggml/src -mindepth 1 -maxdepth 1 -type d -name 'ggml-*' ! -name ggml-cpu ! -name ggml-cuda -exec rm -rf {} +
# the web UI's sources: with LLAMA_BUILD_UI=OFF only its CMake files are read
find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name '*.in' ! -name '*.cmake' -exec rm -rf {} +
# the examples and tests folders are still named by CMakeLists.txt; empty ones keep configure quiet
mkdir -p examples tests && : > examples/CMakeLists.txt && : > tests/CMakeLists.txt
cd ..
tar czf "$out" llama.cpp
echo "packed $(du -h "$out" | cut -f1) into $out"
