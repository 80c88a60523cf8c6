#!/usr/bin/env bash
# Checks deploy/systemd/dosd.service with `systemd-analyze verify`, with
# ExecStart pointing at the dosd given (the build's), and the sysusers and
# tmpfiles entries with their own parsers. Fails on any warning about our
# files. Exit 77 (ctest SKIP) when systemd-analyze is missing.
#
#   deploy/verify_unit.sh PATH/TO/dosd
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dosd=${1:?usage: verify_unit.sh PATH/TO/dosd}
if ! command -v systemd-analyze >/dev/null; then
  echo "SKIP: systemd-analyze not installed (apt-get install systemd)"
  exit 77
fi
[ -x "$dosd" ] || { echo "verify_unit.sh: $dosd is not an executable" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed "s|^ExecStart=/usr/local/bin/dosd |ExecStart=$(realpath "$dosd") |" \
  "$here/systemd/dosd.service" > "$tmp/dosd.service"
grep -q "^ExecStart=$(realpath "$dosd") --flagfile=/etc/dos/dosd.flags\$" "$tmp/dosd.service"

status=0
out=$(systemd-analyze verify --man=no "$tmp/dosd.service" 2>&1) || status=$?
# Warnings about other units on the host are not ours; anything naming our
# file (unknown keys, bad values) fails the check.
ours=$(printf '%s\n' "$out" | grep -F "dosd.service" || true)
if [ "$status" -ne 0 ] || [ -n "$ours" ]; then
  echo "systemd-analyze verify failed (exit $status):"
  printf '%s\n' "$out"
  exit 1
fi
echo "ok: systemd-analyze verify dosd.service (ExecStart=$(realpath "$dosd"))"

# The unit must keep what the issue requires.
for want in '^Type=notify$' '^WatchdogSec=' '^Restart=on-failure$' '^LimitMEMLOCK=infinity$' \
            '^RuntimeDirectory=dos$' '^User=dos$' '^Group=dos$' '^PrivateDevices=no$' \
            '^PrivateIPC=no$' '^DeviceAllow=char-nvidia-uvm rw$' \
            '^ExecStart=/usr/local/bin/dosd --flagfile=/etc/dos/dosd.flags$'; do
  grep -q -- "$want" "$here/systemd/dosd.service" || { echo "dosd.service lacks $want"; exit 1; }
done
echo "ok: required settings present"

# sysusers and tmpfiles entries parse (dry runs into a scratch root).
if command -v systemd-sysusers >/dev/null; then
  systemd-sysusers --root="$tmp/root" --dry-run "$here/sysusers.d/dos.conf" >/dev/null 2>"$tmp/su.err" ||
    { cat "$tmp/su.err"; echo "systemd-sysusers rejected sysusers.d/dos.conf"; exit 1; }
  echo "ok: systemd-sysusers --dry-run sysusers.d/dos.conf"
fi
if command -v systemd-tmpfiles >/dev/null; then
  if grep -q -- '--dry-run' <<<"$(systemd-tmpfiles --help 2>/dev/null || true)"; then
    dry=(--dry-run)
  else
    dry=()
  fi
  mkdir -p "$tmp/root/etc"
  cp /etc/passwd /etc/group "$tmp/root/etc/"
  printf 'dos:x:990:990::/var/lib/dos:/usr/sbin/nologin\n' >> "$tmp/root/etc/passwd"
  printf 'dos:x:990:\n' >> "$tmp/root/etc/group"
  if [ "$(id -u)" -eq 0 ]; then
    systemd-tmpfiles --root="$tmp/root" "${dry[@]}" --create "$here/tmpfiles.d/dos.conf" 2>"$tmp/tf.err" ||
      { cat "$tmp/tf.err"; echo "systemd-tmpfiles rejected tmpfiles.d/dos.conf"; exit 1; }
    [ -d "$tmp/root/var/lib/dos/checkpoints" ] || [ ${#dry[@]} -gt 0 ] ||
      { echo "tmpfiles did not create /var/lib/dos/checkpoints"; exit 1; }
    echo "ok: systemd-tmpfiles --create tmpfiles.d/dos.conf"
  else
    echo "note: not root; tmpfiles.d/dos.conf checked for syntax only"
    systemd-tmpfiles --root="$tmp/root" --cat-config >/dev/null 2>&1 || true
  fi
fi
