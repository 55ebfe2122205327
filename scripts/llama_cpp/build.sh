#!/usr/bin/env bash
# Build llama-server from scripts/pack_llamacpp.sh's tarball, with the CUDA backend for one GPU
# architecture (default 90: H100/H200). Usage: scripts/llama_cpp/build.sh SRC.tar.gz DEST [JOBS]
# -> the source in DEST/llama.cpp (unpacked unless already there), the binary in BUILD_DIR/bin/llama-server
# (BUILD_DIR defaults to DEST/build). CUDA_ARCH=... overrides the architecture; CUDA=OFF builds CPU only;
# NATIVE=OFF builds for plain x86-64 instead of the build host's CPU.
set -euo pipefail
tarball=$(realpath "${1:?usage: build.sh SRC.tar.gz DEST [JOBS]}")
dest=$(realpath -m "${2:?usage: build.sh SRC.tar.gz DEST [JOBS]}")
jobs=${3:-$(nproc)}
build=$(realpath -m "${BUILD_DIR:-$dest/build}")
mkdir -p "$dest"
[ -f "$dest/llama.cpp/CMakeLists.txt" ] || tar xzf "$tarball" -C "$dest"
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
# NOTE: the packed tree has no app/, examples or tests, and the web UI is not built (no network there).
# GGML_NATIVE stays ON (-march=native): it is built on the host that runs it, and with its experts in host
# memory llama.cpp computes them on the CPU, so an AVX2/AVX-512-less baseline build would be unfair to it.
cmake -S "$dest/llama.cpp" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE="${NATIVE:-ON}" -DGGML_CUDA="${CUDA:-ON}" \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_OPENSSL=OFF
cmake --build "$build" --target llama-server -j "$jobs"
"$build/bin/llama-server" --version
