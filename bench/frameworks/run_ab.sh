#!/usr/bin/env bash
# Old build against new on the 7B HF Trainer job, alternated in one call, with
# the all-GPU reference: does a change slow training? .dist/base holds the old
# dosd, libdos_client.so and Python package (bench/make_dist.sh builds .dist).
# The old build runs with accelerate's optimizer placement off (OLD_ARGS, the
# workaround the issue's baseline used: without lazy state prepare copies the
# whole state into the trainer); the new one as users run it (NEW_ARGS).
#   bash bench/frameworks/run_ab.sh OUT [7b] [dos|dos_compact]
set -u
OLD_ARGS=${OLD_ARGS---no-placement}; NEW_ARGS=${NEW_ARGS-}
O=${1:?out dir}; SIZE=${2:-7b}; MODE=${3:-dos}
DIST=$PWD/.dist
export LD_LIBRARY_PATH=$DIST/lib PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$O"; W=/tmp/hf7b-ab; rm -rf $W; mkdir -p $W
run() {  # run NAME DOSD LIB PYTHONPATH MODE [ARGS]
  local sock=/tmp/dos-ab.sock; rm -f $sock
  "$2" --socket=$sock --checkpoint_dir=/tmp/dos-ab-ckpt > "$O/dosd_$1.log" 2>&1 &
  local dpid=$!
  for _ in $(seq 100); do [ -S $sock ] && break; sleep 0.1; done
  echo "== $1" >> "$O/ab.log"
  DOS_SOCKET=$sock DOS_DOSD_PID=$dpid DOS_CLIENT_LIB=$3 PYTHONPATH=$4 timeout 150 \
    python3 bench/frameworks/hf7b.py --mode $5 --size $SIZE --steps ${STEPS:-10} \
    --workdir $W/$1 --out $W/$1.json ${6:-} >> "$O/ab.log" 2>&1
  echo "exit=$?" >> "$O/ab.log"
  kill $dpid; wait $dpid
}
run old "$DIST/base/dosd" "$DIST/base/libdos_client.so" "$DIST/base/python" $MODE "$OLD_ARGS"
run new "$DIST/bin/dosd" "$DIST/lib/libdos_client.so" "$PWD/client/python" $MODE "$NEW_ARGS"
[ "${SKIP_ALL_GPU:-0}" = 1 ] ||
  run all_gpu "$DIST/bin/dosd" "$DIST/lib/libdos_client.so" "$PWD/client/python" all_gpu
python3 - "$W" "$O" <<'PY'
import json, sys, os
w, o = sys.argv[1:3]
r = {k: json.load(open(os.path.join(w, k + ".json"))) for k in ("old", "new", "all_gpu")
     if os.path.exists(os.path.join(w, k + ".json"))}
out = {k: {"iter_s": v["iter_s"], "step_s": v["step_s"], "peaks": v["peaks"]} for k, v in r.items()}
if "all_gpu" in r:
    for k in ("old", "new"):
        if k in r:
            out[f"ratio_{k}"] = r[k]["iter_s"] / r["all_gpu"]["iter_s"]
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(o, "ab.json"), "w"), indent=1)
PY
cp "$O/ab.json" "$O/ab_$MODE.json"
rm -rf $W /tmp/dos-ab-ckpt
