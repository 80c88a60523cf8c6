#!/usr/bin/env bash
# Issue 27 on nvidia-h200-x2 (one device call per line below, each under the
# 10-minute limit), from an install in .dist (bench/make_dist.sh):
#
#   bash bench/e2e/run_fsdp_x2.sh OUT 20b,reference           # ~8 min
#   bash bench/e2e/run_fsdp_x2.sh OUT largest_fp32,largest_compact   # ~9 min
#
# Parts (bench/e2e/fsdp_scale.py under torchrun, one rank per GPU, FSDP2):
#   20b              the 48 x 6144 GPT (22.1B), compact state in one dosd
#   20b_fp32         the same with fp32 state (needs 12 B a parameter of host memory: ~270 GB)
#   reference        all on the GPUs, FSDP2 with fp32 masters + torch.optim.AdamW(fused=True)
#                    at REF_LAYERS (28) x 6144 (13.1B: the 20B does not fit at ~16 B a
#                    parameter), then bf16 parameters and state at the 20B shape
#   largest_fp32, largest_compact
#                    the largest size --plan-largest's arithmetic allows (this node's
#                    MemAvailable against 12 or 8 bytes a parameter in dosd), dosd with
#                    --host_memory_limit at the state it allows; one step down (6%) on failure
#
# Every DOS part gets a fresh dosd. Results merge into
# bench/results/fsdp_<machine>_<date>_<tag>.json (tag: TAG, default "20b" for
# 20b/reference parts, "largest" for the largest parts) and its PNG; OUT gets
# fsdp.log and fsdp_results.tgz (result files, the plan, GPUs, memory, dosd's log tail).
# Environment: DOS_MACHINE (nvidia-h200-x2), NPROC (the GPUs), REF_LAYERS, ARGS (more
# fsdp_scale.py flags for every run, e.g. "--batch 4").
set -u
O=${1:?out dir}; PARTS=${2:-20b,reference}
DIST=$PWD/.dist; B=$DIST/bin
export LD_LIBRARY_PATH=$DIST/lib DOS_CLIENT_LIB=$DIST/lib/libdos_client.so DOS_DOSCTL=$B/dosctl
export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# NVLink multicast stays off (the machines' rule, KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DOS_MACHINE=${DOS_MACHINE:-nvidia-h200-x2}
NP=${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
mkdir -p "$O"
W=/tmp/fsdp-x2; rm -rf $W; mkdir -p $W
L=$O/fsdp.log
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > $W/gpus.txt 2>&1
sock=/tmp/dos-fsdp.sock
dpid=

log() { echo "$*" | tee -a "$L"; }
meminfo() { log "$(date -u +%T) $1: $(grep -E '^MemAvailable' /proc/meminfo)"; }

start_dosd() {  # dosd flags...
  rm -f $sock
  "$B/dosd" --socket=$sock "$@" >> $W/dosd.log 2>&1 &
  dpid=$!
  export DOS_DOSD_PID=$dpid
  for _ in $(seq 300); do [ -S $sock ] && return 0; sleep 0.1; done
  log "dosd did not start listening"; return 1
}

stop_dosd() {
  [ -n "$dpid" ] || return 0
  "$B/dosctl" --socket=$sock stats >> "$L" 2>&1
  kill $dpid; wait $dpid; log "dosd exit=$?"; dpid=
  meminfo "after dosd"
}

train() {  # timeout_s, fsdp_scale.py flags...
  local t=$1; shift
  log "== $(date -u +%T) fsdp_scale.py $* (timeout $t s)"
  timeout $t torchrun --standalone --nproc_per_node=$NP bench/e2e/fsdp_scale.py --wrap fsdp2 \
    --socket $sock --tag "$tag" ${ARGS:-} "$@" >> "$L" 2>&1
  local rc=$?; log "exit=$rc"; return $rc
}

largest() {  # fp32|compact
  local fmt=$1 plan layers limit
  meminfo "plan $fmt"
  python3 bench/e2e/fsdp_scale.py --plan-largest --world $NP ${ARGS:-} > $W/plan_$fmt.txt 2>&1
  cat $W/plan_$fmt.txt >> "$L"
  plan=$(tail -1 $W/plan_$fmt.txt)
  layers=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['formats']['$fmt']['layers'])" "$plan")
  limit=$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['state_limit_bytes'])" "$plan")
  for try in 1 2; do
    start_dosd --host_memory_limit=$((limit + (64 << 20))) || return 1
    train 280 --optimizer $fmt --layers $layers --label largest_$fmt --warmup 2 --iters 10
    local rc=$?
    stop_dosd
    [ $rc = 0 ] && return 0
    layers=$((layers - (layers * 6 + 99) / 100))
    log "largest_$fmt: failed; stepping down to $layers layers"
  done
}

IFS=, read -ra parts <<< "$PARTS"
for part in "${parts[@]}"; do
  case "$part" in
    20b|20b_fp32|reference) tag=${TAG:-20b} ;;
    *) tag=${TAG:-largest} ;;
  esac
  meminfo "start $part"
  case "$part" in
    20b)
      start_dosd && train 420 --optimizer compact
      stop_dosd ;;
    20b_fp32)
      start_dosd && train 420 --optimizer fp32
      stop_dosd ;;
    reference)
      train 170 --optimizer reference --layers ${REF_LAYERS:-28}
      train 170 --optimizer reference_bf16 ;;
    largest_fp32) largest fp32 ;;
    largest_compact) largest compact ;;
    *) log "unknown part $part" ;;
  esac
done
cp bench/results/fsdp_${DOS_MACHINE}_* $W/ 2>/dev/null
free -g > $W/free.txt; cat /proc/meminfo >> $W/free.txt
tail -c 20000 $W/dosd.log > $W/dosd_tail.log 2>/dev/null; rm -f $W/dosd.log
tar czf "$O/fsdp_results.tgz" -C $W .
ls -la "$O"; tail -40 "$L"
