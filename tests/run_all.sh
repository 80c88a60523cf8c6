#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine and runs every test (C++ unit and
# integration tests, Python tests; GPU tests skip with a message without a GPU,
# listed with their reasons after the ctest stage), the Debian package test
# (builds, lints, installs and purges the .deb on this machine;
# DOS_TEST_PACKAGE=0 skips it),
# then the unit and integration tests under ASan+UBSan, the TSan set
# (tests/run_sanitizers.sh) and each libFuzzer target for DOS_FUZZ_SECONDS
# (default 60; tests/run_fuzz.sh). DOS_CI_SKIP_SANITIZERS=1 skips those last two
# stages for a quick local run. Any failing stage fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh

# stage NAME COMMAND...: runs one stage, then prints its wall time.
t_begin=$(date +%s)
timings=()
stage() {
  local name=$1 t0 rc=0
  shift
  echo "==== stage $name (+$(($(date +%s) - t_begin)) s since start): $*"
  t0=$(date +%s)
  "$@" || rc=$?
  timings+=("$name: $(($(date +%s) - t0)) s, exit $rc")
  echo "==== stage $name: $(($(date +%s) - t0)) s, exit $rc"
  if [ "$rc" -ne 0 ]; then
    printf '%s\n' "== stages" "${timings[@]}"
    exit "$rc"
  fi
}

build=${DOS_BUILD_DIR:-build}
# A CI and development build: warnings in project code are errors here (a
# user's or packager's build, deploy/build.sh alone, only warns).
stage build bash deploy/build.sh -DDOS_WERROR=ON
# Skipped tests (GPU tests without a GPU, ...) are listed with their reasons
# after the run (tests/skipped_report.py): ctest itself only says "Skipped".
ctest_stage() {
  local rc=0
  ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 900 \
    --output-junit "$PWD/$build/ctest-junit.xml" "$@" || rc=$?
  python3 tests/skipped_report.py "$PWD/$build/ctest-junit.xml"
  return "$rc"
}
stage ctest ctest_stage -LE package
# The Debian package: cpack -G DEB, lintian, dpkg -i, checks, dpkg -r, dpkg -P
# (deploy/test_package.sh; it installs onto this machine, hence the variable).
export DOS_TEST_PACKAGE=${DOS_TEST_PACKAGE:-1}
stage package ctest_stage -L package
if [ "${DOS_CI_SKIP_SANITIZERS:-0}" = 1 ]; then
  echo "DOS_CI_SKIP_SANITIZERS=1: sanitizer and fuzzing stages skipped"
else
  stage asan bash tests/run_sanitizers.sh asan
  stage tsan bash tests/run_sanitizers.sh tsan
  stage fuzz bash tests/run_fuzz.sh "${DOS_FUZZ_SECONDS:-60}"
fi
printf '%s\n' "== stages" "${timings[@]}"
