#!/usr/bin/env bash
# Stops, disables and removes dosd and its unit and config snippets.
# Idempotent. Keeps /etc/dos/dosd.flags, the checkpoints in /var/lib/dos and
# the dos user unless --purge.
#
#   deploy/uninstall.sh [--prefix DIR] [--root DIR] [--purge] [--dry-run]
set -euo pipefail
prefix=/usr/local
root=
purge=0
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --root) root=$2; shift 2 ;;
    --root=*) root=${1#*=}; shift ;;
    --purge) purge=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "uninstall.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

run() {
  echo "+ $*"
  [ "$dry" -eq 1 ] || "$@"
}
remove() {
  if [ -e "$root$1" ] || [ -L "$root$1" ]; then run rm -f "$root$1"; else echo "  absent $root$1"; fi
}

if [ -z "$root" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
  if systemctl list-unit-files dosd.service >/dev/null 2>&1 &&
     systemctl cat dosd.service >/dev/null 2>&1; then
    run systemctl disable --now dosd.service || true
  fi
fi
remove "$prefix/bin/dosd"
remove "$prefix/bin/dosctl"
remove /etc/systemd/system/dosd.service
remove /etc/sysusers.d/dos.conf
remove /etc/tmpfiles.d/dos.conf
remove /etc/dos/dosd.flags.example
remove "$prefix/share/doc/dos/README.md"
for doc in "$root$prefix"/share/doc/dos/docs/*.md; do
  [ -f "$doc" ] && remove "${doc#"$root"}"
done
if [ -d "$root$prefix/share/doc/dos/docs" ]; then run rmdir --ignore-fail-on-non-empty "$root$prefix/share/doc/dos/docs"; fi
if [ -z "$root" ] && [ -d /run/systemd/system ]; then run systemctl daemon-reload; fi
if [ "$purge" -eq 1 ]; then
  remove /etc/dos/dosd.flags
  if [ -d "$root/etc/dos" ]; then run rmdir --ignore-fail-on-non-empty "$root/etc/dos"; fi
  if [ -d "$root/var/lib/dos" ]; then run rm -rf "$root/var/lib/dos"; fi
  if [ -z "$root" ] && getent passwd dos >/dev/null; then run userdel dos || true; fi
  if [ -z "$root" ] && getent group dos >/dev/null; then run groupdel dos || true; fi
else
  echo "uninstall.sh: kept /etc/dos/dosd.flags and /var/lib/dos (checkpoints); --purge removes them"
fi
