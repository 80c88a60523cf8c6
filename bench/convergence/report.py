"""The convergence benchmark's report: from the runs' records (train.py), the
result entries (relative differences of the last steps' mean loss and of the
validation loss), the printed tables with the 1% target beside each result,
the JSON file and the PNG chart of the loss curves; and the merge of several
result files (runs made in separate GPU-machine calls) into one."""
import json
import os

# (result name, reference run, compared run, what it shows). Written when both
# ran; the convergence_delay_* ones are judged against TARGET_REL_DIFF.
PAIRS = [
    ("convergence_delay_loss_rel_diff", "fp32_exact", "fp32_delay",
     "delay=1 vs exact, fp32 state"),
    ("convergence_delay_loss_rel_diff_compact", "compact_exact", "compact_delay",
     "delay=1 vs exact, compact state"),
    ("convergence_compact_loss_rel_diff", "fp32_exact", "compact_exact",
     "compact vs fp32 state, both exact"),
    ("convergence_noise_loss_rel_diff", "fp32_exact", "fp32_exact_repeat",
     "fp32 exact run twice (kernel noise)"),
    ("convergence_torch_delay_loss_rel_diff", "torch_exact", "torch_delay",
     "no DOS: torch's AdamW, the delay's staleness simulated (reference.py)"),
    ("convergence_dos_vs_torch_loss_rel_diff", "torch_exact", "fp32_exact",
     "DOS exact vs torch's AdamW"),
    ("convergence_dos_vs_torch_delay_loss_rel_diff", "torch_delay", "fp32_delay",
     "DOS delay=1 vs torch's AdamW with the same staleness"),
]
TARGET_REL_DIFF = 0.01  # the bound on |delayed - exact| / exact


def finished(results):
    """{run: record} of the runs that finished."""
    return {r["run"]: r for r in results if "last_mean" in r}


def metrics_of(ok, requested):
    """(result entries, printed rows [(name, value or None, judged, what)]).
    A judged pair with a requested run that did not finish is a row without
    a value."""
    metrics, rows = [], []
    for name, ref, other, what in PAIRS:
        judged = name.startswith("convergence_delay")
        if ref not in ok or other not in ok:
            if judged and (ref in requested or other in requested):
                missing = ", ".join(r for r in (ref, other) if r not in ok)
                rows.append((name, None, True, f"{what}: not measured (no result of "
                             f"{missing})"))
            continue
        a, b = ok[ref], ok[other]
        d = (b["last_mean"] - a["last_mean"]) / a["last_mean"]
        dv = (b["val_loss"] - a["val_loss"]) / a["val_loss"]
        val_name = name.replace("_loss_rel_diff", "_val_loss_rel_diff")
        metrics += [{"name": name, "value": round(d, 6), "unit": "fraction"},
                    {"name": val_name, "value": round(dv, 6), "unit": "fraction"}]
        rows += [(name, d, judged, f"{what}: mean training loss of the last {a['window']} "
                  "steps"),
                 (val_name, dv, judged, f"{what}: validation loss")]
    for run, r in ok.items():
        metrics += [
            {"name": f"convergence_last_mean_loss_{run}", "value": round(r["last_mean"], 5),
             "unit": "loss"},
            {"name": f"convergence_val_loss_{run}", "value": round(r["val_loss"], 5),
             "unit": "loss"},
            {"name": f"convergence_step_s_{run}", "value": round(r["step_s"], 4), "unit": "s"},
        ]
    return metrics, rows


def print_tables(results, rows):
    print()
    hdr = (f"{'run':18s} {'first':>7s} {'last':>7s} {'last-N mean':>11s} {'validation':>10s} "
           f"{'s/step':>7s} {'wall s':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if "error" in r:
            print(f"{r['run']:18s} failed: {r['error'].splitlines()[0][:200]}")
            continue
        print(f"{r['run']:18s} {r['first_loss']:7.4f} {r['last_loss']:7.4f} "
              f"{r['last_mean']:11.4f} {r['val_loss']:10.4f} {r['step_s']:7.3f} "
              f"{r.get('wall_s', 0):7.1f}")
    if not rows:
        return
    print()
    w = max(len(n) for n, *_ in rows)
    bound = f"|x| <= {TARGET_REL_DIFF:.0%}"
    print(f"{'result':{w}s} {'value':>9s}  {'target':24s} what")
    for name, v, judged, what in rows:
        if v is None:
            value, target = "-", f"{bound}: not measured"
        else:
            value = f"{v:+.3%}"
            target = (f"{bound}: met" if abs(v) <= TARGET_REL_DIFF else
                      f"{bound}: NOT met") if judged else "(reference)"
        print(f"{name:{w}s} {value:>9s}  {target:24s} {what}")


def smooth(values, n):
    """Mean of the last n values at each step (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def chart(ok, path, title, n=20):
    """Two panels, fp32 and compact state: above, each run's training loss (the
    mean of the last n steps), its last-window mean and validation loss in the
    legend; below, each other run's smoothed loss relative to the exact run's,
    against the 1% target. None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG chart")
        return None
    panels = [(fmt, [r for r in ok.values() if r["compact_state"] == (fmt == "compact")])
              for fmt in ("fp32", "compact")]
    panels = [(fmt, rs) for fmt, rs in panels if rs]
    if not panels:
        return None
    fig, axes = plt.subplots(2, len(panels), figsize=(7 * len(panels), 7), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [3, 1]})
    for col, (fmt, rs) in enumerate(panels):
        ax, dax = axes[0][col], axes[1][col]
        curves = {r["run"]: smooth(r["losses"], n) for r in rs}
        for r in rs:
            ys = curves[r["run"]]
            ax.plot(range(1, len(ys) + 1), ys, "--" if r["delay"] else "-", linewidth=1.2,
                    label=f"{r['run']} (delay={r['delay']}): last {r['window']} "
                    f"{r['last_mean']:.4f}, val {r['val_loss']:.4f}")
        # Leave the first tenth's steep fall off the scale.
        tails = [ys[len(ys) // 10:] for ys in curves.values()]
        lo, hi = min(min(t) for t in tails), max(max(t) for t in tails)
        ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.02 * (hi - lo))
        ax.set_title(f"{fmt} state")
        ax.set_ylabel(f"training loss (nats/byte, {n}-step mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ref = next((r for r in rs if r["run"].endswith("_exact")), None)
        for r in (r for r in rs if ref and r is not ref):
            base, ys = curves[ref["run"]], curves[r["run"]]
            dax.plot(range(1, len(ys) + 1), [100 * (b - a) / a for a, b in zip(base, ys)],
                     linewidth=1.0, label=f"{r['run']} vs {ref['run']}")
        for y in (-100 * TARGET_REL_DIFF, 100 * TARGET_REL_DIFF):
            dax.axhline(y, color="grey", linestyle=":", linewidth=1)
        dax.set_ylabel("difference, %")
        dax.set_xlabel("step")
        dax.grid(alpha=0.3)
        if len(rs) > 1:
            dax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(results, config, machine, date, commit, out_dir, tag=""):
    """Prints the tables, writes convergence_<machine>_<date>[_<tag>].json and
    its PNG into out_dir. True when every run finished."""
    ok = finished(results)
    metrics, rows = metrics_of(ok, {r["run"] for r in results})
    print_tables(results, rows)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"convergence_{machine}_{date}" + (f"_{tag}" if tag else ""))
    targets = {name: f"|x| <= {TARGET_REL_DIFF}" for name, *_ in PAIRS
               if name.startswith("convergence_delay")}
    doc = {"machine": machine, "date": date, "commit": commit, "results": metrics,
           "targets": targets, "config": config, "runs": results}
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {stem}.json")
    first = next(iter(ok.values()), None)
    if first:
        title = (f"{machine}, {date}: GPT {first['params'] / 1e6:.1f}M parameters "
                 f"({first['layers']} x {first['d_model']}), byte tokens, batch "
                 f"{config.get('batch')} x {first['seq']}, {len(first['losses'])} steps, "
                 f"dosd policy {config.get('policy')}, delay_warmup "
                 f"{config.get('delay_warmup')}")
        png = chart(ok, stem + ".png", title)
        if png:
            print(f"wrote {png}")
    return bool(ok) and len(ok) == len(results)


def merge(paths, out_dir, tag=""):
    """One report of the runs of several result files (e.g. the fp32 pair and
    the compact pair run in two calls): the first file's machine, date, commit
    and config, each file's own config kept under config["parts"]. A run in
    more than one file: its last finished record (else its last failure)."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    by_run = {}
    for r in (r for d in docs for r in d["runs"]):
        if "last_mean" in r or "last_mean" not in by_run.get(r["run"], {}):
            by_run[r["run"]] = r
    config = dict(docs[0]["config"], parts=[
        {"file": os.path.basename(p), "commit": d["commit"], "config": d["config"]}
        for p, d in zip(paths, docs)])
    first = docs[0]
    return write(list(by_run.values()), config, first["machine"], first["date"],
                 first["commit"], out_dir, tag)
