#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (+ASan/UBSan) into build-fuzz and
# runs each for SECONDS (default 60), starting from generated seeds and the
# corpus kept in build-fuzz/corpus. Prints each target's executions; fails on
# any crash, leak, timeout or sanitizer report (the reproducer is left in
# build-fuzz/artifacts/).
#
#   tests/run_fuzz.sh [SECONDS]
# Environment: DOS_CMAKE_ARGS (extra configure arguments), JOBS, DOS_FUZZ_BUILD.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
jobs=${JOBS:-$(nproc)}
build=${DOS_FUZZ_BUILD:-build-fuzz}  # DOS_FUZZ_BUILD: another build directory
command -v clang++ >/dev/null || { echo "run_fuzz.sh: clang++ not found (apt-get install clang)" >&2; exit 1; }
targets=(checkpoint_reader_fuzzer control_block_fuzzer register_request_fuzzer fd_handshake_fuzzer)

t0=$(date +%s)
mkdir -p "$build"
# -Wno-unknown-warning-option: some components pass GCC-only -Wno-* options.
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDOS_WITH_CUDA=OFF -DDOS_WERROR=ON -DDOS_BUILD_BENCHMARKS=OFF -DDOS_BUILD_FUZZERS=ON \
  -DDOS_SANITIZE=address,undefined,fuzzer-no-link ${DOS_CMAKE_ARGS:-} \
  -DCMAKE_CXX_FLAGS=-Wno-unknown-warning-option > "$build/configure.log"
if ! cmake --build "$build" -j "$jobs" --target fuzz_seeds > "$build/fuzz_seeds.build.log" 2>&1; then
  tail -n 40 "$build/fuzz_seeds.build.log"
  exit 1
fi
# Each target builds on its own so that one component that does not compile
# with clang does not stop the others; a target that fails to build fails the run.
built=()
status=0
report=()
for t in "${targets[@]}"; do
  if cmake --build "$build" -j "$jobs" --target "$t" > "$build/$t.build.log" 2>&1; then
    built+=("$t")
  else
    status=1
    report+=("$t: BUILD FAILED (see $build/$t.build.log)")
    grep -m3 -E "error" "$build/$t.build.log" || true
  fi
done

t1=$(date +%s)
fuzz_dir=$build/tests/fuzz
seeds=$build/seeds
rm -rf "$seeds"
"$fuzz_dir/fuzz_seeds" "$seeds"
mkdir -p "$build/artifacts"
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
for t in "${built[@]}"; do
  corpus=$build/corpus/$t
  mkdir -p "$corpus"
  log=$build/$t.log
  rc=0
  "$fuzz_dir/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" "$corpus" "$seeds/$t" \
    > "$log" 2>&1 || rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n1 | grep -o '[0-9]*' || echo "?")
  report+=("$t: $execs executions in ${seconds}s, coverage $cov edges, exit $rc")
  if [ "$rc" -ne 0 ]; then
    status=1
    echo "== $t failed; last lines of $log:"
    tail -n 40 "$log"
  fi
done
t2=$(date +%s)
echo "== fuzzing, ${seconds}s per target: build $((t1 - t0)) s, fuzzing $((t2 - t1)) s =="
printf '%s\n' "${report[@]}"
exit "$status"
