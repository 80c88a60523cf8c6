#!/usr/bin/env bash
# Installs the Debian 12 packages DOS builds, tests and packages with.
# Idempotent: does nothing when everything is present. Needs root (or sudo)
# for apt-get. When another apt-get or dpkg holds the package manager's lock
# (a fresh machine often runs one at boot), it says so and waits for it, up to
# DOS_APT_LOCK_TIMEOUT seconds (default 900), instead of failing.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libtbb-dev libboost-dev libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-pytest python3-numpy systemd
  python3-pip python3-venv python3-setuptools python3-wheel  # the Python package (tests/python_package)
  clang libclang-rt-dev  # the libFuzzer targets (tests/run_fuzz.sh); libFuzzer is in libclang-rt
  dpkg-dev lintian help2man  # the Debian package: dpkg-shlibdeps, lintian, man pages
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive

timeout_s=${DOS_APT_LOCK_TIMEOUT:-900}
deadline=$((SECONDS + timeout_s))
# apt_locked CMD...: runs an apt-get command; while it fails because another
# process holds the dpkg frontend lock, the dpkg lock, the lists lock or the
# archives lock, waits for that process and tries again, until the deadline.
apt_locked() {
  local out rc
  out=$(mktemp)
  while :; do
    rc=0
    # apt waits for the dpkg lock itself (DPkg::Lock::Timeout) but not for the
    # lists lock of `apt-get update`, hence the loop.
    "${sudo_cmd[@]}" "$@" -o DPkg::Lock::Timeout=$((deadline - SECONDS > 0 ? deadline - SECONDS : 0)) \
      2>&1 | tee "$out" || rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then rm -f "$out"; return 0; fi
    if ! grep -qE 'Could not get lock|Unable to acquire the dpkg frontend lock|Unable to lock' "$out"; then
      rm -f "$out"
      return "$rc"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "install-deps: the package manager's lock is still held after ${timeout_s} s:" >&2
      grep -E 'lock|held by' "$out" >&2 || true
      echo "install-deps: wait for that apt-get/dpkg to finish (ps aux | grep -E 'apt|dpkg')," \
           "or raise DOS_APT_LOCK_TIMEOUT, then run this again" >&2
      rm -f "$out"
      return "$rc"
    fi
    local holder
    holder=$(grep -oE 'held by process [0-9]+( \([^)]*\))?' "$out" | head -n1 || true)
    echo "install-deps: another package manager holds the lock${holder:+ ($holder)};" \
         "waiting for it ($((deadline - SECONDS)) s left of DOS_APT_LOCK_TIMEOUT=${timeout_s})"
    sleep "${DOS_APT_LOCK_POLL:-5}"  # polling the lock: apt offers no wait for the lists lock
  done
}
apt_locked apt-get update -q
apt_locked apt-get install -y -q --no-install-recommends "${missing[@]}"
