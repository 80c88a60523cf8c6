#!/usr/bin/env bash
# Before/after on one GPU machine in one session: run.sh with two installs
# (e.g. main before a refactor and after it), alternating OLD NEW OLD NEW so
# drift of the machine hits both, then every policy's median Gparam/s side by
# side with the change (issue 13: within 3%).
#   bash bench/update/compare.sh OLD_DIST NEW_DIST OUT_DIR [ROUNDS]
# Each DIST holds bin/{dosd,dos_bench_update_trainer,dos_bench_update_probe}
# and lib/ (see run.sh).
set -u
OLD=${1:?old dist}; NEW=${2:?new dist}; OUT=${3:?out dir}; ROUNDS=${4:-3}
mkdir -p "$OUT"
for r in $(seq "$ROUNDS"); do
  for side in old new; do
    dist=$OLD; [ $side = new ] && dist=$NEW
    echo "== round $r: $side ($dist)"
    DIST=$dist bash "$(dirname "$0")/run.sh" "$OUT/$side.$r" nvidia-h200 ${PARAMS:-2e9} ${SUBGROUP:-1e8} \
      > "$OUT/$side.$r.log" 2>&1 || echo "run.sh failed, see $OUT/$side.$r.log"
  done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys, os
out, rounds = sys.argv[1], int(sys.argv[2])
def rates(side):
    acc = {}
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"{side}.{r}", "policies.jsonl")
        if not os.path.exists(path):
            continue
        for line in open(path):
            if line.strip():
                j = json.loads(line)
                acc.setdefault((j["policy"], j["label"]), []).append(j["gparams"])
    return {k: statistics.median(v) for k, v in acc.items()}
old, new = rates("old"), rates("new")
print(f"{'policy':<26}{'old Gp/s':>10}{'new Gp/s':>10}{'change':>9}")
worst = 0.0
for k in sorted(old):
    if k not in new:
        continue
    d = 100 * (new[k] - old[k]) / old[k]
    worst = min(worst, d)
    name = k[0] + (f" [{k[1]}]" if k[1] else "")
    print(f"{name:<26}{old[k]:>10.2f}{new[k]:>10.2f}{d:>8.1f}%{'  <-- over 3% slower' if d < -3 else ''}")
print(f"worst change: {worst:.1f}% ({'within' if worst >= -3 else 'OUTSIDE'} the 3% bound)")
PY
