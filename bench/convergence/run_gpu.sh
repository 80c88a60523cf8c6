#!/usr/bin/env bash
# The convergence benchmark on the GPU machine (bench/convergence/run.py), from an
# install in .dist (bench/make_dist.sh, then bench/convergence/make_corpus.sh, which
# puts the corpus in .dist/corpus: make_dist.sh empties .dist):
#
#   bash bench/convergence/run_gpu.sh OUT            # the four runs at once; ~7 min on
#                                                     # nvidia-h200-x2 (2 runs per GPU)
#   bash bench/convergence/run_gpu.sh OUT fp32       # nvidia-h200: the fp32 pair, ~6 min,
#   bash bench/convergence/run_gpu.sh OUT compact    # then the compact pair, ~5 min
#
# With policy cpu every step's update runs on the host: four runs of 354M parameters
# need about 2000 x 4 x 0.07 s of the host's memory bandwidth, ~10 min on nvidia-h200's
# 16 cores, more than one call's 10 minutes; split there, and merge the two files here:
#   python3 bench/convergence/run.py --merge \
#       bench/results/convergence_nvidia-h200_<date>_fp32.json \
#       bench/results/convergence_nvidia-h200_<date>_compact.json
#
# Writes convergence_<machine>_<date>[_<part>].json and .png into OUT (copy them to
# bench/results), with convergence.log, dosd's log tail, the GPUs and the host's memory.
# Environment: DOS_MACHINE (default nvidia-h200, or nvidia-h200-xN with N GPUs), LIMIT
# (seconds for the whole part, default 570: each run is stopped 30 s before, so that
# the others' results are still written), RUNS (the part's runs instead, e.g.
# "fp32_exact,fp32_delay,fp32_exact_repeat" for the noise of two identical runs), ARGS
# (more run.py flags, e.g. "--policy auto" or "--delay-warmup 50").
set -u
O=${1:?out dir}; PART=${2:-all}
DIST=$PWD/.dist; B=$DIST/bin
export LD_LIBRARY_PATH=$DIST/lib DOS_CLIENT_LIB=$DIST/lib/libdos_client.so
export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$O"
L=$O/convergence.log
corpus=$DIST/corpus/corpus.txt
if [ ! -s "$corpus" ]; then
  echo "no $corpus: run bench/convergence/make_corpus.sh (after bench/make_dist.sh)" | tee "$L"
  exit 1
fi
case "$PART" in
  all) runs=fp32_exact,fp32_delay,compact_exact,compact_delay; tag= ;;
  fp32) runs=fp32_exact,fp32_delay; tag=fp32 ;;
  compact) runs=compact_exact,compact_delay; tag=compact ;;
  *) echo "part: all, fp32 or compact (not $PART)" | tee "$L"; exit 2 ;;
esac
runs=${RUNS:-$runs}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$O/gpus.txt" 2>&1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge 1 ] || gpus=1
if [ "$gpus" -ge 2 ]; then machine=${DOS_MACHINE:-nvidia-h200-x$gpus}; else machine=${DOS_MACHINE:-nvidia-h200}; fi
{ echo "cores $(nproc)"; free -g; } > "$O/host.txt"
if [ "$PART" = all ] && [ "$gpus" -lt 2 ]; then
  echo "warning: one GPU: the four runs take ~10 min here; run the parts fp32 and compact"
fi
limit=${LIMIT:-570}
W=$(mktemp -d)
# shellcheck disable=SC2086  # ARGS: several flags
timeout $((limit + 15)) python3 bench/convergence/run.py --dosd "$B/dosd" --corpus "$corpus" \
  --machine "$machine" --gpus "$gpus" --runs $runs --tag "$tag" --timeout $((limit - 30)) \
  --workdir "$W" --out "$O" ${ARGS:-} > "$L" 2>&1
rc=$?
echo "exit=$rc" >> "$L"
tail -c 20000 "$W/dosd-shared/dosd.log" > "$O/dosd_tail.log" 2>/dev/null
grep -vE '^\[[a-z0-9_]+\] step ' "$L" | tail -30
rm -rf "$W"
exit $rc
