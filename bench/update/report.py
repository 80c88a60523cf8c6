#!/usr/bin/env python3
"""Summarises one update-benchmark run: table, JSON result file, PNG timeline.

report.py OUT_DIR MACHINE  (reads probe.json, policies.jsonl, timeline.jsonl)
"""
import datetime
import json
import os
import subprocess
import sys

out, machine = sys.argv[1], sys.argv[2]
probe = json.load(open(os.path.join(out, "probe.json")))
rows = [json.loads(l) for l in open(os.path.join(out, "policies.jsonl")) if l.strip()]
bound = probe["bound_gparams"]
bound_compact = probe.get("bound_gparams_compact")

print(f"\nmodel inputs measured in this run: H2D {probe['h2d_gbps']:.1f} GB/s, D2H {probe['d2h_gbps']:.1f},"
      f" both {probe['both_gbps']:.1f}, host copy {probe['host_copy_gbps']:.1f}, CPU Adam alone "
      f"{probe['cpu_gparams_alone']:.2f} Gparam/s, under DMA {probe['cpu_gparams_under_dma']:.2f} "
      f"(+{probe['dma_gbps_under_cpu']:.1f} GB/s DMA) -> M_host {probe['m_host_gbps']:.1f} GB/s, "
      f"GPU kernel {probe['gpu_kernel_gparams']:.1f} Gparam/s")
print(f"model bound (all state on host): {bound:.2f} Gparam/s at x={probe['bound_x']:.2f} "
      f"({probe['bound_binding']})" + (
          f"; compact state: {bound_compact:.2f} Gparam/s at x={probe['bound_x_compact']:.2f} "
          f"({probe['bound_binding_compact']})" if bound_compact else "") + "\n")
hdr = f"{'policy':<22}{'Gparam/s':>9}{'ms':>8}{'pred ms':>8}{'%bound':>7}{'H2D GB/s':>9}{'D2H GB/s':>9}" \
      f"{'GPU MiB':>9}{'cpu busy':>9}{'gpu busy':>9}  placement (cpu/gpu/resident)"
print(hdr)
for r in rows:
    name = r["policy"] + (f" [{r['label']}]" if r["label"] else "")
    b = bound_compact if r["label"] == "compact" and bound_compact else bound
    print(f"{name:<22}{r['gparams']:>9.2f}{r['update_ms']:>8.1f}{r['predicted_ms']:>8.1f}"
          f"{100 * r['gparams'] / b:>6.0f}%{r['h2d_gbps']:>9.1f}{r['d2h_gbps']:>9.1f}"
          f"{r['daemon_gpu_bytes'] / 2**20:>9.0f}{r['cpu_busy']:>9.2f}{r['gpu_busy']:>9.2f}"
          f"  {r['cpu_subgroups']}/{r['gpu_subgroups']}/{r['resident_subgroups']}")


def get(policy, label=""):
    for r in rows:
        if r["policy"] == policy and r["label"] == label:
            return r["gparams"]
    return None


inter = [get(f"interleave:{k}") for k in (2, 3, 4)]
results = [
    ("update_gparams_auto", get("auto"), "Gparam/s"),
    ("update_gparams_cpu", get("cpu"), "Gparam/s"),
    ("update_gparams_cpu_fp32grads", get("cpu", "fp32grads"), "Gparam/s"),
    ("update_gparams_static_0.5", get("static:0.5"), "Gparam/s"),
    ("update_gparams_interleave_best", max(v for v in inter if v is not None) if any(inter) else None, "Gparam/s"),
    ("update_model_bound_gparams", bound, "Gparam/s"),
    ("update_gparams_auto_halfbudget", get("auto", "halfbudget"), "Gparam/s"),
    ("update_gparams_auto_compact", get("auto", "compact"), "Gparam/s"),
    ("update_gparams_cpu_compact", get("cpu", "compact"), "Gparam/s"),
    ("update_model_bound_gparams_compact", bound_compact, "Gparam/s"),
]
for k, v in zip((2, 3, 4), inter):
    results.append((f"update_gparams_interleave_{k}", v, "Gparam/s"))
for key in ("h2d_gbps", "d2h_gbps", "both_gbps", "m_host_gbps", "cpu_gparams_alone", "cpu_gparams_under_dma"):
    results.append((f"update_probe_{key}", probe[key], "GB/s" if "gbps" in key else "Gparam/s"))
# $DOS_COMMIT first: a tree sent to a GPU machine may carry a stale .git.
commit = os.environ.get("DOS_COMMIT", "")
if not commit:
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                         stderr=subprocess.DEVNULL).strip()
    except Exception:
        commit = "unknown"
date = datetime.date.today().isoformat()
doc = {"machine": machine, "date": date, "commit": commit,
       "results": [{"name": n, "value": v, "unit": u} for n, v, u in results if v is not None]}
path = os.path.join(out, f"update_{machine}_{date}.json")
json.dump(doc, open(path, "w"), indent=1)
print("\nwrote", path)

# Timeline of the last `auto` step.
tl = os.path.join(out, "timeline.jsonl")
if os.path.exists(tl):
    steps = [json.loads(l) for l in open(tl) if l.strip()]
    autos = [s for s in steps if s["policy"] == "auto"]
    if autos:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        s = autos[-1]
        fig, ax = plt.subplots(figsize=(12, 4))
        lanes = {"H2D": 3, "GPU kernel": 2, "D2H": 1, "CPU kernel": 0}
        colors = {"g": "tab:green", "c": "tab:blue", "r": "tab:olive"}
        for e in s["entries"]:
            c = colors[e["path"]]
            if e["path"] == "g":
                segs = [("H2D", e["in"]), ("GPU kernel", e["kernel"]), ("D2H", e["out"])]
            elif e["path"] == "c":
                segs = [("D2H", e["in"]), ("CPU kernel", e["kernel"]), ("H2D", e["out"])]
            else:
                segs = [("GPU kernel", e["kernel"])]
            for lane, (a, b) in segs:
                if b > a:
                    ax.barh(lanes[lane], (b - a) / 1e3, left=a / 1e3, color=c, edgecolor="k", height=0.6)
                    ax.text((a + b) / 2e3, lanes[lane], str(e["sg"]), ha="center", va="center", fontsize=6)
        ax.set_yticks(list(lanes.values()))
        ax.set_yticklabels(list(lanes.keys()))
        ax.set_xlabel("ms since the step's start")
        ax.set_title(f"auto step {s['step']}: {s['wall_us']/1e3:.0f} ms measured, {s['predicted_us']/1e3:.0f} ms predicted "
                     f"(green: GPU path, blue: CPU path; numbers: subgroup)")
        fig.tight_layout()
        png = os.path.join(out, f"update_timeline_{machine}_{date}.png")
        fig.savefig(png, dpi=110)
        print("wrote", png)
