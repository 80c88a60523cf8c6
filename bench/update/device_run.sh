#!/usr/bin/env bash
# One GPU-machine session (device tool): the `gpu` tests run from an install
# in $DIST (.dist), the Python CUDA test, then the update benchmark; logs and
# results into $1.
#   bash bench/update/device_run.sh OUT_DIR
set -u
O=${1:?out}; export DIST=$PWD/.dist; export LD_LIBRARY_PATH=$DIST/lib; B=$DIST/bin
export DOS_DOSD=$B/dosd DOS_GPU_DOOMED_TRAINER=$B/gpu_doomed_trainer
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/tests.log
{
echo "== gpu_adam_test"; timeout ${T_ADAM:-45} $B/gpu_adam_test > /tmp/adam.log 2>&1; echo "exit=$?"
grep -E 'differ|n=|Failure' /tmp/adam.log | head -24; tail -4 /tmp/adam.log
echo "== gpu_ipc_test"; timeout ${T_IPC:-100} $B/gpu_ipc_test 2>&1 | tail -40
echo "== pytest test_cuda.py"
PYTHONPATH=$PWD/client/python DOS_CLIENT_LIB=$DIST/lib/libdos_client.so PYTHONUNBUFFERED=1 \
  timeout ${T_PY:-100} python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda.py 2>&1 | tail -40
} >> $O/tests.log 2>&1
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout ${T_BENCH:-300} bash bench/update/run.sh /tmp/upd nvidia-h200 ${PARAMS:-2e9} ${SUBGROUP:-1e8} > $O/bench.log 2>&1
grep -E 'gpu.step|error|warn' /tmp/upd/dosd.log | tail -20 >> $O/bench.log
cp /tmp/upd/update_nvidia-h200_*.json /tmp/upd/update_timeline_*.png $O/ 2>/dev/null
cat /tmp/upd/probe.json /tmp/upd/policies.jsonl > $O/raw.jsonl 2>/dev/null
cp /tmp/upd/timeline.jsonl $O/ 2>/dev/null
ls -la $O
