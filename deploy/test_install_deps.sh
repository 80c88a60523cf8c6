#!/usr/bin/env bash
# deploy/install-deps.sh against a fake apt-get and dpkg-query (ctest
# deploy_install_deps_lock, label unit): while another process holds the
# package manager's lock it waits with a message and then installs; past
# DOS_APT_LOCK_TIMEOUT it fails naming the lock; other apt errors fail at once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
mkdir "$tmp/bin"
# dpkg-query: every package is missing but "cmake".
cat > "$tmp/bin/dpkg-query" <<'SH'
#!/bin/sh
for a; do last=$a; done
[ "$last" = cmake ] && printf 'install ok installed'
exit 0
SH
# apt-get: "update" is locked for the first $LOCKED_CALLS calls; $MODE=broken fails otherwise.
cat > "$tmp/bin/apt-get" <<'SH'
#!/bin/sh
echo "$*" >> "$FAKE_DIR/calls"
n=$(grep -c '^update' "$FAKE_DIR/calls" || true)
if [ "$1" = update ] && [ "$n" -le "${LOCKED_CALLS:-0}" ]; then
  echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)" >&2
  exit 100
fi
if [ "${MODE:-}" = broken ]; then echo "E: Unable to locate package nosuch" >&2; exit 100; fi
exit 0
SH
chmod +x "$tmp/bin/"*
run() { env PATH="$tmp/bin:$PATH" FAKE_DIR="$tmp" DOS_APT_LOCK_POLL=0 "$@" bash "$here/install-deps.sh"; }

: > "$tmp/calls"
run LOCKED_CALLS=2 > "$tmp/out" 2>&1 || { cat "$tmp/out"; fail "install-deps failed behind a lock"; }
grep -q 'another package manager holds the lock (held by process 4242 (apt-get)); waiting' "$tmp/out" ||
  { cat "$tmp/out"; fail "no waiting message"; }
[ "$(grep -c '^update' "$tmp/calls")" -eq 3 ] || fail "expected 3 update attempts: $(cat "$tmp/calls")"
grep -q '^install -y -q --no-install-recommends .*lintian.* -o DPkg::Lock::Timeout=' "$tmp/calls" ||
  fail "install not run with DPkg::Lock::Timeout: $(cat "$tmp/calls")"
if grep -q ' cmake ' "$tmp/calls"; then fail "installed a package that is present"; fi
echo "ok: waits for the lock, then installs"

: > "$tmp/calls"
rc=0
run LOCKED_CALLS=1000 DOS_APT_LOCK_TIMEOUT=0 > "$tmp/out" 2>&1 || rc=$?
[ "$rc" -eq 100 ] || { cat "$tmp/out"; fail "expected apt's exit 100 after the timeout, got $rc"; }
grep -q "lock is still held after 0 s" "$tmp/out" || { cat "$tmp/out"; fail "no timeout message"; }
grep -q "/var/lib/apt/lists/lock" "$tmp/out" || fail "the timeout message does not name the lock"
echo "ok: gives up after DOS_APT_LOCK_TIMEOUT naming the lock"

: > "$tmp/calls"
rc=0
run MODE=broken > "$tmp/out" 2>&1 || rc=$?
[ "$rc" -eq 100 ] || fail "expected exit 100 for a broken install, got $rc"
[ "$(grep -c '^update' "$tmp/calls")" -eq 1 ] || fail "retried an error that is not a lock"
echo "ok: other apt errors fail at once"
