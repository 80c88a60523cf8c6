#!/usr/bin/env bash
# What one GPU-machine call runs for registration times, from binaries in
# DIST (bin/dosd, bin/dos_bench_register, lib/ with the bundled libraries):
#
#   bash bench/register/device_run.sh DIST OUT [PARAMS]
#
# PARAMS defaults to 6B (~72 GB of fp32 state, the 5.9B e2e model's size
# rounded up). Runs the default dosd twice in a row (the first registration
# also pays for host memory the machine hands out for the first time), then
# one registration with 4 KiB pages (--state_huge_pages=false). JSON per
# variant in OUT. (The pinning variants of 2026-11-30 used dosd flags
# --pin_whole / --pin_threads, since folded into GpuEngineOptions.)
set -u
DIST=${1:?dist dir}; O=${2:?out dir}; P=${3:-6B}
export LD_LIBRARY_PATH=$DIST/lib
label=$(echo "$P" | tr 'A-Z.' 'a-z_')
mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$O/gpu.txt" 2>&1
{ nproc; grep -E 'MemTotal|Hugepagesize' /proc/meminfo;
  cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag;
  ulimit -l; } >> "$O/gpu.txt" 2>&1
run() {  # name repeat dosd-flags...
  local name=$1 rep=$2; shift 2
  local args=()
  for a in "$@"; do args+=(--dosd_arg "$a"); done
  echo "== $name"
  timeout 240 "$DIST/bin/dos_bench_register" --dosd "$DIST/bin/dosd" --params "$P" \
    --device cuda --repeat "$rep" --label "$label" --machine nvidia-h200 \
    --out "$O/register_${name}.json" "${args[@]}" --dosd_arg --log_level=warning
  echo "exit=$?"
}
run default 2
run no_huge_pages 1 --state_huge_pages=false
