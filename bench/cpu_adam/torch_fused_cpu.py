#!/usr/bin/env python3
"""PyTorch's CPU AdamW on the same problem as dos_bench_cpu_adam: the peer's figure.

Measures torch.optim.AdamW(fused=True) on CPU fp32 tensors (fp32 params, grads
and state: 16 bytes read + 12 written per param, the same 28 bytes as DOS's
bf16-gradient / bf16-weight line) with the given size and thread count; median
of --repeats steps after one warm-up step. Where fused CPU AdamW does not exist
(torch < 2.4, e.g. 1.13) it falls back to foreach=True and says so, in the
output and in the JSON entry's "note".

Merges torch_fused_cpu_adamw_gparams (and per-thread entries plus the speedup
of DOS's main line over it) into the JSON file that dos_bench_cpu_adam wrote.
"""
import argparse
import json
import os
import statistics
import time

import torch


def make_optimizer(params, fused):
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if fused:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, foreach=True, **kwargs)


def try_fused(n_probe=1024):
    """True when this torch runs fused AdamW on CPU tensors."""
    p = torch.zeros(n_probe, requires_grad=True)
    p.grad = torch.ones(n_probe)
    try:
        make_optimizer([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError) as e:
        print(f"torch {torch.__version__}: fused CPU AdamW unavailable ({str(e).splitlines()[0]}); "
              "falling back to foreach=True")
        return False


def measure(n, threads, repeats, fused):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    p = torch.rand(n, generator=g).sub_(0.5).requires_grad_(True)
    p.grad = torch.rand(n, generator=g).sub_(0.5).mul_(1e-2)
    opt = make_optimizer([p], fused)
    opt.step()  # warm-up: allocates and first-touches exp_avg / exp_avg_sq
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=256 << 20)
    ap.add_argument("--quick", action="store_true", help="16Mi params, 3 repeats")
    ap.add_argument("--threads", default="", help="comma list; default: all cores")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", required=True, help="results file of dos_bench_cpu_adam to merge into")
    args = ap.parse_args()
    if args.quick:
        args.params, args.repeats = 16 << 20, 3
    threads = [int(t) for t in args.threads.split(",") if t] or [os.cpu_count()]

    fused = try_fused()
    impl = "fused" if fused else "foreach (fused CPU AdamW unavailable in torch %s)" % torch.__version__
    try:
        with open(args.json) as f:
            doc = json.load(f)
    except FileNotFoundError:
        doc = {"machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "commit": "unknown", "results": []}
    results = {r["name"]: r for r in doc["results"]}

    def put(name, value, unit, note=None):
        entry = {"name": name, "value": round(value, 6), "unit": unit}
        if note:
            entry["note"] = note
        results[name] = entry

    print(f"torch {torch.__version__} AdamW {impl}, params={args.params}")
    print(f"{'threads':>7} {'Gparam/s':>10} {'GB/s':>8} {'host GB/s':>10} {'% host':>8} {'DOS/torch':>10}")
    for t in threads:
        gparams = measure(args.params, t, args.repeats, fused)
        gbs = gparams * 28
        host = results.get(f"host_bw_gbs_t{t}", {}).get("value")
        dos = results.get(f"cpu_adam_gparams_fp32state_bf16grad_bf16out_t{t}", {}).get("value")
        pct = f"{100 * gbs / host:7.1f}%" if host else "       -"
        ratio = f"{dos / gparams:9.2f}x" if dos else "         -"
        host_s = f"{host:10.1f}" if host else "         -"
        print(f"{t:7d} {gparams:10.3f} {gbs:8.1f} {host_s} {pct} {ratio}")
        put(f"torch_fused_cpu_adamw_gparams_t{t}", gparams, "Gparam/s", None if fused else impl)
        if dos:
            put(f"cpu_adam_speedup_vs_torch_fused_t{t}", dos / gparams, "x")
        if t == max(threads):
            put("torch_fused_cpu_adamw_gparams", gparams, "Gparam/s", None if fused else impl)
            main_line = results.get("cpu_adam_gparams_fp32state_bf16grad_bf16out", {}).get("value")
            if main_line:
                put("cpu_adam_speedup_vs_torch_fused", main_line / gparams, "x")
            compact = results.get("cpu_adam_gparams_bf16state_bf16grad_bf16out", {}).get("value")
            if compact:
                put("cpu_adam_compact_speedup_vs_torch_fused", compact / gparams, "x",
                    "compact state (bf16 m, v; 20 bytes/param) over torch fused fp32 AdamW")
    doc["results"] = list(results.values())
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"merged into {args.json}")


if __name__ == "__main__":
    main()
