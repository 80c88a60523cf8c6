#!/usr/bin/env bash
# Configures and builds DOS into ./build (or $DOS_BUILD_DIR). CUDA sources are
# compiled whenever nvcc is found (PATH or /usr/local/cuda), so they cannot rot;
# DOS_WITH_CUDA=OFF leaves them out (deploy/demo.sh on a machine without a GPU).
# DOS_BUILD_TARGETS (space-separated) builds only those targets and what they
# need (the demo: dosd dosctl dos_client); default: everything.
# Extra arguments go to cmake's configure step (e.g. -DDOS_WERROR=ON, which
# tests/run_all.sh passes: warnings are errors in CI and development builds,
# never in a user's or packager's).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DOS_BUILD_DIR:-build}
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
# Decided afresh every time (unset: CMake's default, on with a working nvcc),
# so that the demo's DOS_WITH_CUDA=OFF does not stick in the cache.
cuda=(-UDOS_WITH_CUDA)
if [ -n "${DOS_WITH_CUDA:-}" ]; then cuda=("-DDOS_WITH_CUDA=$DOS_WITH_CUDA"); fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${DOS_BUILD_TYPE:-RelWithDebInfo} "${cuda[@]}" "$@"
targets=()
for t in ${DOS_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
