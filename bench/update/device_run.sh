#!/usr/bin/env bash
# One GPU-machine session: GPU tests, CUDA IPC checks, the update benchmark
# and (if built) the CPU kernel benchmark; results into $1.
set -u
O=${1:?out}; export DIST=$PWD/.dist; export LD_LIBRARY_PATH=$DIST/lib; B=$DIST/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $O/gpu_test.log
[ -n "${SKIP_TESTS:-}" ] || timeout 240 $B/gpu_adam_test 2>&1 | tail -40 >> $O/gpu_test.log
# IPC registration errors and a trainer killed mid-step.
S=/tmp/dos-ipc.sock; rm -f $S
$B/dosd --socket=$S 2>/tmp/ipc_dosd.log & D=$!
for i in $(seq 100); do [ -S $S ] && break; sleep 0.1; done
{
for m in bad_uuid bad_range bad_dtype; do $B/dos_bench_update_trainer --socket=$S --params=1e6 --mode=$m; echo "exit=$?"; done
$B/dos_bench_update_trainer --socket=$S --params=4e8 --subgroup=1e8 --mode=die_mid_step; echo "die_mid_step exit=$?"
sleep 1
$B/dos_bench_update_trainer --socket=$S --params=4e8 --subgroup=1e8 --steps=3 --policies=auto,interleave:2; echo "after-kill trainer exit=$? daemon alive: $(kill -0 $D && echo yes)"
} > $O/ipc_checks.log 2>&1
kill -TERM $D; wait $D; echo "dosd exit=$?" >> $O/ipc_checks.log; tail -20 /tmp/ipc_dosd.log >> $O/ipc_checks.log
# Update-phase benchmark.
timeout 420 bash bench/update/run.sh /tmp/upd nvidia-h200 ${PARAMS:-2e9} ${SUBGROUP:-1e8} > $O/bench.log 2>&1
tail -30 /tmp/upd/dosd.log >> $O/bench.log
cp /tmp/upd/update_nvidia-h200_*.json /tmp/upd/update_timeline_*.png $O/ 2>/dev/null
cat /tmp/upd/probe.json /tmp/upd/policies.jsonl > $O/raw.jsonl 2>/dev/null
if [ -n "${CPU_ADAM:-}" ] && [ -x $B/dos_bench_cpu_adam ]; then DOS_BENCH_BIN=$B/dos_bench_cpu_adam timeout 200 bash bench/cpu_adam/run.sh $O nvidia-h200 > $O/cpu_adam.log 2>&1; fi
ls -la $O
