#!/usr/bin/env bash
# What one GPU-machine call (the `device` tool) runs, from an install in
# .dist (bin/, lib/ incl. bundled libraries; see bench/e2e/README.md):
#
#   bash bench/device_session.sh tests OUT          # gpu-labelled tests + CUDA Python tests
#   bash bench/device_session.sh e2e OUT ARGS...    # bench/e2e/run.py with ARGS
#   bash bench/device_session.sh ranks OUT          # 1 vs 2 DDP ranks on one dosd, the node
#       model's predictions and bound (writes bench/results/ranks_<machine>_<date>.json)
#   bash bench/device_session.sh largest OUT [ARGS] # largest GPT under an 80 GiB budget, fp32
#       and compact state (bench/e2e/largest.py; searches for ~450 s, writes
#       bench/results/largest_<machine>_<date>.json)
#   bash bench/device_session.sh delay OUT          # issue 23's speed targets (~5 min): 6B fp32
#       and compact + delay, then the HF Trainer's 7B compact + delay with the client's default
#       clip (HF_CLIPS="default 0 1" also runs the other DOS_TORCH_CLIP_SCALED values), all-GPU
#       beside each; results and dosd's debug lines in OUT (delay_logs.tgz); delay-6b and
#       delay-hf run its two halves (~4 min; ~1 min a clip value on an H100)
#   bash bench/device_session.sh delay-ab OUT       # 6B fp32 + delay under several dosds or
#       flags (VARIANTS; by default dosd_base if built, this dosd, and --delayed_gpu_staged)
#   bash bench/device_session.sh unfreeze OUT       # add_param_group after steps at 2.4B (the state
#       carried through disk: DOS_SPILL=always) and 7B (no room: the refusal; UNFREEZE_RUNS);
#       bench/frameworks/unfreeze.py, writes bench/results/unfreeze_<machine>_<date>.json
#   bash bench/device_session.sh dcp OUT            # DCP's in-place load at 1.1B (DCP_SIZE) with
#       the state dict's views moved to a file and not (bench/frameworks/dcp_load.py)
#   bash bench/device_session.sh frameworks OUT     # HF Trainer, Accelerate, Lightning (writes
#       bench/results/integration_<machine>_<date>.json), read-after-step and shutdown tests on
#       CUDA, two "nodes" with a dosd each (gloo; NCCL with one GPU per node where there are 2)
#
# Logs and results go to OUT (the device tool brings back at most 8 files:
# give each part its own folder and tar them). Each part has its own
# timeout so that one hang does not eat the call.
set -u
what=${1:?tests|e2e|largest|ranks|delay|delay-6b|delay-hf|delay-ab|frameworks|unfreeze|dcp}; O=${2:?out dir}; shift 2
DIST=$PWD/.dist; B=$DIST/bin
export LD_LIBRARY_PATH=$DIST/lib DOS_CLIENT_LIB=$DIST/lib/libdos_client.so
export DOS_DOSD=$B/dosd DOS_DOSCTL=$B/dosctl DOS_GPU_DOOMED_TRAINER=$B/gpu_doomed_trainer
export DOS_GPU_RANK_TRAINER=$B/gpu_rank_trainer
export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# The machine the results name, from the GPUs this host has (DOS_MACHINE overrides):
# nvidia-h100 or nvidia-h200, -xN for N > 1 GPUs; and the commit .dist was built from.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
case "$gpu" in *H100*) kind=nvidia-h100 ;; *H200*) kind=nvidia-h200 ;; *) kind=unknown-gpu ;; esac
[ "$ngpu" -gt 1 ] && kind="$kind-x$ngpu"
export DOS_MACHINE=${DOS_MACHINE:-$kind}
if [ -z "${DOS_COMMIT:-}" ] && [ -s "$DIST/COMMIT" ]; then
  DOS_COMMIT=$(cat "$DIST/COMMIT"); export DOS_COMMIT
fi
mkdir -p "$O"
# start_dosd SOCK [FLAGS...]: this build's dosd on SOCK (log in $O/dosd.log), its pid in
# dpid, once the socket is there (10 s at most).
start_dosd() {
  local sock=$1; shift
  rm -f "$sock"
  "$B/dosd" --socket="$sock" "$@" > "$O/dosd.log" 2>&1 &
  dpid=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$O/gpus.txt" 2>&1

case "$what" in
  tests)
    {
      for t in gpu_adam_test gpu_lease_test gpu_ipc_test multi_gpu_test; do
        [ -x "$B/$t" ] || { echo "== $t: not built"; continue; }
        echo "== $t"; timeout 150 "$B/$t" > "/tmp/$t.log" 2>&1; echo "exit=$?"
        grep -E '^\[  (PASSED|FAILED|SKIPPED) |FAILED  |Failure|SKIP' "/tmp/$t.log" | head -30
        cp "/tmp/$t.log" "$O/"
      done
      echo "== pytest (CUDA, compact state, async, GPT loss, state I/O, DCP with DDP and FSDP2, early steps with torch's hooks)"
      timeout 360 python3 -m pytest -q -rfs -p no:cacheprovider tests/python/test_cuda.py \
        tests/python/test_compact_state.py tests/python/test_gpu_lease.py \
        tests/python/test_async.py tests/python/test_gpt_loss.py tests/python/test_state_io.py \
        tests/python/test_dcp.py tests/python/test_early.py \
        tests/python/test_training_features.py tests/python/test_state_views.py \
        tests/python/test_oom.py tests/python/test_delay.py \
        tests/python/test_inplace.py tests/python/test_dropin.py tests/python/test_grads.py \
        tests/python/test_mmapload.py tests/python/test_framework_calls.py tests/python/test_carry.py \
        tests/python/test_lightning_save.py \
        tests/python/frameworks/test_lightning_clip.py 2>&1 \
        | grep -vE "^(INFO|  /|$)" | tail -150
    } > "$O/tests.log" 2>&1
    ;;
  e2e)
    timeout 560 python3 bench/e2e/run.py --dosd "$B/dosd" --machine "$DOS_MACHINE" "$@" \
      > "$O/e2e.log" 2>&1
    echo "exit=$?" >> "$O/e2e.log"
    cp bench/results/e2e_"$DOS_MACHINE"_* "$O/" 2>/dev/null
    ;;
  largest)
    timeout 570 python3 bench/e2e/largest.py --dosd "$B/dosd" --machine "$DOS_MACHINE" \
      --gpu-budget-gb 80 "$@" > "$O/largest.log" 2>&1
    echo "exit=$?" >> "$O/largest.log"
    free -g >> "$O/largest.log"
    cp bench/results/largest_"$DOS_MACHINE"_* "$O/" 2>/dev/null
    ;;
  ranks)
    # 1 rank, then 2 DDP ranks (1.5B each, auto, clip 1.0) on one dosd whose
    # --gpu_memory_budget (per GPU engine; it also caps the trainers' leases)
    # keeps at least half of each rank's state on the host: 8 GiB holds 6 of
    # the 1.5B model's ~18.5 GB of fp32 state. The bandwidth probe first
    # measures the host (M_host) for the node model to start from.
    # RANKS_FSDP2=1 adds 2 FSDP2 ranks. Writes
    # bench/results/ranks_<machine>_<date>.json (and a copy in OUT).
    machine=$DOS_MACHINE
    budget=${RANKS_GPU_BUDGET:-8G}
    sock=/tmp/dos-ranks.sock
    mhost=0
    if [ -x "$B/dos_bench_update_probe" ]; then
      timeout 90 "$B/dos_bench_update_probe" > "$O/probe.json" 2> "$O/probe.err"
      mhost=$(python3 -c "import json;print(json.load(open('$O/probe.json'))['m_host_gbps'])" \
        2>/dev/null || echo 0)
    fi
    start_dosd $sock --gpu_memory_budget=$budget --model_host_gbps=$mhost
    export DOS_SOCKET=$sock
    r=$O/ranks.jsonl
    specs="1 ddp,2 ddp"; [ -n "${RANKS_FSDP2:-}" ] && specs="$specs,2 fsdp2"
    IFS=, read -ra runs <<< "$specs"
    for spec in "${runs[@]}"; do
      set -- $spec
      echo "== $1 rank(s), $2" >> "$O/ranks.log"
      timeout 150 torchrun --standalone --nproc_per_node=$1 bench/e2e/ranks.py --wrap $2 \
        --warmup ${RANKS_WARMUP:-3} --iters ${RANKS_ITERS:-6} --out "$r" ${RANKS_ARGS:-} \
        >> "$O/ranks.log" 2>&1
      echo "exit=$?" >> "$O/ranks.log"
      "$B/dosctl" --socket=$sock stats >> "$O/ranks.log" 2>&1
    done
    "$B/dosctl" --socket=$sock sessions >> "$O/ranks.log" 2>&1
    kill $dpid; wait $dpid
    echo "dosd exit=$?" >> "$O/ranks.log"
    res=bench/results/ranks_${machine}_$(date +%F).json
    python3 bench/e2e/ranks_report.py "$r" "$machine" "$res" "$O/probe.json" "$budget" \
      >> "$O/ranks.log" 2>&1
    cp "$res" "$O/" 2>/dev/null
    ;;
  delay|delay-6b|delay-hf)
    rm -rf /tmp/dos-e2e-*  # run.py's dosd logs (phases.log below)
    [ "$what" = delay-hf ] || timeout 230 python3 bench/e2e/run.py --dosd "$B/dosd" \
      --machine "$DOS_MACHINE" --size 6b --gpu-budget-gb 80 --iters 8 --modes all_gpu,dos_auto_delay,dos_auto_compact_delay \
      --out "$O/e2e" --tag delay --dosd-arg=--log_level=debug > "$O/e2e.log" 2>&1
    echo "exit=$?" >> "$O/e2e.log"
    cp "$O"/e2e/*.json "$O/" 2>/dev/null
    # HF_CLIPS: values of DOS_TORCH_CLIP_SCALED to run, `default` leaving it unset (the
    # client's own choice: `stream` on CUDA)
    [ "$what" = delay-6b ] || for clip in ${HF_CLIPS:-default}; do
      envs=(); [ "$clip" = default ] || envs=("DOS_TORCH_CLIP_SCALED=$clip")
      env -u DOS_TORCH_CLIP_SCALED "${envs[@]}" STEPS=22 SINK= MODES="all_gpu dos_compact_delay" \
        DOSD_ARGS=--log_level=debug RESULT="$O/hf7b_clip_$clip.json" \
        timeout 170 bash bench/frameworks/run_hf7b.sh "$O/hf_$clip" 7b none > "$O/hf_$clip.log" 2>&1
      echo "exit=$?" >> "$O/hf_$clip.log"
    done
    grep -H "event=step\.\(phases\|stream_coef\|early_capture\)\|event=delayed\.\(update\|gpu\)" \
      /tmp/dos-e2e-*/dosd-*.log "$O"/hf_*/dosd*.log > "$O/phases.log" 2>/dev/null
    logs=$(cd "$O" && ls -d e2e e2e.log hf_* 2>/dev/null || true)  # not hf7b_*.json
    # shellcheck disable=SC2086  # one word per entry
    tar czf "$O/delay_logs.tgz" -C "$O" $logs && (cd "$O" && rm -rf $logs)
    ;;
  delay-ab)
    # 6B fp32 + delay under several dosds or flags, all-GPU in each run (~1.5 min a
    # variant). VARIANTS="name[@binary]=flag ...": `binary` in .dist/bin (default dosd),
    # `flag` dosd flags joined by commas, or none; an item env:VAR=VALUE is the trainer's
    # environment instead (e.g. hr15=env:DOS_GPU_HEADROOM=1536M, the GPU lease's headroom).
    # By default the build before the host waits slept (dosd_base, when make_dist.sh built
    # it: BASE_REV), this one, and this one staged.
    rm -rf /tmp/dos-e2e-*
    names=""
    base=""; [ -x "$B/dosd_base" ] && base="base@dosd_base="
    for v in ${VARIANTS:-$base now= staged=--delayed_gpu_staged}; do
      n=${v%%=*}; flag=${v#*=}; bin=dosd
      case "$n" in *@*) bin=${n#*@}; n=${n%%@*} ;; esac
      names="$names e2e_$n e2e_$n.log phases_$n.log"
      args=(); envs=(); IFS=, read -ra fl <<< "$flag"
      for f in "${fl[@]}"; do
        case "$f" in env:*) envs+=("${f#env:}") ;; *) args+=(--dosd-arg="$f") ;; esac
      done
      timeout 170 env "${envs[@]}" python3 bench/e2e/run.py --dosd "$B/$bin" --machine "$DOS_MACHINE" --size 6b \
        --gpu-budget-gb 80 --iters 8 --modes all_gpu,dos_auto_delay --out "$O/e2e_$n" \
        --tag "delay_$n" --dosd-arg=--log_level=debug "${args[@]}" \
        > "$O/e2e_$n.log" 2>&1
      echo "exit=$? dosd=$bin flag=$flag" >> "$O/e2e_$n.log"
      cp "$O/e2e_$n"/*.json "$O/" 2>/dev/null
      grep -H "event=step\.\(phases\|early_capture\)\|event=delayed\.\(update\|gpu\)" /tmp/dos-e2e-*/dosd-*.log \
        > "$O/phases_$n.log" 2>/dev/null
      rm -rf /tmp/dos-e2e-*
    done
    # shellcheck disable=SC2086  # one word per entry
    tar czf "$O/ab_logs.tgz" -C "$O" $names && (cd "$O" && rm -rf $names)
    ;;
  frameworks)
    # The framework tests use one GPU: their figures are named for one (the JSON records
    # how many GPUs the host had).
    machine=${DOS_MACHINE%-x*}
    DOS_MACHINE=$machine timeout 250 bash tests/python/frameworks/run_gpu.sh "$B/dosd" \
      "$DIST/lib/libdos_client.so" > "$O/frameworks.log" 2>&1
    echo "exit=$?" >> "$O/frameworks.log"
    cp bench/results/integration_${machine}_* "$O/" 2>/dev/null
    DOS_PYTEST_TIMEOUT=120 timeout 330 python3 -m pytest -v --durations=10 -p no:cacheprovider -rs \
      tests/python/test_read_after_step.py tests/python/test_shutdown.py tests/python/test_multinode.py \
      > "$O/read_after_step.log" 2>&1
    echo "exit=$?" >> "$O/read_after_step.log"
    if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
      for wrap in ddp fsdp2; do
        echo "== two nodes, NCCL, $wrap" >> "$O/multinode_nccl.log"
        timeout 100 bash client/python/examples/multinode_localhost.sh --dosd "$B/dosd" \
          --device cuda --wrap $wrap >> "$O/multinode_nccl.log" 2>&1
        echo "exit=$?" >> "$O/multinode_nccl.log"
      done
    fi
    ;;
  unfreeze)
    sock=/tmp/dos-unfreeze.sock; start_dosd $sock
    mkdir -p "$O/runs"
    for run in ${UNFREEZE_RUNS:-2b:always 7b:auto}; do
      echo "== $run; df: $(df -h --output=avail /tmp /var/tmp . | tr '\n' ' ')" >> "$O/unfreeze.log"
      DOS_SOCKET=$sock DOS_DOSD_PID=$dpid timeout 240 python3 bench/frameworks/unfreeze.py \
        --size ${run%:*} --spill ${run#*:} --out "$O/runs/${run/:/_}.json" \
        >> "$O/unfreeze.log" 2>&1
      echo "exit=$?" >> "$O/unfreeze.log"
    done
    kill $dpid; wait $dpid
    python3 - "$O" "$DOS_MACHINE" <<'PY'
import glob, json, os, sys, time
runs = {os.path.basename(p)[:-5]: json.load(open(p))
        for p in sorted(glob.glob(sys.argv[1] + "/runs/*.json"))}
out = f"bench/results/unfreeze_{sys.argv[2]}_{time.strftime('%Y-%m-%d')}.json"
json.dump({"machine": sys.argv[2], "date": time.strftime("%Y-%m-%d"), "runs": runs},
          open(out, "w"), indent=1)
print(out)
PY
    cp bench/results/unfreeze_"$DOS_MACHINE"_* "$O/" 2>/dev/null
    ;;
  dcp)
    sock=/tmp/dos-dcp.sock; start_dosd $sock
    DOS_SOCKET=$sock DOS_DOSD_PID=$dpid timeout ${DCP_TIMEOUT:-300} python3 \
      bench/frameworks/dcp_load.py --size ${DCP_SIZE:-mlp:60} --dir /var/tmp \
      --out "bench/results/dcp_load_${DOS_MACHINE}_$(date +%F).json" > "$O/dcp.log" 2>&1
    echo "exit=$?" >> "$O/dcp.log"
    kill $dpid; wait $dpid
    cp bench/results/dcp_load_"$DOS_MACHINE"_* "$O/" 2>/dev/null
    ;;
  *) echo "unknown part $what" >&2; exit 2 ;;
esac
ls -la "$O"
