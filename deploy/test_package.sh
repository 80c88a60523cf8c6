#!/usr/bin/env bash
# The Debian package test (ctest deb_package, label package): builds dos and
# dos-dev with CPack, runs lintian (no errors allowed), installs both with
# dpkg -i and checks the files, the versions, the soname, the conffile, the
# computed dependencies, the dos user, the unit (systemd-analyze verify, enabled
# and not started), a program built against dos-dev and a dosd run; then
# dpkg -r (only the conffile stays) and dpkg -P (nothing stays; the dos user
# and group do, as Debian policy says).
#
# It installs packages on the machine it runs on, so it runs only with
# DOS_TEST_PACKAGE=1 (tests/run_all.sh's package stage sets it); else exit 77
# (ctest: Skipped). Needs root, dpkg-dev (dpkg-shlibdeps) and lintian.
#
#   DOS_TEST_PACKAGE=1 deploy/test_package.sh BUILD_DIR
set -euo pipefail
build=$(realpath "${1:?usage: test_package.sh BUILD_DIR}")
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
[ "${DOS_TEST_PACKAGE:-0}" = 1 ] ||
  skip "installs the .deb on this machine; run with DOS_TEST_PACKAGE=1 (tests/run_all.sh does)"
[ "$(id -u)" -eq 0 ] || skip "dpkg -i needs root"
for tool in cpack dpkg dpkg-shlibdeps lintian systemd-analyze; do
  command -v "$tool" >/dev/null || fail "$tool not installed (bash deploy/install-deps.sh)"
done
# (Output captured before grep -q: with pipefail, a writer cut off by grep's early exit
# (SIGPIPE) would fail the pipeline.)
if grep -q "ok installed" <<<"$(dpkg-query -W -f='${Status}' dos 2>/dev/null || true)"; then
  skip "a dos package is installed on this machine already; not replacing it"
fi
version=$(sed -n 's/^#define DOS_VERSION_STRING "\(.*\)"$/\1/p' "$build/include/dos/version.h")
[ -n "$version" ] || fail "no DOS_VERSION_STRING in $build/include/dos/version.h"

tmp=$(mktemp -d /tmp/dos-package-test.XXXXXX)
installed=0
cleanup() {
  if [ "$installed" -eq 1 ]; then dpkg -P dos-dev dos >/dev/null 2>&1 || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

echo "== cpack -G DEB"
(cd "$build" && cpack -G DEB -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1) ||
  { cat "$tmp/cpack.log"; fail "cpack -G DEB failed"; }
deb=$(ls "$tmp"/pkg/dos_"$version"_*.deb)
dev=$(ls "$tmp"/pkg/dos-dev_"$version"_*.deb)
echo "built $(basename "$deb") $(basename "$dev")"

echo "== lintian"
lintian --fail-on error --suppress-tags-from-file /dev/null "$deb" "$dev" | tee "$tmp/lintian.log" ||
  fail "lintian reports errors (E: lines above)"

echo "== control fields"
depends=$(dpkg-deb -f "$deb" Depends)
echo "Depends: $depends"
grep -q 'libgrpc++' <<<"$depends" || fail "Depends lacks the gRPC runtime (dpkg-shlibdeps)"
grep -q 'libc6' <<<"$depends" || fail "Depends lacks libc6 (dpkg-shlibdeps)"
if grep -qi 'cuda' <<<"$depends"; then fail "Depends names a CUDA package: $depends"; fi
grep -qx /etc/dos/dosd.flags <<<"$(dpkg-deb -I "$deb" conffiles)" ||
  fail "/etc/dos/dosd.flags not a conffile"

echo "== dpkg -i"
installed=1
dpkg -i "$deb" "$dev" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "dpkg -i failed"; }
[ "$(dosd --version)" = "dosd $version" ] || fail "dosd --version: $(dosd --version)"
[ "$(dosctl --version)" = "dosctl $version" ] || fail "dosctl --version: $(dosctl --version)"
help=$(dosd --help) || fail "dosd --help exited $?"
grep -q -- '--host_memory_limit' <<<"$help" || fail "dosd --help lists no flags"
help=$(dosctl -h) || fail "dosctl -h exited $?"
grep -q -- 'sessions' <<<"$help" || fail "dosctl -h shows no commands"
for f in /usr/bin/dosd /usr/bin/dosctl /usr/lib/libdos_client.so.1 /usr/lib/libdos_client.so \
         /usr/include/dos/dos.h /usr/include/dos/dos.hpp /usr/include/dos/version.h \
         /lib/systemd/system/dosd.service /usr/lib/sysusers.d/dos.conf \
         /usr/lib/tmpfiles.d/dos.conf /etc/dos/dosd.flags /usr/share/doc/dos/copyright; do
  [ -e "$f" ] || fail "$f not installed"
done
# Man pages: in the package (a container's dpkg may be told to skip /usr/share/man).
contents=$(dpkg-deb -c "$deb")
for f in ./usr/share/man/man1/dosd.1.gz ./usr/share/man/man1/dosctl.1.gz; do
  grep -q " $f\$" <<<"$contents" || fail "$f not in the package (help2man missing at build?)"
done
[ "$(readlink /usr/lib/libdos_client.so.1)" = "libdos_client.so.$version" ] ||
  fail "libdos_client.so.1 does not link to libdos_client.so.$version"
grep -q 'SONAME *libdos_client.so.1$' <<<"$(objdump -p /usr/lib/libdos_client.so.1)" ||
  fail "libdos_client's SONAME is not libdos_client.so.1"
getent passwd dos >/dev/null || fail "postinst did not create the dos user"
getent group dos >/dev/null || fail "postinst did not create the dos group"
[ -d /var/lib/dos/checkpoints ] || fail "postinst did not create /var/lib/dos/checkpoints"
[ -L /etc/systemd/system/multi-user.target.wants/dosd.service ] ||
  fail "dosd.service not enabled (deb-systemd-helper)"
if [ -d /run/systemd/system ] && systemctl is-active --quiet dosd.service; then
  fail "dosd.service was started by the install (it must only be enabled)"
fi

echo "== systemd-analyze verify"
out=$(systemd-analyze verify --man=no /lib/systemd/system/dosd.service 2>&1) ||
  { echo "$out"; fail "systemd-analyze verify failed"; }
if grep -F "dosd.service" <<<"$out"; then fail "systemd-analyze verify warns about dosd.service"; fi
grep -qx 'ExecStart=/usr/bin/dosd --flagfile=/etc/dos/dosd.flags' /lib/systemd/system/dosd.service ||
  fail "the packaged unit does not run /usr/bin/dosd"

echo "== the library from its system path"
cat > "$tmp/v.c" <<'C'
#include <dos/dos.h>
#include <dos/version.h>
#include <stdio.h>
#include <string.h>
int main(void) {
  printf("%s\n", dos_version());
  return strcmp(dos_version(), DOS_VERSION_STRING) != 0;
}
C
cc -o "$tmp/v" "$tmp/v.c" -ldos_client || fail "cannot build against dos-dev"
[ "$("$tmp/v")" = "$version" ] || fail "dos_version() says $("$tmp/v")"

echo "== the installed dosd serves"
dosd --socket="$tmp/dosd.sock" --checkpoint_dir= 2>"$tmp/dosd.log" &
pid=$!
for _ in $(seq 400); do [ -S "$tmp/dosd.sock" ] && break; sleep 0.05; done
status=$(dosctl --socket="$tmp/dosd.sock" --json status) || true
grep -q "\"daemon_version\": \"$version\"" <<<"$status" ||
  { cat "$tmp/dosd.log"; kill "$pid"; fail "dosctl status against the installed dosd"; }
kill -TERM "$pid"
wait "$pid" || fail "dosd did not exit 0 on SIGTERM"

echo "== dpkg -r"
dpkg -r dos-dev dos >"$tmp/remove.log" 2>&1 || { cat "$tmp/remove.log"; fail "dpkg -r failed"; }
for f in /usr/bin/dosd /usr/bin/dosctl /usr/lib/libdos_client.so.1 /usr/include/dos \
         /lib/systemd/system/dosd.service /etc/systemd/system/multi-user.target.wants/dosd.service; do
  [ ! -e "$f" ] || fail "dpkg -r left $f"
done
[ -f /etc/dos/dosd.flags ] || fail "dpkg -r removed the conffile (it stays until purge)"

echo "== dpkg -P"
dpkg -P dos-dev dos >"$tmp/purge.log" 2>&1 || { cat "$tmp/purge.log"; fail "dpkg -P failed"; }
installed=0
for f in /etc/dos /run/dos /usr/include/dos /usr/share/doc/dos /usr/share/doc/dos-dev \
         /etc/systemd/system/dosd.service /etc/systemd/system/multi-user.target.wants/dosd.service; do
  [ ! -e "$f" ] && [ ! -L "$f" ] || fail "dpkg -P left $f"
done
# /var/lib/dos: the postrm removes it. A root-owned one appearing again is some
# other dosd on this machine with an old default (not the package's, whose
# folders belong to dos).
if [ -e /var/lib/dos ] && [ "$(stat -c %U /var/lib/dos)" = dos ]; then fail "dpkg -P left /var/lib/dos"; fi
# Every file the two packages shipped is gone.
left=$( (dpkg-deb -c "$deb"; dpkg-deb -c "$dev") | awk '$1 !~ /^d/ {print substr($6, 2)}' |
        while read -r f; do if [ -e "$f" ] || [ -L "$f" ]; then echo "$f"; fi; done)
[ -z "$left" ] || fail "dpkg -P left: $left"
getent passwd dos >/dev/null || fail "purge removed the dos user (policy: keep it)"
echo "ok: dos $version packaged, lintian clean, installed, checked, removed and purged"
