#!/usr/bin/env python3
"""Largest model per node (issue 14 item 5): the largest GPT that trains
--iters iterations on this machine under a GPU budget, with fp32 optimizer
state (`dos_auto`) and with compact state (`dos_auto_compact`), and what
limits it.

Device time is scarce, so nothing is found by trial from below. For each
format the memory arithmetic predicts the largest model (widths fixed,
d_model / heads = --head-dim, layers grown):

  host:  dosd holds bytes_per_param x P of state (12 fp32, 8 compact) plus
         a fixed overhead (staging, gradients in flight, code), the trainer
         its own host memory, all within /proc/meminfo's MemAvailable less a
         margin;
  GPU:   the trainer holds 4 B a parameter (bf16 weights and gradients) plus
         activations (one checkpoint per block: each block's input, one
         block recomputed, the logits), its lease's headroom and dosd's
         staging slots within the budget (what run.py's DOS modes do).

The predicted largest is tried first, each try in bench/e2e/run.py's trainer
(a child process, the same code as the e2e benchmark, weights initialised in
bf16 on the device) against a fresh dosd with --host_memory_limit set to the
state the arithmetic allows (so a model too large for host memory is refused
at registration in seconds instead of being killed by the kernel). On failure
the size steps down and the failure is classified:

  host_budget_refused  dosd refused the registration (--host_memory_limit)
  host_oom_killed      the kernel killed dosd or the trainer (SIGKILL)
  host_alloc_failed    dosd could not allocate or page-lock its state
  gpu_oom              CUDA out of memory in the trainer
  gpu_over_budget      trained, but the device's peak exceeded the budget
  timeout, dosd_died, error

After each success the measured dosd overhead, trainer host peak and trainer
GPU peak replace the estimates for the next format. Writes
bench/results/largest_<machine>_<date>.json (largest_model_params_fp32,
largest_model_params_compact, every candidate's outcome).

  python3 bench/e2e/largest.py --dosd .dist/bin/dosd --machine nvidia-h200 --gpu-budget-gb 80
  # CPU smoke (tiny widths, a fake host memory so that the first tries are refused):
  python3 bench/e2e/largest.py --device cpu --dosd build/daemon/dosd --d-model 64 \\
      --head-dim 16 --seq 32 --vocab 256 --mem-available-gib 0.004 --host-limit-gib 0.003 \\
      --trainer-host-gib 0 --dosd-overhead-gib 0 --host-margin-gib 0 --out /tmp/largest
"""
import argparse
import atexit
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run as e2e  # noqa: E402 (the trainer, dosd's start and stop, the commit)

GiB = 2**30
# state format -> (run.py mode, dosd's host bytes of state a parameter)
FORMATS = {"fp32": ("dos_auto", 12), "compact": ("dos_auto_compact", 8)}
PARAM_GPU_BYTES = 4  # bf16 weights + bf16 gradients, registered in place
STATE_GPU_BYTES = 12  # dosd's staging slots hold fp32 state whatever the format


# ------------------------------------------------------------ arithmetic ----

def gpt_params(layers, d, seq, vocab):
    """Parameters of client/python/examples/gpt.py's GPT: per block qkv (3d^2
    + 3d), proj (d^2 + d), fc (4d^2 + 4d), out (4d^2 + d), two LayerNorms (4d);
    token and position embeddings, the final LayerNorm and the untied head."""
    return layers * (12 * d * d + 13 * d) + 2 * vocab * d + seq * d + 2 * d


def activation_bytes(layers, d, seq, batch, vocab):
    """The trainer's GPU memory beyond weights and gradients, bf16 with one
    checkpoint per block: every block's input (2 B x batch x seq x d), one
    block's forward and backward recomputed (~40 such tensors), and the logits
    with their fp32 copies and gradients (~14 B a logit)."""
    bsd = 2 * batch * seq * d
    return layers * bsd + 40 * bsd + 14 * batch * seq * vocab


class Budget:
    """The memory arithmetic: what a candidate needs against what there is.
    Host figures in bytes; gpu_budget 0 = no GPU limit (CPU runs)."""

    def __init__(self, mem_available, trainer_host, dosd_overhead, host_margin,
                 gpu_budget=0, dosd_context=GiB, subgroup_size=100_000_000, staging_slots=2,
                 gpu_extra=5 * GiB):
        self.mem_available = mem_available
        self.trainer_host = trainer_host
        self.dosd_overhead = dosd_overhead
        self.host_margin = host_margin
        self.gpu_budget = gpu_budget
        self.dosd_context = dosd_context
        self.staging = staging_slots * subgroup_size * STATE_GPU_BYTES
        # Beyond the estimate: the allocator's reserve over what it hands out
        # (measured 3.0 GiB at 34 x 4608, 4.8 at 40 x 5120); then calibrated.
        self.gpu_extra = gpu_extra

    def state_limit(self):
        """Host bytes of optimizer state left for dosd (its --host_memory_limit)."""
        return max(0, self.mem_available - self.trainer_host - self.dosd_overhead -
                   self.host_margin)

    def host_need(self, params, fmt):
        return FORMATS[fmt][1] * params + self.dosd_overhead + self.trainer_host + \
            self.host_margin

    def trainer_gpu_room(self):
        """What the trainer may hold on the GPU: its fraction (budget less the
        CUDA contexts) less the lease's headroom (max(1 GiB, 5%), dos._lease)
        and dosd's staging slots, which come out of the lease."""
        fraction = self.gpu_budget - self.dosd_context
        return fraction - max(GiB, fraction // 20) - self.staging

    def gpu_need(self, layers, d, seq, batch, vocab):
        return PARAM_GPU_BYTES * gpt_params(layers, d, seq, vocab) + \
            activation_bytes(layers, d, seq, batch, vocab) + self.gpu_extra

    def check(self, fmt, layers, d, seq, batch, vocab):
        """(host need, GPU need, [limits exceeded: "host memory", "GPU memory"])."""
        p = gpt_params(layers, d, seq, vocab)
        host = self.host_need(p, fmt)
        gpu = self.gpu_need(layers, d, seq, batch, vocab)
        over = []
        if host > self.mem_available:
            over.append("host memory")
        if self.gpu_budget and gpu > self.trainer_gpu_room():
            over.append("GPU memory")
        return host, gpu, over

    def predict(self, fmt, d, seq, batch, vocab, max_layers):
        """The most layers that fit (0: none), and what the next layer exceeds."""
        lo = 0
        for layers in range(1, max_layers + 1):
            if self.check(fmt, layers, d, seq, batch, vocab)[2]:
                return lo, self.check(fmt, layers, d, seq, batch, vocab)[2]
            lo = layers
        return lo, ["--max-layers"]

    def calibrate(self, rec, fmt, host=True):
        """Takes a successful candidate's measured peaks as the estimates (the
        host ones only where the host memory is real, host=True)."""
        p = rec["params"]
        if host and rec.get("dosd_host_peak_bytes"):
            self.dosd_overhead = max(0, rec["dosd_host_peak_bytes"] - FORMATS[fmt][1] * p)
        if host and rec.get("host_peak_bytes"):
            self.trainer_host = rec["host_peak_bytes"]
        if rec.get("gpu_peak_reserved_bytes"):
            est = PARAM_GPU_BYTES * p + activation_bytes(
                rec["layers"], rec["d_model"], rec["seq"], rec["batch"], rec["vocab"])
            self.gpu_extra = rec["gpu_peak_reserved_bytes"] - est


def step_down(layers, step_frac):
    """The next, smaller candidate after a failure at `layers`."""
    return layers - max(1, math.ceil(step_frac * layers))


def classify(rec, gpu_budget=0, gpu_tolerance=GiB // 2):
    """What made a candidate fail (None: it trained within the budget)."""
    err = (rec.get("error") or "") + "\n" + (rec.get("traceback") or "")
    if "error" not in rec:
        if gpu_budget and rec.get("gpu_peak_device_bytes", 0) > gpu_budget + gpu_tolerance:
            return "gpu_over_budget"
        return None
    if rec.get("timed_out"):
        return "timeout"
    if rec.get("dosd_died") == -9 or rec.get("rc") == -9:
        return "host_oom_killed"  # SIGKILL: nothing here sends it but the OOM killer
    if "RESOURCE_EXHAUSTED" in err and ("host optimizer state" in err or
                                        "host_memory_limit" in err):
        return "host_budget_refused"
    if "OutOfMemoryError" in err or "CUDA out of memory" in err:
        return "gpu_oom"
    if rec.get("dosd_died") is not None:
        return "dosd_died"
    low = err.lower()
    if any(s in low for s in ("cannot allocate memory", "enomem", "mlock", "page-lock",
                              "bad_alloc")):
        return "host_alloc_failed"
    return "error"


LIMIT_OF = {"host_budget_refused": "host memory", "host_oom_killed": "host memory",
            "host_alloc_failed": "host memory", "gpu_oom": "GPU memory",
            "gpu_over_budget": "GPU memory"}


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text)
    except (OSError, ValueError):  # absent, or "max"
        return None


def cgroup_available(root="/sys/fs/cgroup"):
    """What this process's memory cgroup still allows (its limit less its use,
    plus the inactive page cache it can drop), or None without a limit: in a
    container /proc/meminfo shows the host's memory, not the cgroup's."""
    for limit_f, use_f, stat_f in (("memory.max", "memory.current", "memory.stat"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes", "memory/memory.stat")):
        limit = _read_int(os.path.join(root, limit_f))
        use = _read_int(os.path.join(root, use_f))
        if limit is None or use is None or limit >= 1 << 60:
            continue
        inactive = 0
        try:
            with open(os.path.join(root, stat_f)) as f:
                for line in f:
                    k, v = line.split()[:2]
                    if k in ("inactive_file", "total_inactive_file"):
                        inactive = int(v)
        except (OSError, ValueError):
            pass
        return max(0, limit - use + inactive)
    return None


def mem_available():
    """Host memory a new process may take: /proc/meminfo MemAvailable, or the
    memory cgroup's room where that is smaller."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    if avail is None:
        raise SystemExit("/proc/meminfo has no MemAvailable; give --mem-available-gib")
    cg = cgroup_available()
    return avail if cg is None else min(avail, cg)


def wait_for_memory(target, deadline_s):
    """After a failed candidate the kernel may still be reclaiming its memory:
    wait (bounded) until MemAvailable is back to `target`."""
    end = time.monotonic() + deadline_s
    while True:
        now = mem_available()
        if now >= target or time.monotonic() > end:
            return now
        time.sleep(0.5)


# ---------------------------------------------------------------- search ----

def candidate_record(fmt, layers, args, budget, rec, failure, wall_s):
    d = args.d_model
    p = gpt_params(layers, d, args.seq, args.vocab)
    host, gpu, over = budget.check(fmt, layers, d, args.seq, args.batch, args.vocab)
    out = {"format": fmt, "layers": layers, "d_model": d, "heads": d // args.head_dim,
           "shape": f"{layers} x {d}", "params": p, "outcome": "failed" if failure else "ok",
           "failure_class": failure,
           "predicted_host_gib": round(host / GiB, 2),
           "predicted_trainer_gpu_gib": round(gpu / GiB, 2) if budget.gpu_budget else None,
           "host_state_limit_gib": round(rec.get("_host_limit", 0) / GiB, 2),
           "wall_s": round(wall_s, 1)}
    if rec.get("params") and rec["params"] != p:
        out["params_measured"] = rec["params"]  # the arithmetic disagrees with gpt.py
    for key, name in (("dosd_host_peak_bytes", "dosd_host_peak_gib"),
                      ("host_peak_bytes", "trainer_host_peak_gib"),
                      ("gpu_peak_device_bytes", "gpu_peak_device_gib"),
                      ("gpu_peak_reserved_bytes", "gpu_peak_trainer_reserved_gib"),
                      ("gpu_peak_allocated_bytes", "gpu_peak_trainer_allocated_gib")):
        if rec.get(key):
            out[name] = round(rec[key] / GiB, 2)
    if "iter_s" in rec:
        out.update(s_per_iter=round(rec["iter_s_pipelined_median"], 4),
                   s_per_iter_mean=round(rec["iter_s"], 4),
                   setup_s=round(rec["model_init_s"] + rec["setup_s"], 2),
                   model_init_s=round(rec["model_init_s"], 2),
                   register_s=round(rec["setup_s"], 2),
                   iterations=len(rec.get("losses", [])), last_loss=rec.get("last_loss"))
        if rec.get("gpu_lease"):
            out["gpu_lease_gib"] = round(rec["gpu_lease"]["lease_bytes"] / GiB, 2)
    if failure and rec.get("error"):
        out["error"] = rec["error"].strip().splitlines()[-1][:400]
    if rec.get("dosd_died") is not None:
        out["dosd_exit"] = rec["dosd_died"]
    return out


def search(args, runner, budget, formats, clock=time.perf_counter, on_candidate=None):
    """Per format: the predicted largest first, then smaller after each failure;
    after a success, larger while the arithmetic, now calibrated by what the
    success measured, says a larger model fits below the smallest failure
    (--no-probe-up: never). runner(fmt, layers, host_limit, timeout) ->
    run.py's record; on_candidate(candidates, summary) after each. Returns
    (candidates, {fmt: summary})."""
    start = clock()
    est = args.est_candidate_s  # one candidate's wall time, then measured
    candidates, summary = [], {}
    shape = (args.d_model, args.seq, args.batch, args.vocab)
    for i, fmt in enumerate(formats):
        later = len(formats) - i - 1  # formats after this one: keep time for them
        layers, beyond = budget.predict(fmt, *shape, args.max_layers)
        s = {"predicted_layers": layers, "predicted_limit": " and ".join(beyond),
             "largest": None, "tried": 0}
        summary[fmt] = s
        failed = []  # this format's failed candidates
        while layers >= 1:
            left = args.time_budget_s - (clock() - start)
            need = est * (1 + later) if s["tried"] else est
            if left < need:
                s["stopped"] = f"time budget ({left:.0f} s left, a candidate takes ~{est:.0f} s)"
                break
            # dosd's --host_memory_limit: the state the arithmetic allows (plus
            # 64 MiB for page rounding), --host-limit-gib, or none (0).
            limit = budget.state_limit() + (64 << 20) if args.host_limit_gib is None else \
                int(args.host_limit_gib * GiB)
            t = clock()
            rec = runner(fmt, layers, limit, min(args.candidate_timeout_s, max(30.0, left)))
            rec["_host_limit"] = limit
            failure = classify(rec, budget.gpu_budget, int(args.gpu_tolerance_gib * GiB))
            c = candidate_record(fmt, layers, args, budget, rec, failure, clock() - t)
            candidates.append(c)
            s["tried"] += 1
            if failure is None:
                s["largest"] = c
            if on_candidate:
                on_candidate(candidates, summary)
            print(f"   {fmt} {c['shape']} ({billions(c['params'])}): "
                  + (f"ok, {c['s_per_iter']:.3f} s/iter, dosd {c.get('dosd_host_peak_gib')} GiB,"
                     f" GPU {c.get('gpu_peak_device_gib')} GiB" if not failure else
                     f"FAILED: {failure}") + f" ({c['wall_s']:.0f} s)", flush=True)
            if failure:
                failed.append(c)
                if s["largest"]:  # a step up failed: halve the gap, if there is one
                    layers = (s["largest"]["layers"] + layers) // 2
                    if layers <= s["largest"]["layers"]:
                        break
                else:
                    layers = step_down(layers, args.step_frac)
                continue
            est = c["wall_s"]  # a success is the longest a candidate takes
            budget.calibrate(rec, fmt, host=args.mem_available_gib is None)
            if not args.probe_up:
                break
            nxt = budget.predict(fmt, *shape, args.max_layers)[0]
            if failed:
                nxt = min(nxt, min(f["layers"] for f in failed) - 1)
            if nxt <= layers:
                break
            layers = nxt
        c = s["largest"]
        if c:
            above = [f for f in failed if f["layers"] > c["layers"]]
            if above:
                f = min(above, key=lambda f: f["layers"])
                s["limit"] = LIMIT_OF.get(f["failure_class"], f["failure_class"])
                s["limit_evidence"] = (f"measured: {f['shape']} ({billions(f['params'])}) "
                                       f"failed with {f['failure_class']}")
            else:
                nxt = c["layers"] + 1
                host, gpu, over = budget.check(fmt, nxt, *shape)
                s["limit"] = " and ".join(over) or "--max-layers"
                s["limit_evidence"] = (
                    f"predicted: {nxt} x {args.d_model} needs {host / GiB:.1f} GiB of host memory "
                    f"({budget.mem_available / GiB:.1f} available)" +
                    (f" and {gpu / GiB:.1f} GiB in the trainer on the GPU "
                     f"({budget.trainer_gpu_room() / GiB:.1f} room)" if budget.gpu_budget else ""))
    return candidates, summary


# ---------------------------------------------------------------- main ----

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dosd", default=None, help="dosd binary (a fresh one per candidate)")
    ap.add_argument("--dosd-arg", action="append", help="extra dosd flag (repeatable)")
    ap.add_argument("--formats", default="fp32,compact")
    ap.add_argument("--d-model", type=int, default=4608)
    ap.add_argument("--head-dim", type=int, default=128, help="heads = d_model / head_dim")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-layers", type=int, default=400)
    ap.add_argument("--no-probe-up", dest="probe_up", action="store_false",
                    help="after a success, do not try the larger size the calibrated "
                         "arithmetic allows")
    ap.add_argument("--gpu-budget-gb", type=float, default=0,
                    help="the emulated card in GiB (run.py's meaning); 0: no GPU limit")
    ap.add_argument("--dosd-context-gb", type=float, default=1.0,
                    help="GPU memory outside the trainer's fraction (run.py)")
    ap.add_argument("--gpu-tolerance-gib", type=float, default=0.5,
                    help="device peak above the budget still counted as within it")
    ap.add_argument("--subgroup-size", type=int, default=100_000_000,
                    help="dosd's subgroup size (staging slots hold 3 subgroups' fp32 state)")
    ap.add_argument("--mem-available-gib", type=float, default=None,
                    help="host memory to plan with (default: /proc/meminfo MemAvailable)")
    ap.add_argument("--trainer-host-gib", type=float, default=2.0,
                    help="the trainer's host memory (estimate until a candidate measured it; "
                         "1.17 GiB measured at 9-13B)")
    ap.add_argument("--dosd-overhead-gib", type=float, default=3.5,
                    help="dosd's host memory beyond its state (3.2-3.25 GiB measured at 6-13B)")
    ap.add_argument("--host-margin-gib", type=float, default=2.0)
    ap.add_argument("--host-limit-gib", type=float, default=None,
                    help="dosd --host_memory_limit in GiB (default: the state the arithmetic "
                         "allows; 0: none)")
    ap.add_argument("--step-frac", type=float, default=0.06,
                    help="after a failure, drop this fraction of the layers (at least one)")
    ap.add_argument("--time-budget-s", type=float, default=450)
    ap.add_argument("--candidate-timeout-s", type=float, default=200)
    ap.add_argument("--est-candidate-s", type=float, default=75,
                    help="one candidate's wall time before one was measured")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(e2e.REPO, "bench", "results"))
    args = ap.parse_args(argv)
    if args.d_model % args.head_dim:
        raise SystemExit(f"--d-model {args.d_model} is not a multiple of --head-dim "
                         f"{args.head_dim}")
    for f in args.formats.split(","):
        if f not in FORMATS:
            raise SystemExit(f"--formats: unknown {f!r}; use fp32 and/or compact")
    return args


def billions(p):
    return f"{p / 1e9:.2f}B" if p >= 1e8 else f"{p / 1e6:.2f}M"


def main(argv=None):
    args = parse_args(argv)
    if not args.dosd:
        raise SystemExit("give --dosd PATH: every candidate gets a fresh dosd")
    formats = args.formats.split(",")
    machine = args.machine or ("vm-cpu" if args.device == "cpu" else "nvidia-h200")
    cg0 = cgroup_available()
    avail0 = int(args.mem_available_gib * GiB) if args.mem_available_gib is not None \
        else mem_available()
    budget = Budget(avail0, int(args.trainer_host_gib * GiB), int(args.dosd_overhead_gib * GiB),
                    int(args.host_margin_gib * GiB), int(args.gpu_budget_gb * GiB),
                    int(args.dosd_context_gb * GiB), args.subgroup_size)
    tmp = tempfile.mkdtemp(prefix="dos-largest-")
    # The candidates' sockets and logs go when the search ends
    # (DOS_KEEP_TEST_DIRS=1 keeps them to look at).
    if os.environ.get("DOS_KEEP_TEST_DIRS") != "1":
        atexit.register(shutil.rmtree, tmp, True)
    print(f"host memory to plan with {avail0 / GiB:.1f} GiB; GPU budget "
          f"{args.gpu_budget_gb:g} GiB (trainer room {budget.trainer_gpu_room() / GiB:.1f} GiB)"
          if args.gpu_budget_gb else f"host memory to plan with {avail0 / GiB:.3f} GiB",
          flush=True)

    def runner(fmt, layers, host_limit, timeout):
        if args.mem_available_gib is None:  # a killed candidate's memory comes back first
            wait_for_memory(avail0 - 2 * GiB, 30)
        mode = FORMATS[fmt][0]
        heads = args.d_model // args.head_dim
        targs = argparse.Namespace(
            socket=None, dosd=args.dosd, dosd_arg=args.dosd_arg, device=args.device,
            flag_budget_gb=0,
            passthrough=["--device", args.device, "--size", "tiny", "--layers", str(layers),
                         "--d-model", str(args.d_model), "--heads", str(heads),
                         "--seq", str(args.seq), "--vocab", str(args.vocab),
                         "--batch", str(args.batch), "--iters", str(args.iters),
                         "--warmup", "0", "--no-phases", "--init-bf16", "--lr", str(args.lr),
                         "--clip", str(args.clip), "--subgroup-size", str(args.subgroup_size),
                         "--gpu-budget-gb", str(args.gpu_budget_gb),
                         "--dosd-context-gb", str(args.dosd_context_gb)])
        extra = [f"--host_memory_limit={host_limit}"] if host_limit else []
        extra.append(f"--subgroup_size={args.subgroup_size}")
        return e2e.run_mode(targs, mode, tmp, dosd_extra=extra, timeout=timeout,
                            tag=f"{fmt}-{layers}x{args.d_model}")

    date = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"largest_{machine}_{date}{suffix}.json")
    t0 = time.perf_counter()

    def write(candidates, summary):
        """The result file, rewritten after every candidate (a search cut short
        by an outer timeout still leaves what it measured)."""
        results = []
        for fmt in formats:
            c = summary.get(fmt, {}).get("largest")
            if c:
                results += [{"name": f"largest_model_params_{fmt}", "value": c["params"],
                             "unit": "params"},
                            {"name": f"largest_model_s_per_iter_{fmt}",
                             "value": c["s_per_iter"], "unit": "s"}]
        doc = {"machine": machine, "date": date, "commit": e2e.git_commit(),
               "results": results,
               "config": {"argv": sys.argv[1:] if argv is None else list(argv),
                          "mem_available_gib": round(avail0 / GiB, 2),
                          "cgroup_available_gib": None if cg0 is None else round(cg0 / GiB, 2),
                          "gpu_budget_gib": args.gpu_budget_gb, "d_model": args.d_model,
                          "head_dim": args.head_dim, "seq": args.seq, "batch": args.batch,
                          "vocab": args.vocab, "iters": args.iters, "clip": args.clip,
                          "search_s": round(time.perf_counter() - t0, 1)},
               "summary": {f: {k: v for k, v in s.items() if k != "largest"} |
                           {"largest_shape": s["largest"]["shape"] if s["largest"] else None,
                            "largest_params": s["largest"]["params"] if s["largest"] else None}
                           for f, s in summary.items()},
               "candidates": candidates}
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)

    candidates, summary = search(args, runner, budget, formats, on_candidate=write)
    write(candidates, summary)
    total = time.perf_counter() - t0
    print()
    for fmt in formats:
        s = summary[fmt]
        c = s["largest"]
        print(f"{fmt:8s} largest: " + (f"{c['shape']} = {billions(c['params'])} parameters, "
                                       f"{c['s_per_iter']:.3f} s/iter, dosd "
                                       f"{c.get('dosd_host_peak_gib')} GiB; limit: {s['limit']} "
                                       f"({s['limit_evidence']})" if c else
                                       f"none ({s.get('stopped', 'every candidate failed')})"))
    print(f"search took {total:.0f} s; wrote {path}")
    return 0 if all(summary[f]["largest"] for f in formats) else 1


if __name__ == "__main__":
    sys.exit(main())
