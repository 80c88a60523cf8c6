#!/usr/bin/env bash
# Configures and builds DOS into ./build (or $DOS_BUILD_DIR). CUDA sources are
# compiled whenever nvcc is found (PATH or /usr/local/cuda), so they cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DOS_BUILD_DIR:-build}
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${DOS_BUILD_TYPE:-RelWithDebInfo} "$@"
cmake --build "$build" -j "$(nproc)"
