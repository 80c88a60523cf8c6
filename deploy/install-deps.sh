#!/usr/bin/env bash
# Installs the Debian 12 packages DOS builds and tests with. Idempotent: does
# nothing when everything is present. Needs root (or sudo) for apt-get.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libtbb-dev libboost-dev libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-pytest python3-numpy systemd
  python3-pip python3-venv python3-setuptools python3-wheel  # the Python package (tests/python_package)
  clang libclang-rt-dev  # the libFuzzer targets (tests/run_fuzz.sh); libFuzzer is in libclang-rt
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
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
