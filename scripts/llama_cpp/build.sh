#!/usr/bin/env bash
# Build llama-server from pack.sh's tarball, with the CUDA backend for one GPU architecture
# (default 90: H100/H200). Usage: scripts/llama_cpp/build.sh SRC.tar.gz DEST [JOBS]
# -> DEST/build/bin/llama-server. CUDA_ARCH=... overrides the architecture; CUDA=OFF builds CPU only.
set -euo pipefail
tarball=$(realpath "${1:?usage: build.sh SRC.tar.gz DEST [JOBS]}")
dest=$(realpath -m "${2:?usage: build.sh SRC.tar.gz DEST [JOBS]}")
jobs=${3:-$(nproc)}
mkdir -p "$dest"
tar xzf "$tarball" -C "$dest"
# NOTE: the packed tree has no app/, examples or tests, and the web UI is not built (no network there)
cmake -S "$dest/llama.cpp" -B "$dest/build" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_CUDA="${CUDA:-ON}" \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_OPENSSL=OFF
cmake --build "$dest/build" --target llama-server -j "$jobs"
"$dest/build/bin/llama-server" --version
