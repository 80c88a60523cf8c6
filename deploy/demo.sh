#!/usr/bin/env bash
# The main job: sets up a fresh machine, builds DOS, starts dosd on a private
# socket and trains a small GPT-style model through it (CPU; see --device),
# then compares the run with torch.optim.AdamW and stops the daemon.
#   bash deploy/demo.sh [--steps N] [--device cpu|cuda]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${DOS_SKIP_DEPS:-0}" != 1 ]; then bash deploy/install-deps.sh; fi
bash deploy/build.sh >/tmp/dos-demo-build.log 2>&1 || { tail -50 /tmp/dos-demo-build.log; exit 1; }
build=${DOS_BUILD_DIR:-build}
py=python3
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then py=/usr/bin/python3; fi

run_dir=$(mktemp -d /tmp/dos-demo.XXXXXX)
sock=$run_dir/dosd.sock
"$build/daemon/dosd" --socket="$sock" 2>"$run_dir/dosd.log" &
dosd_pid=$!
trap 'kill -TERM $dosd_pid 2>/dev/null || true' EXIT
for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { cat "$run_dir/dosd.log"; exit 1; }
echo "dosd (pid $dosd_pid) listening on $sock"

set +e
DOS_SOCKET=$sock DOSCTL=$build/client/dosctl/dosctl \
  DOS_CLIENT_LIB=$build/client/src/libdos_client.so PYTHONPATH=client/python \
  "$py" client/python/examples/train_demo.py "$@"
rc=$?
set -e
kill -TERM $dosd_pid
wait $dosd_pid && echo "dosd stopped cleanly (exit 0)"
trap - EXIT
echo "daemon log: $run_dir/dosd.log"
exit $rc
