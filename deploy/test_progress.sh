#!/usr/bin/env bash
# deploy/progress.sh's progress_filter (ctest deploy_progress_heartbeat): a
# long silent step (one compile of minutes: ninja prints a step only when it
# ends) gets a heartbeat naming the file being compiled; every line reaches
# the log, a last one without a newline too.
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/progress.sh
tmp=$(mktemp -d /tmp/dos-progress-test.XXXXXX)
fake=
cleanup() {
  if [ -n "$fake" ]; then kill "$fake" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; cat "$tmp/out" 2>/dev/null; exit 1; }

# A compiler at work on a file of this checkout, as ps shows it.
bash -c 'sleep 6; true' fakecc -c "$PWD/daemon/gpu/slow_kernel.cu" &
fake=$!
{
  echo "[1/3] Building CXX object a.o"
  sleep 3
  echo "[2/3] Building CXX object b.o"
  printf 'ninja: no newline at the end'
} | DOS_HEARTBEAT_EVERY=1 DOS_HEARTBEAT_POLL=1 DOS_PROGRESS_EVERY=0 \
    progress_filter build "$tmp/log" > "$tmp/out"
cat "$tmp/out"
grep -q 'build .*\[1/3\] Building CXX object a.o' "$tmp/out" || fail "first step not shown"
grep -q 'still working (.*: compiling .*daemon/gpu/slow_kernel.cu' "$tmp/out" ||
  fail "no heartbeat naming the file being compiled"
grep -q '\[2/3\] Building CXX object b.o' "$tmp/out" || fail "second step not shown"
[ "$(wc -l < "$tmp/log")" -eq 3 ] || fail "the log has $(wc -l < "$tmp/log") lines, not 3"
grep -q '^ninja: no newline at the end$' "$tmp/log" || fail "the last line is missing from the log"
echo "ok: heartbeat names the file being compiled; the log keeps every line"
