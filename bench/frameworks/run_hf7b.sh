#!/usr/bin/env bash
# The 7B Hugging Face Trainer job of issue 22 on the GPU machine, every mode
# in one call: DOS (fp32 state), DOS (compact state), all-GPU fused AdamW;
# then the HF round trip (save_steps, resume_from_checkpoint in a new
# process) at the largest Llama whose checkpoint fits the disk (2b: ~2.4B).
# Writes bench/results/hf7b_<machine>_<date>.json (bench/frameworks/report.py)
# and the logs to OUT.
#   bash bench/frameworks/run_hf7b.sh OUT [7b|tiny|none] [2b|tiny|none]
# MODES picks the runs at the first size (all_gpu dos dos_compact by default;
# dos_delay and dos_compact_delay are dos and dos_compact with --delay 1
# --delay-warmup ${DELAY_WARMUP:-2}, issue 23's one-step delayed update; a
# mode's _overlap or _nooverlap before _delay asks for overlap=True or False
# (dos_compact_overlap_delay; otherwise dos.torch's default);
# SINK= (empty) skips streaming the state to /dev/null after the steps;
# HF_ARGS: more hf7b.py flags for the first size's runs (e.g. --max-grad-norm 0, --step-sync end
# or --profile-step 13 --steps 13);
# DOSD_ARGS: more dosd flags (e.g. --delayed_cpu_threads=0 for an A/B);
# DOSD_WRAP / TRAINER_WRAP: a command each runs under (e.g. "taskset -c 2-15"
# and "taskset -c 0-1" to keep dosd's update off the trainer's CPUs);
# RT_ARGS=--deterministic makes the round trip deterministic on CUDA (hf7b.py:
# the losses of a resumed run can otherwise differ through CUDA's atomics, not
# the optimizer); RESULT names
# the results file; FRAMEWORK=accelerate runs the first size through
# Accelerate's own loop instead of the Trainer; RT_MODE=all_gpu runs the round trip with torch's AdamW (the
# control: a difference there is the framework's or CUDA's) (default bench/results/hf7b_<machine>_<date>.json).
set -u
O=${1:?out dir}; SIZE=${2:-7b}; RT=${3:-2b}
DIST=$PWD/.dist; B=$DIST/bin
export LD_LIBRARY_PATH=$DIST/lib DOS_CLIENT_LIB=$DIST/lib/libdos_client.so
export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
machine=${DOS_MACHINE:-nvidia-h200}
mkdir -p "$O"
sock=/tmp/dos-hf7b.sock; rm -f $sock
${DOSD_WRAP:-} "$B/dosd" --socket=$sock --checkpoint_dir=/tmp/dos-hf7b-ckpt ${DOSD_ARGS:-} > "$O/dosd.log" 2>&1 &
dpid=$!
export DOS_DOSD_PID=$dpid
for _ in $(seq 100); do [ -S $sock ] && break; sleep 0.1; done
export DOS_SOCKET=$sock
W=/tmp/hf7b-work; rm -rf $W; mkdir -p $W
cat /sys/kernel/mm/transparent_hugepage/shmem_enabled > "$O/thp.txt" 2>&1
free -g >> "$O/thp.txt"
[ "$SIZE" = none ] && modes= || modes=${MODES:-all_gpu dos dos_compact}
for run in $modes; do
  # A run is a mode, or a DOS mode with _delay: the file name report.py reads.
  mode=${run%_delay}; delay=()
  [ "$mode" != "$run" ] && delay=(--delay 1 --delay-warmup "${DELAY_WARMUP:-2}")
  case $mode in
    *_nooverlap) mode=${mode%_nooverlap}; delay+=(--overlap off) ;;
    *_overlap) mode=${mode%_overlap}; delay+=(--overlap on) ;;
  esac
  echo "== $run $SIZE" >> "$O/hf7b.log"
  timeout 300 ${TRAINER_WRAP:-} python3 bench/frameworks/hf7b.py --mode $mode "${delay[@]}" \
    --framework ${FRAMEWORK:-hf} --size $SIZE --steps ${STEPS:-12} \
    ${SINK---sink} ${HF_ARGS:-} --workdir $W/$run --out $W/$run.json >> "$O/hf7b.log" 2>&1
  echo "exit=$?" >> "$O/hf7b.log"
done
if [ "$RT" != none ]; then
  echo "== roundtrip save $RT" >> "$O/hf7b.log"
  timeout 300 python3 bench/frameworks/hf7b.py --mode ${RT_MODE:-dos} --size $RT --steps 7 --save-at 4 \
    --roundtrip save --workdir $W/rt --out $W/rt_save.json ${RT_ARGS:-} >> "$O/hf7b.log" 2>&1
  echo "exit=$?" >> "$O/hf7b.log"
  df -h /tmp >> "$O/hf7b.log"
  echo "== roundtrip resume $RT" >> "$O/hf7b.log"
  timeout 300 python3 bench/frameworks/hf7b.py --mode ${RT_MODE:-dos} --size $RT --steps 7 --save-at 4 \
    --roundtrip resume --workdir $W/rt --out $W/rt_resume.json ${RT_ARGS:-} >> "$O/hf7b.log" 2>&1
  echo "exit=$?" >> "$O/hf7b.log"
fi
kill $dpid; wait $dpid; echo "dosd exit=$?" >> "$O/hf7b.log"
result=${RESULT:-bench/results/hf7b_${machine}_$(date +%F).json}
python3 bench/frameworks/report.py $W "$machine" "$result" >> "$O/hf7b.log" 2>&1
cp "$result" "$O/" 2>/dev/null
tail -c 3000 "$O/dosd.log" > "$O/dosd_tail.log"
# dosd's per-step debug lines (DOSD_ARGS=--log_level=debug: step.phases, delayed.update), the last 60.
grep -E 'step\.(phases|early_capture)|gpu\.step|delayed\.update' "$O/dosd.log" | tail -60 > "$O/dosd_phases.log"
rm -f "$O/dosd.log"
cp $W/*.trace.json.gz "$O/" 2>/dev/null  # --profile-step's traces
rm -rf $W /tmp/dos-hf7b-ckpt
