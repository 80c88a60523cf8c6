#!/usr/bin/env bash
# Two "nodes" on one machine, each with its own dosd, against the same job on one node:
#
#   client/python/examples/multinode_localhost.sh --dosd PATH [--device cpu|cuda] [--wrap ddp|fsdp2]
#                                                 [--steps N] [--out DIR]
#
# Node i: its own dosd on its own socket, and `torchrun --nnodes=2 --node_rank=i
# --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT` with DOS_SOCKET set to
# that socket, exactly as on two machines (see multinode.py). With --device cuda each node gets
# one GPU (CUDA_VISIBLE_DEVICES=i for its dosd and its rank) and the ranks talk NCCL; with cpu,
# gloo. Then the same job with both ranks on one node and one dosd; the per-rank losses and
# final weights must be equal bit for bit (exit 0, "multinode compare: ... EQUAL").
set -u
dosd="" device=cpu wrap=ddp steps=20 out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dosd) dosd=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --wrap) wrap=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$dosd" ] || { echo "--dosd must name the dosd binary" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$here/..${PYTHONPATH:+:$PYTHONPATH}
out=${out:-$(mktemp -d /tmp/dos-multinode-XXXXXX)}
mkdir -p "$out"
# torch 1.13's torchrun cannot parse its own default --redirects/--tee under Python 3.11.
compat=$(python3 -c 'import torch; print("--redirects=1 --tee=2" if int(torch.__version__.split(".")[0]) < 2 else "")')
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

start_dosd() {  # start_dosd SOCKET LOG [CUDA_VISIBLE_DEVICES]
  if [ -n "${3:-}" ]; then
    CUDA_VISIBLE_DEVICES=$3 "$dosd" --socket="$1" > "$2" 2>&1 &
  else
    "$dosd" --socket="$1" > "$2" 2>&1 &
  fi
  pids+=($!)
  for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done
  echo "dosd on $1 did not start; its log:" >&2; cat "$2" >&2; exit 1
}

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
agents=()
for node in 0 1; do
  gpu=""; [ "$device" = cuda ] && gpu=$node
  start_dosd "$out/node$node.sock" "$out/dosd-node$node.log" "$gpu"
  (
    [ -n "$gpu" ] && export CUDA_VISIBLE_DEVICES=$gpu
    DOS_SOCKET=$out/node$node.sock exec python3 -m torch.distributed.run --nnodes=2 \
      --node_rank=$node --nproc_per_node=1 --rdzv_backend=c10d \
      --rdzv_endpoint=127.0.0.1:$port --rdzv_id=dos-multinode-$port --max_restarts=0 $compat \
      "$here/multinode.py" --wrap "$wrap" --device "$device" --steps "$steps" --out "$out/two-nodes"
  ) > "$out/node$node.log" 2>&1 &
  agents+=($!)
done
rc=0
for a in "${agents[@]}"; do wait "$a" || rc=$?; done
[ $rc -eq 0 ] || { echo "two-node run failed ($rc); logs in $out"; tail -30 "$out"/node*.log; exit 1; }
echo "two nodes: done (logs in $out)"

start_dosd "$out/one.sock" "$out/dosd-one.log"
DOS_SOCKET=$out/one.sock python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  --max_restarts=0 $compat "$here/multinode.py" --wrap "$wrap" --device "$device" \
  --steps "$steps" --out "$out/one-node" > "$out/one-node.log" 2>&1 \
  || { echo "one-node run failed; log:"; tail -30 "$out/one-node.log"; exit 1; }
echo "one node: done"
python3 "$here/multinode.py" --compare "$out/two-nodes" "$out/one-node"
