#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine and runs every test (C++ unit and
# integration tests, Python tests; GPU tests skip with a message without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
bash deploy/build.sh
ctest --test-dir "${DOS_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" --timeout 900
