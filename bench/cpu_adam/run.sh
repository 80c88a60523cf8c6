#!/usr/bin/env bash
# run.sh OUTDIR MACHINE [extra dos_bench_cpu_adam flags, e.g. --quick]
# Runs the DOS CPU Adam benchmark and PyTorch's CPU AdamW on the same size and
# thread count, into OUTDIR/cpu_adam_MACHINE_DATE.json. The binary is looked up
# as $DOS_BENCH_BIN, else next to this script's build (build-cpu, build), else
# on PATH; on the GPU machine set LD_LIBRARY_PATH to the bundled libtbb.
set -euo pipefail
outdir=${1:?usage: run.sh OUTDIR MACHINE [flags]}
machine=${2:?usage: run.sh OUTDIR MACHINE [flags]}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${DOS_BENCH_BIN:-}
if [ -z "$bin" ]; then
  for c in "$root/build-cpu/bench/cpu_adam/dos_bench_cpu_adam" \
           "$root/build/bench/cpu_adam/dos_bench_cpu_adam" "$(command -v dos_bench_cpu_adam || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then bin=$c; break; fi
  done
fi
[ -n "$bin" ] || { echo "run.sh: dos_bench_cpu_adam not found; set DOS_BENCH_BIN" >&2; exit 1; }
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
mkdir -p "$outdir"
json="$outdir/cpu_adam_${machine}_$(date -u +%Y-%m-%d).json"
threads=$(nproc)
"$bin" --machine="$machine" --out="$json" --commit="$commit" "$@"
quick=()
for a in "$@"; do [ "$a" = "--quick" ] && quick=(--quick); done
params=()
for a in "$@"; do case "$a" in --params=*) params=(--params="${a#--params=}");; esac; done
py=${PYTHON:-python3}
"$py" "$here/torch_fused_cpu.py" --json="$json" --threads="$threads" "${quick[@]}" "${params[@]}"
echo "run.sh: results in $json"
