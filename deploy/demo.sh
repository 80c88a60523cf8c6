#!/usr/bin/env bash
# The main job: sets up a fresh machine, builds what it runs (dosd, dosctl,
# libdos_client; the GPU path only where there is a GPU), starts dosd on a
# private socket and trains a small GPT-style model through it (CPU; see
# --device), then compares the run with torch.optim.AdamW and stops the daemon.
#   bash deploy/demo.sh [--steps N] [--device cpu|cuda]
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/progress.sh
if [ "${DOS_SKIP_DEPS:-0}" != 1 ]; then
  progress_stage "demo: Debian packages (deploy/install-deps.sh)"
  bash deploy/install-deps.sh
fi
build=${DOS_BUILD_DIR:-build}
mkdir -p "$build"
build_log=$build/demo-build.log
# Only what the demo runs: dosd, dosctl and the client library (the tests,
# benchmarks and man pages are tests/run_all.sh's). Without a GPU (and unless
# --device cuda is asked for) the GPU path is left out too: dosd trains on
# the CPU either way.
export DOS_BUILD_TARGETS="dosd dosctl dos_client"
gpu_note=
if [[ " $* " != *cuda* ]] && ! { nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
  export DOS_WITH_CUDA=OFF
  gpu_note="no GPU: the CPU path only; "
fi
progress_stage "demo: building dosd, dosctl and libdos_client into $build/" \
  "(${gpu_note}full log: $build_log)"
bash deploy/build.sh 2>&1 | progress_filter build "$build_log" ||
  { tail -50 "$build_log"; echo "demo: build failed; full log: $build_log"; exit 1; }
progress_stage "demo: build done"
py=python3
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then py=/usr/bin/python3; fi

run_dir=$(mktemp -d /tmp/dos-demo.XXXXXX)
sock=$run_dir/dosd.sock
# Checkpoints in the demo's own folder: a dosd started by hand never writes
# under the system's /var/lib/dos.
"$build/daemon/dosd" --socket="$sock" --checkpoint_dir="$run_dir/checkpoints" \
  2>"$run_dir/dosd.log" &
dosd_pid=$!
trap 'kill -TERM $dosd_pid 2>/dev/null || true' EXIT
for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { cat "$run_dir/dosd.log"; exit 1; }
echo "dosd (pid $dosd_pid) listening on $sock"
progress_stage "demo: training (client/python/examples/train_demo.py $*)"

set +e
DOS_SOCKET=$sock DOSCTL=$build/client/dosctl/dosctl \
  DOS_CLIENT_LIB=$build/client/src/libdos_client.so PYTHONPATH=client/python \
  "$py" client/python/examples/train_demo.py "$@"
rc=$?
set -e
kill -TERM $dosd_pid
wait $dosd_pid && echo "dosd stopped cleanly (exit 0)"
progress_stage "demo: done"
trap - EXIT
echo "daemon log: $run_dir/dosd.log"
exit $rc
