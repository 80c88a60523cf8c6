#!/usr/bin/env bash
# Builds DOS with sanitizers and runs tests under each: build-asan
# (-DDOS_SANITIZE=address,undefined: the unit and integration suites) and
# build-tsan (-DDOS_SANITIZE=thread: the tests listed in tsan_tests below).
# Prints the time each configuration took and how many tests ran.
#
#   tests/run_sanitizers.sh [asan] [tsan]      (default: both)
#
# Environment: JOBS (parallel build and test jobs, default nproc),
# DOS_SANITIZE_LABELS (ctest -L regex; default 'unit|integration' for asan,
# 'tsan' for tsan), DOS_CMAKE_ARGS (extra configure arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/progress.sh
jobs=${JOBS:-$(nproc)}
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(asan tsan)

# Test executables run under TSan (they get the ctest label `tsan`): the unit
# tests whose threads synchronise only through what TSan sees (std::atomic,
# pthreads, futexes, shared memory mapped in one process, and absl::Mutex and
# CondVar, which tests/tsan/absl_mutex_tsan.cc annotates because Debian's abseil
# is not built with TSan). The single-threaded ones among them are cheap and
# stay in so that threads added to their subjects later are checked.
tsan_tests=(
  shm_segment_test doorbell_test control_channel_test  # transport: doorbells, control block
  transport_fd_server_test                             # descriptor socket: serving threads
  crc32c_test checkpoint_test                          # checkpoint writer/reader, fake Env
  state_shard_state_test                               # state arenas, budget, copy-on-write snapshots
  sched_perf_model_test sched_policy_test              # scheduler model and policy
  sched_device_selection_test sched_executor_set_test  # engine selection
  sched_node_resources_test sched_node_replay_test     # the node's shared host view, many threads
  metrics_registry_test metrics_http_server_test       # counters hit from threads, HTTP thread
  sd_notify_test                                       # watchdog thread
  cpu_dtype_test
  absl_mutex_tsan_test                                 # checks tests/tsan/absl_mutex_tsan.cc
)
# Not run under TSan, because TSan cannot judge them: everything that goes
# through gRPC (client_c_api_test and the integration tests: Debian's gRPC is
# not instrumented; run under TSan, dosd and the tests report races inside it,
# such as slice buffers freed in libgrpc after a send on another thread, and a
# `race:libgrpc.so` suppression would also hide every race in dosd's handlers,
# because TSan matches suppressions against every frame of a stack), and
# cpu_updater_test (oneTBB's scheduler is not instrumented, so the hand-off of
# tiles to its workers is invisible). cpu_adam_kernel_test and
# cpu_all_finite_test are single-threaded numerics that TSan would only slow
# down. ASan+UBSan runs all of them. (DOS_SANITIZE_LABELS=integration runs the
# integration tests under TSan anyway, dosd annotated too.)
tsan_list=$(IFS=';'; echo "${tsan_tests[*]}")

# Every sanitizer report fails the test that triggered it.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# One LeakSanitizer suppression: the 40-byte proxy that oneTBB allocates in
# task_scheduler_observer::observe(true) (CpuUpdater's thread pinning) is at
# times still held by an exiting TBB worker and never freed (2 of 6 runs of
# CpuUpdaterTest.StoresAndPinningKeepResultsBitIdentical); the
# observer itself is destroyed with observe(false). Nothing else is excused.
lsan_supp=$(mktemp)
trap 'rm -f "$lsan_supp"' EXIT
echo 'leak:tbb::detail::r1::observe' > "$lsan_supp"
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$lsan_supp:print_suppressions=0}
# No TSan suppressions: nothing TSan reports in the tests it runs is excused.
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}

summary=()
status=0
for cfg in "${configs[@]}"; do
  build=build-$cfg
  # GCC warns (-Wtsan, an error under -Werror) that TSan does not model
  # std::atomic_thread_fence, which <atomic> users such as absl/flags reach.
  # Under ASan, GCC 12 reports a false -Wmaybe-uninitialized in
  # client/src/request_builder.cc.
  # TSan builds only the executables it runs (with DOS_SANITIZE_LABELS, all).
  case "$cfg" in
    asan) sanitize=address,undefined; labels=${DOS_SANITIZE_LABELS:-unit|integration}
          extra_flags=(-DCMAKE_CXX_FLAGS=-Wno-maybe-uninitialized); targets=() ;;
    tsan) sanitize=thread; labels=${DOS_SANITIZE_LABELS:-tsan}
          extra_flags=(-DCMAKE_CXX_FLAGS=-Wno-tsan "-DDOS_TSAN_TESTS=$tsan_list")
          targets=(--target "${tsan_tests[@]}")
          [ -z "${DOS_SANITIZE_LABELS:-}" ] || targets=() ;;
    *) echo "run_sanitizers.sh: unknown configuration $cfg (asan, tsan)" >&2; exit 2 ;;
  esac
  t0=$(date +%s)
  mkdir -p "$build"
  rc=0
  progress_stage "$cfg: configure and build $build/ (full log: $build/build.log)"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDOS_WITH_CUDA=OFF \
    -DDOS_WERROR=ON -DDOS_BUILD_BENCHMARKS=OFF -DDOS_SANITIZE="$sanitize" "${extra_flags[@]}" ${DOS_CMAKE_ARGS:-} \
    > "$build/configure.log" && cmake --build "$build" -j "$jobs" "${targets[@]}" 2>&1 |
    progress_filter "$cfg build" "$build/build.log" || rc=$?
  t1=$(date +%s)
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$build/configure.log" "$build/build.log"
    status=1
    summary+=("$cfg ($sanitize): BUILD FAILED after $((t1 - t0)) s")
    continue
  fi
  # TSan's shadow memory needs a fixed layout; kernels with 32+ bits of mmap
  # randomisation break it, so run without ASLR where setarch is available.
  runner=()
  if [ "$cfg" = tsan ] && command -v setarch >/dev/null; then runner=(setarch "$(uname -m)" -R); fi
  # Only progress and failures reach the console; the whole log stays in $build/ctest.log.
  progress_stage "$cfg: ctest -L '$labels' (full log: $build/ctest.log)"
  "${runner[@]}" ctest --test-dir "$build" -L "$labels" --output-on-failure -j "$jobs" \
    --timeout 900 2>&1 | progress_filter "$cfg test" "$build/ctest.log" || rc=$?
  t2=$(date +%s)
  grep -vE '^ *(Start +[0-9]+:|[0-9]+/[0-9]+ Test +#[0-9]+: .* Passed)' "$build/ctest.log" || true
  counted=$(grep -oE 'tests passed, [0-9]+ tests failed out of [0-9]+' "$build/ctest.log" || true)
  [ "$rc" -eq 0 ] || status=1
  summary+=("$cfg ($sanitize, -L '$labels'): build $((t1 - t0)) s, tests $((t2 - t1)) s, \
${counted:-no test count}, ctest exit $rc")
done
echo "== sanitizer runs on $(nproc) cores, $jobs jobs =="
printf '%s\n' "${summary[@]}"
exit "$status"
