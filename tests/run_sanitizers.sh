#!/usr/bin/env bash
# Builds DOS with sanitizers and runs the unit and integration tests under
# each: build-asan (-DDOS_SANITIZE=address,undefined) and build-tsan
# (-DDOS_SANITIZE=thread). Prints the time each configuration took.
#
#   tests/run_sanitizers.sh [asan] [tsan]      (default: both)
#
# Environment: JOBS (parallel build and test jobs, default nproc),
# DOS_SANITIZE_LABELS (ctest -L regex, default 'unit|integration'),
# DOS_CMAKE_ARGS (extra configure arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-$(nproc)}
labels=${DOS_SANITIZE_LABELS:-unit|integration}
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(asan tsan)

# Every sanitizer report fails the test that triggered it.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# Debian's gRPC, abseil and oneTBB are not built with TSan: races reported
# inside them are unverifiable (TSan cannot see their synchronisation), so
# they are suppressed; every frame of project code is still checked. The
# same blindness means accesses ordered only by absl::Mutex can be reported
# as races in project code: such reports need an instrumented abseil to judge.
tsan_supp=$(mktemp)
trap 'rm -f "$tsan_supp"' EXIT
cat > "$tsan_supp" <<'SUPP'
race:libgrpc.so
race:libgpr.so
race:grpcpp/
race:libabsl_
race:oneapi/tbb/
race:libtbb.so
called_from_lib:libgrpc.so
called_from_lib:libtbb.so
SUPP
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$tsan_supp}

summary=()
status=0
for cfg in "${configs[@]}"; do
  case "$cfg" in
    asan) sanitize=address,undefined ;;
    tsan) sanitize=thread ;;
    *) echo "run_sanitizers.sh: unknown configuration $cfg (asan, tsan)" >&2; exit 2 ;;
  esac
  build=build-$cfg
  # GCC warns (-Wtsan, an error under -Werror) that TSan does not model
  # std::atomic_thread_fence, which <atomic> users such as absl/flags reach.
  extra_flags=()
  [ "$cfg" = tsan ] && extra_flags=(-DCMAKE_CXX_FLAGS=-Wno-tsan)
  t0=$(date +%s)
  mkdir -p "$build"
  rc=0
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDOS_WITH_CUDA=OFF \
    -DDOS_BUILD_BENCHMARKS=OFF -DDOS_SANITIZE="$sanitize" "${extra_flags[@]}" ${DOS_CMAKE_ARGS:-} \
    > "$build/configure.log" && cmake --build "$build" -j "$jobs" || rc=$?
  t1=$(date +%s)
  if [ "$rc" -ne 0 ]; then
    status=1
    summary+=("$cfg ($sanitize): BUILD FAILED after $((t1 - t0)) s")
    continue
  fi
  # TSan's shadow memory needs a fixed layout; kernels with 32+ bits of mmap
  # randomisation break it, so run without ASLR where setarch is available.
  runner=()
  if [ "$cfg" = tsan ] && command -v setarch >/dev/null; then runner=(setarch "$(uname -m)" -R); fi
  "${runner[@]}" ctest --test-dir "$build" -L "$labels" --output-on-failure -j "$jobs" \
    --timeout 900 || rc=$?
  t2=$(date +%s)
  [ "$rc" -eq 0 ] || status=1
  summary+=("$cfg ($sanitize): build $((t1 - t0)) s, tests $((t2 - t1)) s, ctest exit $rc")
done
echo "== sanitizer runs on $(nproc) cores, $jobs jobs =="
printf '%s\n' "${summary[@]}"
exit "$status"
