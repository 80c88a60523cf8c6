#!/usr/bin/env bash
# Checks install.sh / uninstall.sh against a staging root: everything lands
# where the unit expects it, a second install changes nothing, an operator's
# flagfile survives reinstall and uninstall, --dry-run changes nothing, and
# uninstall removes what install added.
#
#   deploy/test_install.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: test_install.sh BUILD_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root
fail() { echo "FAIL: $*"; exit 1; }

bash "$here/install.sh" --root "$root" --build-dir "$build" --prefix /opt/dos --dry-run > "$tmp/dry"
[ ! -e "$root" ] || fail "--dry-run created $root"
grep -q "install -D -m 0755 .*/opt/dos/bin/dosd" "$tmp/dry" || fail "--dry-run did not list dosd"

bash "$here/install.sh" --root "$root" --build-dir "$build" --prefix /opt/dos > "$tmp/first"
for f in opt/dos/bin/dosd etc/systemd/system/dosd.service etc/sysusers.d/dos.conf \
         etc/tmpfiles.d/dos.conf etc/dos/dosd.flags etc/dos/dosd.flags.example; do
  [ -f "$root/$f" ] || fail "install did not create /$f"
done
[ -x "$root/opt/dos/bin/dosd" ] || fail "dosd not executable"
grep -q '^ExecStart=/opt/dos/bin/dosd --flagfile=/etc/dos/dosd.flags$' \
  "$root/etc/systemd/system/dosd.service" || fail "ExecStart not rewritten for --prefix"

bash "$here/install.sh" --root "$root" --build-dir "$build" --prefix /opt/dos > "$tmp/second"
if grep -q '^+ install' "$tmp/second"; then cat "$tmp/second"; fail "second install changed files"; fi

echo "--log_level=debug" > "$root/etc/dos/dosd.flags"
bash "$here/install.sh" --root "$root" --build-dir "$build" --prefix /opt/dos > /dev/null
grep -q '^--log_level=debug$' "$root/etc/dos/dosd.flags" || fail "install overwrote the flagfile"

# The example flagfile is one dosd accepts.
"$build/daemon/dosd" --flagfile="$here/dos/dosd.flags" --version > /dev/null ||
  fail "dosd rejects deploy/dos/dosd.flags"

bash "$here/uninstall.sh" --root "$root" --prefix /opt/dos > /dev/null
for f in opt/dos/bin/dosd etc/systemd/system/dosd.service etc/sysusers.d/dos.conf \
         etc/tmpfiles.d/dos.conf etc/dos/dosd.flags.example; do
  [ ! -e "$root/$f" ] || fail "uninstall left /$f"
done
[ -f "$root/etc/dos/dosd.flags" ] || fail "uninstall removed the operator's flagfile"
bash "$here/uninstall.sh" --root "$root" --prefix /opt/dos > /dev/null || fail "second uninstall failed"
bash "$here/uninstall.sh" --root "$root" --prefix /opt/dos --purge > /dev/null
[ ! -e "$root/etc/dos/dosd.flags" ] || fail "--purge kept the flagfile"
echo "ok: install/uninstall staged, idempotent, flagfile preserved"
