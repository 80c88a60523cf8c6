#!/usr/bin/env bash
# Update-phase benchmark on a GPU machine (bench/update/README.md).
#   bash bench/update/run.sh OUT_DIR MACHINE [PARAMS] [SUBGROUP]
# Expects dosd, dos_bench_update_trainer and dos_bench_update_probe in
# $DIST/bin (default .dist/bin) and their libraries in $DIST/lib.
set -u
OUT=${1:?out dir}; MACHINE=${2:-nvidia-h200}; PARAMS=${3:-2e9}; SUBGROUP=${4:-1e8}
DIST=${DIST:-$PWD/.dist}; BIN=$DIST/bin
export LD_LIBRARY_PATH=$DIST/lib:${LD_LIBRARY_PATH:-}
mkdir -p "$OUT"
SOCK=/tmp/dos-bench.sock
run_daemon() {  # $1: extra flags; leaves DPID set
  rm -f $SOCK
  $BIN/dosd --socket=$SOCK --log_level=info --model_host_gbps=$MHOST $1 2>>"$OUT/dosd.log" &
  DPID=$!
  for i in $(seq 100); do [ -S $SOCK ] && break; sleep 0.1; done
}
stop_daemon() { kill -TERM $DPID; wait $DPID; }

echo "== probe"; $BIN/dos_bench_update_probe | tee "$OUT/probe.json"
# The daemon's model starts from the M_host measured here, so its predictions
# and the printed bound use the same input.
MHOST=$(python3 -c "import json;print(json.load(open('$OUT/probe.json'))['m_host_gbps'])" 2>/dev/null || echo 0)
echo "== policies (all state on host)"
run_daemon "--gpu_timeline=$OUT/timeline.jsonl"
$BIN/dos_bench_update_trainer --socket=$SOCK --params=$PARAMS --subgroup=$SUBGROUP --steps=${STEPS:-5} \
  --policies=cpu,static:0.5,interleave:2,interleave:3,interleave:4,auto --out="$OUT/policies.jsonl"
stop_daemon
echo "== cpu path with fp32-cast gradients"
run_daemon "--gpu_cpu_grad_fp32"
$BIN/dos_bench_update_trainer --socket=$SOCK --params=$PARAMS --subgroup=$SUBGROUP --steps=3 \
  --policies=cpu --label=fp32grads --out="$OUT/policies.jsonl"
stop_daemon
echo "== compact state (bf16 moments, 8 bytes a parameter), all state on host"
run_daemon ""
$BIN/dos_bench_update_trainer --socket=$SOCK --params=$PARAMS --subgroup=$SUBGROUP --steps=${STEPS:-5} \
  --policies=cpu,auto --state_format=compact --label=compact --out="$OUT/policies.jsonl"
stop_daemon
echo "== auto with half the state as GPU budget"
HALF=$(python3 -c "print(int(float('$PARAMS')*12/2))")
run_daemon "--gpu_memory_budget=$HALF"
$BIN/dos_bench_update_trainer --socket=$SOCK --params=$PARAMS --subgroup=$SUBGROUP --steps=${STEPS:-5} \
  --policies=auto --label=halfbudget --out="$OUT/policies.jsonl"
stop_daemon
python3 "$(dirname "$0")/report.py" "$OUT" "$MACHINE"
