#!/usr/bin/env python3
"""Collects bench/frameworks/hf7b.py's per-run JSON files (a work folder)
into the figures of issue 22: report.py WORKDIR MACHINE OUT.json."""
import datetime
import json
import os
import subprocess
import sys

GiB = 2**30


def load(w, name):
    p = os.path.join(w, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None


def main():
    w, machine, out = sys.argv[1:4]
    runs = {m: load(w, m) for m in ("all_gpu", "dos", "dos_compact", "rt_save", "rt_resume")}
    f = {}
    ref = runs["all_gpu"]
    for mode, key in (("dos", "dos"), ("dos_compact", "dos_compact"), ("all_gpu", "all_gpu")):
        r = runs[mode]
        if r:
            f[f"hf7b_iter_s_{key}"] = r["iter_s"]
    if ref:
        for mode in ("dos", "dos_compact"):
            if runs[mode]:
                f[f"hf7b_ratio_{mode}_vs_all_gpu"] = runs[mode]["iter_s"] / ref["iter_s"]
        f["hf7b_host_peak_gib_trainer_all_gpu"] = ref["peaks"]["trainer_rss_anon"] / GiB
    for mode in ("dos", "dos_compact"):
        r = runs[mode]
        if not r:
            continue
        sfx = "" if mode == "dos" else "_compact"
        f[f"hf7b_host_peak_gib_trainer{sfx}"] = r["peaks"]["trainer_rss_anon"] / GiB
        f[f"hf7b_host_peak_gib_dosd{sfx}"] = r["peaks"]["dosd_rss"] / GiB
        f[f"hf7b_gpu_device_peak_gib{sfx}"] = r["peaks"]["gpu_used"] / GiB
        f[f"hf7b_state_gib{sfx}"] = r["params"] * (12 if mode == "dos" else 8) / GiB
        f[f"hf7b_sink_save_s{sfx}"] = r.get("sink_save_s")
        f[f"hf7b_register_s{sfx}"] = r.get("register_s")
        f["hf7b_params"] = r["params"]
    s, r = runs["rt_save"], runs["rt_resume"]
    if s and r:
        common = sorted(set(s["losses"]) & set(r["losses"]), key=int)
        f["hf_resume_params"] = s["params"]
        f["hf_save_s"] = s.get("hf_save_s")
        # trainer.train(resume_from_checkpoint=...) to the first step: the load
        f["hf_resume_s"] = r.get("call_to_first_step_s", r["train_s"] - sum(r["step_s"]))
        f["hf_resume_steps_compared"] = len(common)
        f["hf_resume_max_loss_diff"] = max((abs(s["losses"][k] - r["losses"][k]) for k in common),
                                           default=None)
        f["hf_saved_equals_final"] = s.get("saved_equals_final")
        f["hf_checkpoint_gib"] = s.get("checkpoint_bytes", 0) / GiB
        f["hf_resume_host_peak_gib_trainer"] = max(s["peaks"]["trainer_rss_anon"],
                                                   r["peaks"]["trainer_rss_anon"]) / GiB
    if any(r and r.get("framework") == "accelerate" for r in runs.values()):
        f = {k.replace("hf7b_", "accelerate7b_"): v for k, v in f.items()}
        ref = None  # the limit line below names the HF figures
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    doc = {"machine": machine, "date": datetime.date.today().isoformat(), "commit": commit,
           "figures": f, "runs": runs}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
    for k, v in sorted(f.items()):
        print(f"{k:45s} {v}")
    if ref and runs["dos"]:
        print(f"limit: trainer RssAnon <= all-GPU's + 4 GiB = "
              f"{f['hf7b_host_peak_gib_trainer_all_gpu'] + 4:.1f} GiB; dosd <= state x 1.1 = "
              f"{f['hf7b_state_gib'] * 1.1:.1f} GiB")


if __name__ == "__main__":
    main()
