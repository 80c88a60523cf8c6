#!/usr/bin/env bash
# dosd flags A/B for the 7B Hugging Face Trainer job in one GPU-machine call:
# all-GPU once at the start and once at the end (the machine's drift), and
# each variant's MODE (dos_compact_delay by default) with its dosd flags,
# the first variant again at the end. Writes OUT/<label>.json per run
# (bench/frameworks/report.py's figures) and OUT/summary.txt (iteration,
# window, delayed update and dosd's prediction per run).
#   VARIANTS='default=;nice19=--delayed_cpu_nice=19;t4=--delayed_cpu_threads=-4' \
#     bash bench/frameworks/sweep_hf7b.sh OUT
# About 60 s a run on nvidia-h200 (the model is built anew for each run);
# SIZE=tiny (hf7b.py) for a quick try.
set -u
O=${1:?out dir}; mkdir -p "$O"
MODE=${MODE:-dos_compact_delay}
VARIANTS=${VARIANTS:-default=;nice19=--delayed_cpu_nice=19}
run() {  # label modes dosd_args
  STEPS=${STEPS:-12} SINK= MODES="$2" DOSD_ARGS="$3" RESULT="$O/$1.json" \
    bash bench/frameworks/run_hf7b.sh "$O/$1" "${SIZE:-7b}" none
  python3 - "$O/$1.json" "$1" <<'PY' | tee -a "$O/summary.txt"
import json, sys
f = json.load(open(sys.argv[1]))["figures"]
keys = ("iter_s", "window_s", "delayed_update_s", "predicted_iter_s", "cpu_cores")
print(sys.argv[2], {k.replace("hf7b_", ""): round(v, 4) for k, v in f.items()
                    if isinstance(v, float) and any(s in k for s in keys)})
PY
}
IFS=';' read -r -a vs <<< "$VARIANTS"
first=${vs[0]}
run "${first%%=*}" "all_gpu $MODE" "${first#*=}"
for v in "${vs[@]:1}"; do run "${v%%=*}" "$MODE" "${v#*=}"; done
run "${first%%=*}_again" "$MODE all_gpu" "${first#*=}"
