#!/usr/bin/env python3
"""End-to-end training benchmark: the GPT example (client/python/examples/gpt.py,
bf16, activation checkpointing, random tokens) trained with

  dos_auto            dos.torch.AdamW(model=...), dosd policy auto, clip_grad_norm_ 1.0;
                      step() returns once queued and each layer of the next forward
                      waits (on the GPU stream) for just its own subgroups. Defaults: dosd
                      has no --gpu_memory_budget; the trainer lends it what its budget
                      (the per-process memory fraction) leaves after its peak (GPU lease)
  dos_auto_flag       (optional) the former way: the trainer lends nothing
                      (gpu_budget_bytes=0) and dosd runs with --gpu_memory_budget=
                      --flag-budget-gb, left out of the trainer's fraction by hand
  dos_auto_wholestep  (optional) the next forward waits for the whole step on the stream
  dos_auto_sync       (optional) step() waits on the host (async_step=False): minus
                      dos_auto, the gain of overlapping the update with the next forward
  dos_auto_compact    dos_auto with compact optimizer state (compact_state=True: bf16
                      exp_avg / exp_avg_sq in dosd, 8 bytes of state a parameter)
  dos_auto_overlap    dos_auto with overlap=True (torch >= 2.1): an early step begun at the
                      first gradient (dosd plans it and grows its resident tier during
                      backward), clip 1.0 through opt.clip_grad_norm_ (the coefficient
                      goes to dosd with step(); gradients are not touched)
  dos_auto_noclip     per-layer waits, no clipping, overlap="update" (torch >= 2.1): dosd
                      updates each subgroup during backward as soon as its gradients are final
  dos_auto_noclip_nooverlap   (optional) the same without overlap: the overlap's gain
  dos_auto_delay      (optional) dos_auto with delay=1 (issue 23): the subgroups dosd
                      updates on the host CPU are updated one step late, during the next
                      forward and backward (the GPU path's at once); delay_warmup=
                      --delay-warmup (2) undelayed steps first, which --warmup must exceed;
                      overlap left at dos.torch's default (on for CUDA with the delay) and
                      torch's clip_grad_norm_ in place: the gradients copied during
                      backward are copied again at the verdict (DOS_TORCH_CLIP_SCALED=1:
                      kept and scaled by torch's coefficient, dos/_inplace.py)
  dos_auto_compact_delay  (optional) dos_auto_compact with delay=1
  dos_auto_overlap_delay  (optional) dos_auto_overlap with delay=1: the step begins during
                      backward, so that dosd plans it (and, with dosd --gpu_prefetch, loads
                      the first streamed subgroups' state) before step()
  dos_auto_compact_overlap_delay  (optional) the same with compact state
  dos_cpu             dos.torch.AdamW, dosd policy cpu, clip 1.0
  inprocess_offload   HybridDeviceOptimizer-style in-process CPU offload (baselines.py), clip 1.0
  all_gpu             fp32 masters + torch.optim.AdamW(fused=True) on the GPU, clip 1.0
                      (no GPU budget unless --budget-all-gpu)

Iteration time: `iter_s` is measured over --iters iterations run back to back without
synchronising (as training runs); forward/backward/update come from as many iterations
synchronised after each phase (iter_s_phases is their sum); the exposed update is iter_s less
forward and backward (what of the update the back-to-back iteration does not hide), and the
chart stacks forward, backward and exposed update per mode. With delay=1 the synchronised
update phase is what step() still costs (the GPU path and the wait for the previous step's
host path); the delayed update's share hidden in forward and backward comes from dosd's
reports (opt.last_step: delayed_update_us less delayed_wait_us) and is drawn as a hatched
bar over forward and backward, beside the planner's predicted iteration time.

Every mode runs in its own child process (clean GPU and host memory peaks); DOS modes
get a fresh dosd (--dosd PATH), or use $DOS_SOCKET. Prints a table, writes
bench/results/e2e_<machine>_<date>.json and a PNG chart (if matplotlib is installed).

  python3 bench/e2e/run.py --dosd .dist/bin/dosd                       # ~1.5B, one H200
  python3 bench/e2e/run.py --dosd .dist/bin/dosd --size 6b --gpu-budget-gb 80
  python3 bench/e2e/run.py --dosd build/daemon/dosd --device cpu       # tiny smoke run
"""
import argparse
import datetime
import json
import os
import signal
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))
sys.path.insert(0, HERE)

ALL_MODES = ["dos_auto", "dos_auto_compact", "dos_auto_overlap", "dos_auto_noclip", "dos_cpu",
             "inprocess_offload", "all_gpu"]
DEFAULT_BATCH = {"tiny": 8, "small": 4, "125m": 8, "350m": 8, "1.5b": 4, "3b": 2, "6b": 2,
                 "8b": 2}


# ---------------------------------------------------------------- child ----

def vm_hwm_bytes(pid="self"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid="self"):
    """User and system CPU time of a process so far (all its threads), from
    /proc/PID/stat; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class GpuSampler:
    """Device-wide GPU memory in use (every process, dosd included), sampled."""

    def __init__(self, torch, device):
        self.torch, self.device, self.peak, self.stop = torch, device, 0, False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop:
            free, total = self.torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free)
            time.sleep(0.02)

    def close(self):
        self.stop = True
        self.t.join()


# dosd's report on a step with delay=1 (issue 23; read with .get(key, 0), as
# a dos.torch without the delay lacks them): the CPU time of the previous
# step's host-path update, run during this step's forward and backward; how
# long this step waited for it (the part not hidden); the forward and backward
# window dosd measured between steps; the planner's predicted iteration
# (window + exposed update) and update; what this step deferred; dosd's
# time for the step (wall: from the request it read, an early step's begin
# during backward included; after_verdict: from an early step's verdict, what
# the trainer waits for after backward).
DELAY_KEYS = ("delayed_update_us", "delayed_wait_us", "window_us", "predicted_iter_us",
              "predicted_update_us", "delayed_subgroups", "delayed_params", "wall_us",
              "after_verdict_us")


def delay_of(mode):
    """The delay= a mode runs with (its name ends in _delay): 1, else 0."""
    return 1 if mode.endswith("_delay") else 0


def peek_report(opt):
    """dosd's report on the last step the optimizer has collected, read
    without collecting the step in flight. opt.last_step would collect it:
    it waits on the host for the step in flight (the GPU path and the wait
    for the previous delayed update), taking away the overlap with the next
    forward being measured. The report sits on the optimizer's Flight
    (dos/_flight.py, a plain attribute), which is private: None where it
    moved."""
    flight = getattr(getattr(opt, "_parts", None), "flight", None)
    return getattr(flight, "last_step", None)


def delay_figures(reports):
    """Medians over dosd's reports (one a step) in seconds: delayed_update_s,
    delayed_wait_s, window_s, predicted_iter_s, predicted_update_s, and
    delayed_hidden_s (per step the update less the wait: its share hidden in
    forward and backward); delayed_subgroups and delayed_params (deferred a
    step); delay_reports (how many) and delay_missing_keys (what no report
    had). {} without reports."""
    if not reports:
        return {}

    def med(f):
        return statistics.median(f(r) for r in reports)

    out = {k[:-3] + "_s": med(lambda r, k=k: r.get(k, 0) * 1e-6)
           for k in DELAY_KEYS if k.endswith("_us")}
    out["delayed_hidden_s"] = med(lambda r: max(0.0, r.get("delayed_update_us", 0) -
                                                r.get("delayed_wait_us", 0)) * 1e-6)
    for k in ("delayed_subgroups", "delayed_params"):
        out[k] = med(lambda r, k=k: r.get(k, 0))
    out["delay_reports"] = len(reports)
    out["delay_missing_keys"] = [k for k in DELAY_KEYS if not any(k in r for r in reports)]
    return out


def child(args):
    import torch
    import gpt
    cuda = args.device == "cuda"
    mode = args.child
    res = {"mode": mode, "torch": torch.__version__}
    lend_from = None  # the GPU lease's budget: dos.torch reads the fraction itself
    if cuda:
        torch.cuda.set_device(0)
        total = torch.cuda.get_device_properties(0).total_memory
        budget = args.gpu_budget_gb
        if budget and (mode != "all_gpu" or args.budget_all_gpu):
            trainer = budget * 2**30
            if mode == "dos_auto_flag":
                # dosd's resident state and staging, set aside by hand.
                trainer -= (args.flag_budget_gb + args.dosd_gpu_reserve_gb) * 2**30
            elif mode.startswith("dos"):
                # dosd's memory comes out of the trainer's lease; only the two
                # CUDA contexts are outside torch's accounting.
                trainer -= args.dosd_context_gb * 2**30
            frac = max(0.05, min(1.0, trainer / total))
            torch.cuda.set_per_process_memory_fraction(frac, 0)
            res["memory_fraction"] = round(frac, 4)
            if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
                # torch < 2.9 cannot tell dos.torch its fraction: say it.
                lend_from = int(frac * total)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    t0 = time.perf_counter()
    model = gpt.build(args.size, args.layers, args.d_model, args.heads, args.seq, args.vocab,
                      dtype=dtype, device=args.device, checkpoint=True, seed=0,
                      init_in_dtype=args.init_bf16)
    res["model_init_s"] = time.perf_counter() - t0
    cfg = model.cfg
    nparams = sum(p.numel() for p in model.parameters())
    res.update(params=nparams, **cfg, batch=args.batch)
    groups = gpt.param_groups(model, 0.1)
    kw = dict(lr=args.lr, betas=(0.9, 0.95))
    clip = 0.0 if "noclip" in mode else args.clip
    delay = delay_of(mode)
    t0 = time.perf_counter()
    if mode.startswith("dos"):
        import dos.torch
        hooks = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
        # overlap= as the mode asks; otherwise left to dos.torch's default
        # (None: on with delay=1 on CUDA, off otherwise).
        overlap = ("update" if mode == "dos_auto_noclip" else
                   True if "_overlap" in mode else None) if hooks else False
        # How the next forward waits for the update: per layer (model=, the
        # default here), behind the whole step on the stream ("wholestep"), or
        # on the host before step() returns ("sync": the pre-async behaviour).
        compact = "compact" in mode
        wait = "sync" if mode.endswith("_sync") else \
            "wholestep" if mode.endswith("_wholestep") else "layers"
        wait_kw = {"sync": dict(async_step=False), "wholestep": dict(),
                   "layers": dict(model=model)}[wait]
        opt = dos.torch.AdamW(groups, socket=args.socket, client_name=f"e2e-{mode}",
                              **({} if overlap is None else dict(overlap=overlap)),
                              subgroup_size=args.subgroup_size,
                              compact_state=compact,
                              gpu_budget_bytes=0 if mode == "dos_auto_flag" else lend_from,
                              **wait_kw, **kw,
                              # Only where asked: a dos.torch without the
                              # delay has no such arguments (main() checks).
                              **(dict(delay=delay, delay_warmup=args.delay_warmup)
                                 if delay else {}))
        policy = "cpu" if mode.startswith("dos_cpu") else args.dos_policy
        opt.set_policy(policy)
        res["note"] = f"dosd policy {policy}, next forward waits: {wait}" + \
            (", compact state" if compact else "") + \
            (f", delay={delay} after {args.delay_warmup} steps (update phase: what step() "
             "still costs)" if delay else "") + \
            (f", overlap={overlap!r}" if overlap else
             f", overlap={opt.overlap!r} (the default)" if overlap is None else "") + \
            (", no clipping" if clip == 0 else
             ", clip via opt.clip_grad_norm_" if overlap is True else "")
    elif mode == "inprocess_offload":
        from baselines import HybridOffloadAdamW
        opt = HybridOffloadAdamW(groups, **kw)
        res["note"] = opt.note
    elif mode == "all_gpu":
        from baselines import GpuMasterAdamW
        opt = GpuMasterAdamW(groups, **kw)
        res["note"] = opt.note
    else:
        raise SystemExit(f"unknown mode {mode}")
    res["setup_s"] = time.perf_counter() - t0
    sampler = GpuSampler(torch, 0) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(0)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows, losses, early_rows = [], [], []
    reports = {}  # delay=: dosd's reports by step number, peeked (peek_report)

    def keep_report():
        r = peek_report(opt)
        if r is not None and "step" in r:
            reports[r["step"]] = dict(r)

    data = list(gpt.batches(args.warmup + args.iters, args.batch, cfg["seq"], cfg["vocab"],
                            seed=1, device=args.device))
    # --no-phases: only the warm-up iterations run synchronised (untimed).
    phased = data if args.phases else data[:args.warmup]

    def clip_grads():
        if clip <= 0:
            return
        if "_overlap" in mode:
            opt.clip_grad_norm_(clip)  # the coefficient goes with step()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

    def train_step(x, y):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        clip_grads()
        opt.step()
        return loss

    # Phase breakdown: synchronised after each phase (what each costs alone;
    # with asynchronous steps the update's wait moves into the next forward).
    for it, (x, y) in enumerate(phased):
        sync()
        a = time.perf_counter()
        opt.zero_grad()
        loss = model(x, y)
        sync()
        b = time.perf_counter()
        loss.backward()
        sync()
        c = time.perf_counter()
        clip_grads()
        opt.step()
        sync()
        d = time.perf_counter()
        losses.append(loss.item())
        if delay:
            keep_report()  # not opt.last_step: it would wait for the step in flight
        if it >= args.warmup:
            rows.append((b - a, c - b, d - c, d - a))
            if mode.startswith("dos") and not delay:
                # dosd's side of an early step: begin (first gradient) to
                # verdict (step()), and verdict (or begin) to the update's end;
                # for every step, the state bytes prefetched before the verdict.
                last = opt.last_step
                early_rows.append((last["before_verdict_us"] * 1e-6,
                                   last["after_verdict_us"] * 1e-6,
                                   last["prefetched_bytes"], last["early"]))
        print(f"  [{mode}] iter {it:3d} loss {losses[-1]:.4f} fwd {b - a:.3f} bwd {c - b:.3f} "
              f"update {d - c:.3f} s", flush=True)
    # Training as it runs: no synchronisation between iterations (the loss is
    # read at the end), so every overlap counts. Median of per-iteration times
    # measured at each iteration's start on the host, which runs at most one
    # step ahead (each step() collects the previous one).
    piped = []
    sync()
    # Cores each process kept busy while the timed iterations ran: a thread
    # of dosd's that spins beside the trainer shows as a core more.
    dosd_pid = os.environ.get("DOS_BENCH_DOSD_PID")
    cpu0 = (cpu_seconds(), cpu_seconds(dosd_pid) if dosd_pid else None)
    t_prev = time.perf_counter()
    start = t_prev
    pl = []
    for x, y in data[args.warmup:]:
        pl.append(train_step(x, y))
        now = time.perf_counter()
        piped.append(now - t_prev)
        t_prev = now
        if delay:
            keep_report()  # cheap: an attribute read, no wait
    sync()
    piped_total = time.perf_counter() - start
    for key, pid, c0 in (("trainer_cpu_cores", "self", cpu0[0]),
                         ("dosd_cpu_cores", dosd_pid, cpu0[1])):
        c1 = cpu_seconds(pid) if c0 is not None else None
        if c1 is not None:
            res[key] = (c1 - c0) / piped_total
    if delay:
        # After the timing, the last step collected only for its number:
        # steps are numbered one by one, so the back-to-back ones are the
        # last len(pl), the timed synchronised ones the len(rows) before
        # them. The medians use the peeked reports alone (the last step's,
        # collected here after the synchronisation, may differ).
        n, k = opt.last_step["step"], len(pl)
        res.update(delay_figures([reports[s] for s in range(n - k + 1, n + 1)
                                  if s in reports]))
        res["delay_phased"] = delay_figures([reports[s] for s in range(n - k - len(rows) + 1,
                                                                       n - k + 1)
                                             if s in reports])
        res["delay_steps"] = [n - k + 1, n]
        if not reports:
            print(f"  [{mode}] no report could be read without waiting (dos.torch's "
                  "Flight moved?): no delay figures", flush=True)
    losses += [float(v) for v in pl]
    if args.profile_iters and cuda:
        # After the timing: the last batches again, back to back under
        # torch.profiler (where the trainer's GPU idled, and on what).
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "frameworks"))
        from gpu_profile import StepProfiler
        profiler = StepProfiler(os.path.join(args.out, f"trace_{mode}.json.gz"))
        profiler.start()
        for x, y in data[-args.profile_iters:]:
            train_step(x, y)
        sync()
        res["profile"] = profiler.stop()
        res["profile"]["iterations"] = args.profile_iters
    print(f"  [{mode}] pipelined: {len(pl)} iterations in {piped_total:.3f} s "
          f"({piped_total / len(pl):.3f} s/iter)", flush=True)
    if sampler:
        sampler.close()
    tokens = args.batch * cfg["seq"]
    iter_s = piped_total / len(pl)
    if rows:
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        # What of the update the back-to-back iteration does not hide: the
        # iteration less the (synchronised) forward and backward. Can be a
        # little below 0 when the update is hidden entirely (noise).
        res.update(forward_s=med[0], backward_s=med[1], update_s=med[2], iter_s_phases=med[3],
                   exposed_update_s=iter_s - med[0] - med[1],
                   iter_s_mean=statistics.mean(r[3] for r in rows))
    res.update(iter_s=iter_s, iter_s_pipelined_median=statistics.median(piped[1:] or piped),
               tokens_per_s=tokens / iter_s, first_loss=losses[0], last_loss=losses[-1],
               host_peak_bytes=vm_hwm_bytes(), losses=[round(v, 5) for v in losses])
    if early_rows:
        res["prefetched_gb_per_step"] = statistics.median(r[2] for r in early_rows) / 1e9
    if any(r[3] for r in early_rows):
        res["early_begin_to_verdict_s"] = statistics.median(r[0] for r in early_rows)
        res["early_verdict_to_end_s"] = statistics.median(r[1] for r in early_rows)
    if cuda:
        res["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(0)
        res["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(0)
        res["gpu_peak_device_bytes"] = sampler.peak
    if mode.startswith("dos"):
        res["dos_last_step"] = opt.last_step
        res["dosd_stats"] = dosctl_stats(args.socket)
        res["gpu_lease"] = opt.gpu_lease  # None on the CPU or with lending off
        if opt.gpu_lease:
            res["note"] += f", lease {opt.gpu_lease['lease_bytes'] / 2**30:.1f} GiB " \
                f"(peak {opt.gpu_lease['peak_bytes'] / 2**30:.1f})"
        opt.close()
    with open(args.child_out, "w") as f:
        json.dump(res, f)
    return 0


def dosctl_stats(sock):
    """dosd's statistics (`dosctl --json stats`: the last step's split, the
    model's forecast and binding, per-path busy times) where $DOS_DOSCTL names
    dosctl; None otherwise or when it fails."""
    ctl = os.environ.get("DOS_DOSCTL")
    if not ctl or not sock:
        return None
    try:
        out = subprocess.run([ctl, f"--socket={sock}", "--json", "stats"], capture_output=True,
                             text=True, timeout=30)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def child_main(args):
    """child(), with an exception written to --child-out as {"error", ...} (for
    the parent to tell a CUDA out-of-memory error or a refused registration
    from a crash) before the traceback is printed and the exit status is 1."""
    try:
        return child(args)
    except Exception as e:  # noqa: BLE001 (any failure is reported, then exit 1)
        import traceback
        text = traceback.format_exc()
        with open(args.child_out, "w") as f:
            json.dump({"mode": args.child, "error": f"{type(e).__name__}: {e}"[:4000],
                       "error_type": type(e).__name__, "traceback": text[-4000:]}, f)
        sys.stderr.write(text)
        return 1


# --------------------------------------------------------------- parent ----

def start_dosd(binary, extra, tmp, log_name="dosd.log"):
    path = os.path.join(tmp, "dosd.sock")
    log = open(os.path.join(tmp, log_name), "a")
    proc = subprocess.Popen([binary, f"--socket={path}"] + extra, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"dosd exited with {proc.returncode}; log in {log.name}")
        if os.path.exists(path):
            s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            try:
                s.connect(path)
                return proc, path
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("dosd did not start listening within 60 s")


def stop_dosd(proc):
    """Stops dosd; returns (its VmHWM, its exit status before SIGTERM: None if
    it was still running, else e.g. -9 when the kernel's OOM killer took it)."""
    peak = vm_hwm_bytes(proc.pid)
    died = proc.poll()
    if died is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return peak, died


def run_mode(args, mode, tmp, dosd_extra=(), child_extra=(), timeout=None, tag=None):
    """One mode in its own child process (this file, --child MODE, with
    args.passthrough + child_extra), with a fresh dosd for DOS modes (--dosd,
    flags --dosd-arg + dosd_extra) or args.socket. Returns the child's record
    (its "error" on failure) with dosd_host_peak_bytes, wall_s, rc, and where
    they apply dosd_died (dosd's exit status while the child ran) and
    timed_out. Shared by parent() and largest.py."""
    tag = tag or mode
    proc = None
    sock = args.socket
    if mode.startswith("dos"):
        if args.dosd:
            extra = list(args.dosd_arg or []) + list(dosd_extra)
            if mode == "dos_auto_flag":
                extra.append(f"--gpu_memory_budget={args.flag_budget_gb:g}G")
            if args.device == "cpu":
                extra.append("--gpu_devices=none")
            proc, sock = start_dosd(args.dosd, extra, tmp, f"dosd-{tag}.log")
        elif not sock:
            print(f"{mode}: skipped (give --dosd PATH or set DOS_SOCKET)")
            return {"mode": mode, "error": "no dosd"}
    out = os.path.join(tmp, f"{tag}.json")
    if os.path.exists(out):
        os.unlink(out)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--child-out", out]
    cmd += list(args.passthrough) + list(child_extra)
    if sock:
        cmd += ["--socket", sock]
    print(f"== {tag}", flush=True)
    t = time.perf_counter()
    timed_out = False
    env = dict(os.environ, DOS_BENCH_DOSD_PID=str(proc.pid)) if proc else None
    try:
        rc = subprocess.run(cmd, timeout=timeout, env=env).returncode
    except subprocess.TimeoutExpired:  # subprocess.run killed the child
        rc, timed_out = None, True
    wall = time.perf_counter() - t
    dosd_peak, dosd_died = stop_dosd(proc) if proc else (0, None)
    r = {"mode": mode}
    if os.path.exists(out):
        with open(out) as f:
            r = json.load(f)
    if (rc != 0 or "iter_s" not in r) and "error" not in r:
        r["error"] = "timed out" if timed_out else f"exit {rc}"
    r.update(rc=rc, dosd_host_peak_bytes=dosd_peak, wall_s=wall)
    if timed_out:
        r["timed_out"] = True
    if dosd_died is not None:
        r["dosd_died"] = dosd_died
    if proc:
        # The file's name only: results name no path outside the repository
        # (parent() prints the run's folder).
        r["dosd_log"] = f"dosd-{tag}.log"
    if "error" in r:
        print(f"{tag}: failed ({r['error'].splitlines()[0][:300]})", flush=True)
    return r


def gb(x):
    return f"{x / 2**30:.1f}" if x else "-"


def git_commit():
    """$DOS_COMMIT first: a copy of the tree sent to a GPU machine may carry a
    stale .git (the commit the install in .dist was built from is what counts)."""
    if os.environ.get("DOS_COMMIT"):
        return os.environ["DOS_COMMIT"]
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def chart(results, path, title):
    """Where each mode's iteration goes, one stacked bar per mode: forward and
    backward (medians of the synchronised iterations) and the exposed update
    (the back-to-back iteration time less those two; shown from 0), so each bar
    ends at the measured iteration time. Delay modes add a hatched bar over
    forward and backward: the delayed host-path update's part hidden there
    (dosd's delayed_update_us less delayed_wait_us, from the iteration's
    start, when the update begins), and name the planner's prediction."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG chart")
        return None
    ok = [dict(r) for r in results if "forward_s" in r]
    if not ok:
        return None
    for r in ok:  # records written before the split was: the same arithmetic
        r.setdefault("exposed_update_s", r["iter_s"] - r["forward_s"] - r["backward_s"])
    names = [r["mode"] for r in ok]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ok) + 1.6))
    left = [0.0] * len(ok)
    for key, label, color in (("forward_s", "forward", "#4c72b0"),
                              ("backward_s", "backward", "#55a868"),
                              ("exposed_update_s", "exposed update", "#c44e52")):
        vals = [max(0.0, r[key]) for r in ok]
        ax.barh(names, vals, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, vals)]
    hidden = [r.get("delayed_hidden_s", 0.0) if "delay_reports" in r else 0.0 for r in ok]
    if any(hidden):
        ax.barh(names, hidden, height=0.4, fill=False, hatch="///", edgecolor="#222222",
                linewidth=0.8, label="delayed update (host path, one step late):\n"
                "part hidden in forward + backward")
    for i, r in enumerate(ok):
        if "delay_reports" in r:  # two lines: the prediction, then the delayed update
            text = (f" {r['iter_s']:.3f} s/iter (predicted {r['predicted_iter_s']:.3f}), "
                    f"{r['tokens_per_s']:.0f} tok/s\n update phase {r['update_s']:.3f} s; "
                    f"delayed update {r['delayed_update_s']:.3f} s, "
                    f"{r['delayed_hidden_s']:.3f} s of it hidden")
        else:
            text = (f" {r['iter_s']:.3f} s/iter (update alone {r['update_s']:.3f} s), "
                    f"{r['tokens_per_s']:.0f} tok/s")
        ax.text(left[i], i, text, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per iteration: forward + backward (synchronised medians)\n+ the "
                  "update's exposed rest of the back-to-back iteration")
    ax.set_title(title)
    ax.set_xlim(0, max(left) * 1.7)  # room for the text
    fig.tight_layout()
    # Below the figure, the axis label included (savefig's tight box takes it
    # in): inside the axes it would cover the bars' text, and at a fixed
    # fraction below them the two-line label of a chart with few bars.
    fig.legend(*ax.get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               bbox_transform=fig.transFigure, ncol=4, fontsize=8, frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


# Ratio figures: (name, numerator mode, denominator mode, what the printout
# says, the target or None). Each is the numerator's iteration time
# over the denominator's, written when both modes ran in this invocation; a
# target is printed beside it.
RATIOS = [
    ("e2e_speedup_dos_auto_vs_inprocess_offload", "inprocess_offload", "dos_auto",
     "dos_auto vs in-process offload (speed-up)", None),
    ("e2e_ratio_dos_auto_to_all_gpu", "dos_auto", "all_gpu",
     "dos_auto / all-GPU AdamW iteration time", None),
    ("e2e_ratio_dos_auto_compact_to_all_gpu", "dos_auto_compact", "all_gpu",
     "dos_auto_compact / all-GPU AdamW iteration time", None),
    ("e2e_ratio_dos_auto_overlap_to_all_gpu", "dos_auto_overlap", "all_gpu",
     "dos_auto_overlap / all-GPU AdamW iteration time", None),
    ("e2e_ratio_dos_auto_noclip_to_all_gpu", "dos_auto_noclip", "all_gpu",
     "dos_auto_noclip / all-GPU AdamW iteration time", None),
    ("e2e_ratio_dos_auto_overlap_to_dos_auto", "dos_auto_overlap", "dos_auto",
     "dos_auto_overlap / dos_auto iteration time (early steps' gain with clipping)", None),
    # Issue 23's targets for the one-step delayed update.
    ("e2e_ratio_dos_auto_delay_to_all_gpu", "dos_auto_delay", "all_gpu",
     "dos_auto_delay / all-GPU AdamW iteration time", 1.15),
    ("e2e_ratio_dos_auto_compact_delay_to_all_gpu", "dos_auto_compact_delay", "all_gpu",
     "dos_auto_compact_delay / all-GPU AdamW iteration time", 0.95),
    ("e2e_ratio_dos_auto_delay_to_dos_auto", "dos_auto_delay", "dos_auto",
     "dos_auto_delay / dos_auto iteration time (the delay's gain)", None),
    ("e2e_ratio_dos_auto_compact_delay_to_dos_auto_compact", "dos_auto_compact_delay",
     "dos_auto_compact", "dos_auto_compact_delay / dos_auto_compact iteration time", None),
]


def ratio_metrics(ok):
    """[(metric, printed line)] for each RATIOS entry whose modes both ran."""
    out = []
    for name, num, den, text, target in RATIOS:
        if num in ok and den in ok:
            v = round(ok[num]["iter_s"] / ok[den]["iter_s"], 3)
            out.append(({"name": name, "value": v, "unit": "x"},
                        f"{text}: {v:.2f}x" + ("" if target is None else
                                               f" (target <= {target:g}x: "
                                               f"{'met' if v <= target else 'NOT met'})")))
    return out


def delay_line(mode, r):
    """The printout of a delay mode: the measured iteration beside the
    planner's prediction, and where the delayed update went."""
    if "delay_reports" not in r:
        return f"{mode}: no dosd reports on the delayed steps"
    p = r["predicted_iter_s"]
    vs = f"{r['iter_s'] / p:.2f}x the prediction" if p > 0 else "no prediction reported"
    a, b = r["delay_steps"]
    line = (f"{mode}: {r['iter_s']:.3f} s/iter measured, planner's prediction {p:.3f} s "
            f"({vs}; window {r['window_s']:.3f} s, predicted update "
            f"{r['predicted_update_s']:.3f} s); delayed update {r['delayed_update_s']:.3f} s, "
            f"hidden in forward+backward {r['delayed_hidden_s']:.3f} s, waited "
            f"{r['delayed_wait_s']:.3f} s; {r['delayed_subgroups']:g} subgroup(s) "
            f"({r['delayed_params'] / 1e6:.1f}M parameters) deferred a step (medians of "
            f"{r['delay_reports']} back-to-back steps of {a}-{b})")
    if r["delay_missing_keys"]:
        line += f"; not reported by this dos.torch: {', '.join(r['delay_missing_keys'])}"
    return line


def parent(args):
    modes = args.modes.split(",")
    machine = args.machine or ("vm-cpu" if args.device == "cpu" else "nvidia-h200")
    date = datetime.date.today().isoformat()
    tmp = tempfile.mkdtemp(prefix="dos-e2e-")
    print(f"dosd's logs: {tmp}", flush=True)
    results = []
    for mode in modes:
        results.append(run_mode(args, mode, tmp))

    print()
    hdr = (f"{'mode':26s} {'iter s':>7s} {'fwd':>6s} {'bwd':>6s} {'update':>7s} {'tok/s':>8s} "
           f"{'GPU GiB':>8s} {'dev GiB':>8s} {'host GiB':>9s} {'dosd GiB':>9s}  note")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if "error" in r:
            print(f"{r['mode']:26s} {r['error']}")
            continue
        def ph(key, w):  # phase times are absent with --no-phases
            return f"{r[key]:{w}.3f}" if key in r else f"{'-':>{w}s}"
        print(f"{r['mode']:26s} {r['iter_s']:7.3f} {ph('forward_s', 6)} {ph('backward_s', 6)} "
              f"{ph('update_s', 7)} {r['tokens_per_s']:8.0f} "
              f"{gb(r.get('gpu_peak_allocated_bytes')):>8s} {gb(r.get('gpu_peak_device_bytes')):>8s} "
              f"{gb(r['host_peak_bytes']):>9s} {gb(r['dosd_host_peak_bytes']):>9s}  "
              f"{r.get('note', '')}")
    ok = {r["mode"]: r for r in results if "iter_s" in r}
    first = next(iter(ok.values()), None)
    if first:
        print(f"\nmodel: {first['params'] / 1e6:.1f}M parameters, layers {first['layers']}, "
              f"d_model {first['d_model']}, seq {first['seq']}, batch {first['batch']}; " +
              (f"GPU budget {args.gpu_budget_gb:g} GiB" if args.gpu_budget_gb else "no GPU budget"))
    ratios = ratio_metrics(ok)
    for _, line in ratios:
        print(line)
    for m, r in ok.items():
        if delay_of(m):
            print(delay_line(m, r))
    for m, r in ok.items():
        if "trainer_cpu_cores" in r:
            dosd = r.get("dosd_cpu_cores")
            print(f"{m}: cores kept busy over the back-to-back iterations: trainer "
                  f"{r['trainer_cpu_cores']:.2f}" +
                  (f", dosd {dosd:.2f}" if dosd is not None else ""))
    for m, r in ok.items():
        if "early_verdict_to_end_s" in r:
            print(f"{m}: dosd's early steps: begin (first gradient) to verdict (step()) "
                  f"{r['early_begin_to_verdict_s']:.3f} s, verdict (or begin) to the update's "
                  f"end {r['early_verdict_to_end_s']:.3f} s, state prefetched before the "
                  f"verdict {r.get('prefetched_gb_per_step', 0):.2f} GB (medians, phase-timed "
                  "iterations)")

    metrics = []
    for r in results:
        if "iter_s" not in r:
            continue
        m = r["mode"]
        metrics.append({"name": f"e2e_iter_s_{m}", "value": round(r["iter_s"], 4), "unit": "s"})
        # The iteration's split: forward + backward + exposed update = iter_s.
        metrics += [{"name": f"e2e_{key[:-2]}_s_{m}", "value": round(r[key], 4), "unit": "s"}
                    for key in ("forward_s", "backward_s", "update_s", "exposed_update_s")
                    if key in r]
        metrics += [
            {"name": f"e2e_tokens_per_s_{m}", "value": round(r["tokens_per_s"], 1),
             "unit": "tokens/s"},
            {"name": f"e2e_host_peak_gib_{m}",
             "value": round((r["host_peak_bytes"] + r["dosd_host_peak_bytes"]) / 2**30, 2),
             "unit": "GiB"},
        ]
        for key in ("early_begin_to_verdict_s", "early_verdict_to_end_s"):
            if key in r:
                metrics.append({"name": f"e2e_{key}_{m}", "value": round(r[key], 4),
                                "unit": "s"})
        # delay=: dosd's reports on the back-to-back steps (medians).
        metrics += [{"name": f"e2e_{key}_{m}", "value": round(r[key], 4), "unit": "s"}
                    for key in ("predicted_iter_s", "delayed_update_s", "delayed_hidden_s",
                                "delayed_wait_s", "window_s") if key in r]
        if "prefetched_gb_per_step" in r:
            metrics.append({"name": f"e2e_prefetched_gb_per_step_{m}",
                            "value": round(r["prefetched_gb_per_step"], 3), "unit": "GB"})
        if "gpu_peak_device_bytes" in r:
            metrics += [{"name": f"e2e_gpu_peak_gib_{m}",
                         "value": round(r["gpu_peak_device_bytes"] / 2**30, 2), "unit": "GiB"}]
    metrics += [m for m, _ in ratios]
    if "dos_auto_compact" in ok and "dos_auto" in ok:
        # Same seed, same tokens: the loss effect of compact state at this length.
        metrics.append({"name": "e2e_last_loss_diff_compact_vs_fp32",
                        "value": round(ok["dos_auto_compact"]["last_loss"] -
                                       ok["dos_auto"]["last_loss"], 5), "unit": "loss"})
        pairs = list(zip(ok["dos_auto_compact"]["losses"], ok["dos_auto"]["losses"]))
        worst = max(abs(a - b) / abs(b) for a, b in pairs if b)
        metrics.append({"name": "e2e_max_loss_rel_diff_compact_vs_fp32",
                        "value": round(worst, 6), "unit": "fraction"})
        print(f"compact vs fp32 state: largest per-iteration loss difference {worst:.3%} over "
              f"{len(pairs)} iterations")
    os.makedirs(args.out, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"e2e_{machine}_{date}{suffix}.json")
    doc = {"machine": machine, "date": date, "commit": git_commit(), "results": metrics,
           "config": {"argv": sys.argv[1:], "gpu_budget_gb": args.gpu_budget_gb},
           "runs": results}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")
    png = chart(results, os.path.join(args.out, f"e2e_{machine}_{date}{suffix}.png"),
                f"{machine}: GPT {first['params'] / 1e6:.0f}M params, " +
                (f"GPU budget {args.gpu_budget_gb:g} GiB" if args.gpu_budget_gb else
                 "no GPU budget") if first else machine)
    if png:
        print(f"wrote {png}")
    return 0 if ok else 1


def delay_unsupported():
    """Why the dos.torch the children would import cannot run the delay
    modes, or None. Checked before anything runs (each mode would otherwise
    build its model and then fail): an __init__ of dos.torch.AdamW's classes
    names delay=, AdamW's own passing **kwargs on to its base."""
    import inspect
    try:
        import dos.torch
    except Exception as e:  # noqa: BLE001 (the reason is the answer)
        return f"importing dos.torch failed ({type(e).__name__}: {e})"
    for cls in dos.torch.AdamW.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        if not cls.__module__.startswith("dos."):
            return None  # **kwargs all the way down: the constructor will say
        params = inspect.signature(init).parameters
        if "delay" in params:
            return None
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return f"the AdamW of {dos.torch.__file__} takes no delay="


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--size", default=None, help="gpt.py size (default 1.5b on cuda, small on cpu)")
    for k in ("layers", "d-model", "heads", "seq", "vocab"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="the model's parameters and gradients")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile-iters", type=int, default=0,
                    help="after the timing, this many more iterations back to back under "
                         "torch.profiler: a summary of where the trainer's GPU idled "
                         "(bench/frameworks/gpu_profile.py) in the run's 'profile', the trace "
                         "in --out")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--subgroup-size", type=int, default=0, help="dosd subgroup size (0: default)")
    ap.add_argument("--modes", default=",".join(ALL_MODES),
                    help="comma list of: " + ", ".join(ALL_MODES + [
                        "dos_auto_noclip_nooverlap", "dos_auto_wholestep", "dos_auto_sync",
                        "dos_auto_flag", "dos_auto_delay", "dos_auto_compact_delay",
                        "dos_auto_overlap_delay", "dos_auto_compact_overlap_delay"]))
    ap.add_argument("--dos-policy", default="auto",
                    help="dosd policy of the dos_auto* modes (auto, static:<f>, ...)")
    ap.add_argument("--delay-warmup", type=int, default=2,
                    help="the delay modes' delay_warmup= (undelayed steps first); --warmup "
                         "must exceed it, so that every timed iteration waits for a delayed "
                         "update")
    ap.add_argument("--gpu-budget-gb", type=float, default=0,
                    help="emulate a card of this size (40, 80): per-process memory fraction")
    ap.add_argument("--dosd-gpu-reserve-gb", type=float, default=6.0,
                    help="dos_auto_flag under a budget: GPU memory left to dosd beyond "
                         "--flag-budget-gb (staging slots, CUDA contexts)")
    ap.add_argument("--dosd-context-gb", type=float, default=1.0,
                    help="the other DOS modes under a budget: GPU memory outside the trainer's "
                         "fraction (the CUDA contexts); dosd's resident state and staging come "
                         "out of the trainer's lease")
    ap.add_argument("--flag-budget-gb", type=float, default=40.0,
                    help="dos_auto_flag: dosd's --gpu_memory_budget in GiB")
    ap.add_argument("--budget-all-gpu", action="store_true",
                    help="apply the budget to all_gpu too (default: run it without)")
    ap.add_argument("--dosd", default=None, help="dosd binary: started (and stopped) per DOS mode")
    ap.add_argument("--dosd-arg", action="append", help="extra dosd flag (repeatable)")
    ap.add_argument("--socket", default=os.environ.get("DOS_SOCKET"))
    ap.add_argument("--machine", default=None)
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--no-phases", dest="phases", action="store_false",
                    help="skip the synchronised per-phase iterations (only --warmup untimed "
                         "iterations, then --iters back to back)")
    ap.add_argument("--init-bf16", action="store_true",
                    help="initialise the model's weights in bf16 directly (no fp32 copy on the "
                         "device; other random values than the default fp32 init)")
    ap.add_argument("--chart-from", default=None, metavar="JSON",
                    help="only (re)draw the chart of a result file, next to it (needs "
                         "matplotlib; nothing runs)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.chart_from:
        with open(args.chart_from) as f:
            doc = json.load(f)
        ok = [r for r in doc["runs"] if "iter_s" in r]
        gib = doc.get("config", {}).get("gpu_budget_gb")
        title = f"{doc['machine']}: GPT {ok[0]['params'] / 1e6:.0f}M params, " + \
            (f"GPU budget {gib:g} GiB" if gib else "no GPU budget") if ok else doc["machine"]
        png = chart(doc["runs"], os.path.splitext(args.chart_from)[0] + ".png", title)
        print(f"wrote {png}" if png else "no chart")
        return 0 if png else 1
    if args.size is None:
        args.size = "1.5b" if args.device == "cuda" else "small"
    if args.batch is None:
        args.batch = DEFAULT_BATCH.get(args.size, 4)
    if args.child:
        return child_main(args)
    delayed = [m for m in args.modes.split(",") if delay_of(m)]
    if delayed:
        if args.warmup <= args.delay_warmup:
            ap.error(f"--warmup {args.warmup} must exceed --delay-warmup {args.delay_warmup} "
                     f"for {', '.join(delayed)}: the timed iterations would include undelayed "
                     "steps")
        why = delay_unsupported()
        if why:
            ap.error(f"{', '.join(delayed)} need{'s' if len(delayed) == 1 else ''} "
                     f"dos.torch.AdamW(delay=, delay_warmup=) (issue 23): {why}; drop "
                     f"{'it' if len(delayed) == 1 else 'them'} from --modes")
    keep = ["--device", args.device, "--size", args.size, "--batch", str(args.batch),
            "--iters", str(args.iters), "--warmup", str(args.warmup), "--lr", str(args.lr),
            "--clip", str(args.clip), "--subgroup-size", str(args.subgroup_size),
            "--gpu-budget-gb", str(args.gpu_budget_gb),
            "--dosd-gpu-reserve-gb", str(args.dosd_gpu_reserve_gb),
            "--dosd-context-gb", str(args.dosd_context_gb),
            "--flag-budget-gb", str(args.flag_budget_gb),
            "--delay-warmup", str(args.delay_warmup),
            "--profile-iters", str(args.profile_iters), "--out", args.out]
    for k in ("layers", "d_model", "heads", "seq", "vocab"):
        if getattr(args, k) is not None:
            keep += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.budget_all_gpu:
        keep.append("--budget-all-gpu")
    if not args.phases:
        keep.append("--no-phases")
    if args.init_bf16:
        keep.append("--init-bf16")
    keep += ["--dtype", args.dtype]
    args.passthrough = keep
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
