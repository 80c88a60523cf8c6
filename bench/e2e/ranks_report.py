#!/usr/bin/env python3
"""Writes bench/results/ranks_<machine>_<date>.json from ranks.py's JSON lines.

    ranks_report.py RANKS_JSONL MACHINE OUT_JSON [PROBE_JSON] [GPU_BUDGET]

Figures (issue 14 item 4): update_gparams_auto_1rank and update_gparams_auto_2ranks
(DDP, aggregate), their ratio, the node bound dosd's shared model predicted for the
two ranks together, and each rank's prediction error. PROBE_JSON (bench/update's
bandwidth probe, run in the same session) adds the host's measured memory
bandwidth that the node model started from.
"""
import datetime
import os
import json
import subprocess
import sys


def main():
    src, machine, out = sys.argv[1:4]
    probe_path = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    budget = sys.argv[5] if len(sys.argv) > 5 else ""
    runs = [json.loads(l) for l in open(src) if l.strip()]
    one = next((r for r in runs if r["wrap"] == "ddp" and r["world"] == 1), None)
    two = next((r for r in runs if r["wrap"] == "ddp" and r["world"] == 2), None)
    fsdp = next((r for r in runs if r["wrap"] == "fsdp2" and r["world"] == 2), None)
    res = []

    def add(name, value, unit, note=None):
        if value is None:
            return
        row = {"name": name, "value": value, "unit": unit}
        if note:
            row["note"] = note
        res.append(row)

    if one:
        add("update_gparams_auto_1rank", one["aggregate_gparam_per_s"], "Gparam/s")
        add("update_pred_err_1rank", max(one.get("prediction_error_per_rank", [None])), "fraction",
            "|measured - predicted| / measured, opt.step() timed by the trainer")
    if two:
        add("update_gparams_auto_2ranks", two["aggregate_gparam_per_s"], "Gparam/s")
        add("update_node_bound_gparams_2ranks", two.get("node_bound_gparam_per_s"), "Gparam/s",
            "dosd's shared node model: both ranks' parameters / the slower one's predicted time")
        for i, e in enumerate(two.get("prediction_error_per_rank", [])):
            add(f"update_pred_err_2ranks_rank{i}", e, "fraction",
                "|measured - predicted| / measured, opt.step() timed by the trainer")
        for i, e in enumerate(two.get("daemon_prediction_error_per_rank", [])):
            add(f"update_pred_err_daemon_2ranks_rank{i}", e, "fraction",
                "against dosd's own update time")
        b = two.get("node_bound_gparam_per_s")
        if b:
            add("update_2ranks_of_node_bound", round(two["aggregate_gparam_per_s"] / b, 3), "x")
    if one and two:
        ratio = round(two["aggregate_gparam_per_s"] / one["aggregate_gparam_per_s"], 3)
        add("update_2ranks_vs_1rank", ratio, "x", "target >= 1.6, or the node bound reached")
        b, b1 = two.get("node_bound_gparam_per_s"), one.get("node_bound_gparam_per_s")
        if b and b1:
            add("update_node_bound_2ranks_vs_1rank", round(b / b1, 3), "x",
                "what the shared model allows two ranks over one on this host")
    if fsdp:
        add("update_gparams_auto_2ranks_fsdp2", fsdp["aggregate_gparam_per_s"], "Gparam/s")
    if probe_path:
        try:
            probe = json.load(open(probe_path))
            add("host_memory_gbps_probe", round(probe["m_host_gbps"], 1), "GB/s",
                "bench/update probe: CPU Adam under both DMA directions (M_host)")
            add("host_copy_gbps_probe", round(probe["host_copy_gbps"], 1), "GB/s")
        except (OSError, ValueError, KeyError) as e:
            print(f"ranks_report: probe {probe_path} unreadable ({e})", file=sys.stderr)
    # $DOS_COMMIT first: a copy of the tree sent to the GPU machine may carry a stale .git.
    commit = os.environ.get("DOS_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    doc = {"machine": machine, "date": datetime.date.today().isoformat(), "commit": commit,
           "results": res, "runs": runs,
           "note": "bench/e2e/ranks.py via bench/device_session.sh ranks: GPT 1.5B bf16 per rank, "
                   "DDP, clip 1.0, policy auto, one dosd (one GPU engine per device) with "
                   f"--gpu_memory_budget={budget} per GPU so that at least half of each rank's "
                   "state stays on the host; update time = opt.step() + cuda synchronize after a "
                   "barrier, median of the timed steps after warm-up; predictions from dosctl "
                   "stats after each timed step"}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in res:
        print(f"{r['name']}: {r['value']} {r['unit']}")


if __name__ == "__main__":
    main()
