#!/usr/bin/env bash
# Installs dosd as a systemd service: binaries, unit, sysusers/tmpfiles
# entries, the flagfile; creates the dos user and directories; reloads systemd
# and enables the unit. Idempotent: a second run changes nothing (an existing
# /etc/dos/dosd.flags is never overwritten). Upgrades: build, run again with
# --now (restarts a running dosd; trainers re-attach).
#
#   deploy/install.sh [--prefix DIR] [--build-dir DIR] [--root DIR] [--now] [--dry-run]
#
#   --prefix DIR     where binaries go (default /usr/local: /usr/local/bin/dosd)
#   --build-dir DIR  the CMake build to install from (default ./build)
#   --root DIR       install under DIR (a package staging tree); no systemctl
#   --now            start dosd, or restart it if it runs
#   --dry-run        print what would be done, change nothing
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=/usr/local
build_dir=$here/../build
root=
now=0
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --build-dir=*) build_dir=${1#*=}; shift ;;
    --root) root=$2; shift 2 ;;
    --root=*) root=${1#*=}; shift ;;
    --now) now=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be absolute" >&2; exit 2 ;; esac

run() {
  echo "+ $*"
  [ "$dry" -eq 1 ] || "$@"
}
# install_file SRC DEST MODE: copies only when the content or mode differs.
install_file() {
  local src=$1 dest=$root$2 mode=$3
  if [ -f "$dest" ] && cmp -s "$src" "$dest" && [ "$(stat -c %a "$dest")" = "${mode#0}" ]; then
    echo "  unchanged $dest"
    return
  fi
  run install -D -m "$mode" "$src" "$dest"
}

dosd=$build_dir/daemon/dosd
if [ ! -x "$dosd" ]; then
  echo "install.sh: $dosd not found; build first (deploy/build.sh) or pass --build-dir" >&2
  exit 1
fi
dosctl=$(find "$build_dir" -maxdepth 3 -type f -name dosctl -perm -u+x 2>/dev/null | head -n1 || true)

install_file "$dosd" "$prefix/bin/dosd" 0755
[ -n "$dosctl" ] && install_file "$dosctl" "$prefix/bin/dosctl" 0755

# The unit with ExecStart pointing at this prefix.
unit_tmp=$(mktemp)
trap 'rm -f "$unit_tmp"' EXIT
sed "s|^ExecStart=/usr/local/bin/dosd |ExecStart=$prefix/bin/dosd |" \
  "$here/systemd/dosd.service" > "$unit_tmp"
install_file "$unit_tmp" /etc/systemd/system/dosd.service 0644
install_file "$here/sysusers.d/dos.conf" /etc/sysusers.d/dos.conf 0644
install_file "$here/tmpfiles.d/dos.conf" /etc/tmpfiles.d/dos.conf 0644
install_file "$here/dos/dosd.flags" /etc/dos/dosd.flags.example 0644
if [ -e "$root/etc/dos/dosd.flags" ]; then
  echo "  kept existing $root/etc/dos/dosd.flags (compare with dosd.flags.example)"
else
  install_file "$here/dos/dosd.flags" /etc/dos/dosd.flags 0644
fi
[ -f "$here/../README.md" ] && install_file "$here/../README.md" "$prefix/share/doc/dos/README.md" 0644
for doc in "$here"/../docs/*.md; do  # the README's links lead into docs/
  [ -f "$doc" ] && install_file "$doc" "$prefix/share/doc/dos/docs/$(basename "$doc")" 0644
done

if [ -n "$root" ]; then
  echo "install.sh: staged under $root; run systemd-sysusers, systemd-tmpfiles --create and"
  echo "  systemctl daemon-reload && systemctl enable dosd on the target system"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] && [ "$dry" -eq 0 ]; then
  echo "install.sh: files installed; creating the dos user and enabling the unit needs root" >&2
  exit 1
fi
run systemd-sysusers /etc/sysusers.d/dos.conf
run systemd-tmpfiles --create /etc/tmpfiles.d/dos.conf
if [ ! -d /run/systemd/system ]; then
  echo "install.sh: systemd is not running here (container?); not enabling dosd.service"
  exit 0
fi
run systemctl daemon-reload
run systemctl enable dosd.service
if [ "$now" -eq 1 ]; then
  if systemctl is-active --quiet dosd.service; then
    run systemctl restart dosd.service
  else
    run systemctl start dosd.service
  fi
fi
echo "install.sh: done. Add trainer users to the dos group (usermod -aG dos USER);"
echo "  configure /etc/dos/dosd.flags; start with systemctl start dosd; logs: journalctl -u dosd"
