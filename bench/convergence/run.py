#!/usr/bin/env python3
"""Convergence of the delayed update: the GPT example (client/python/examples/gpt.py,
bf16 parameters) trained on a real text corpus, byte by byte, with dos.torch.AdamW

  fp32_exact      fp32 state, every subgroup updated before the next forward (delay=0)
  fp32_delay      fp32 state, delay=1: the host path's subgroups are updated one step
                  late (after --delay-warmup steps without the delay)
  compact_exact   compact_state=True (bf16 exp_avg / exp_avg_sq in dosd), delay=0
  compact_delay   compact_state=True, delay=1
  fp32_exact_repeat  (optional) fp32_exact again: the run-to-run noise of the GPU kernels

Every run has the same seed, the same initial weights and the same batches in the
same order; the learning rate warms up linearly, then decays along a cosine to a
tenth; gradients are clipped to norm 1.0. dosd runs the policy --policy (default
cpu: every subgroup takes the host path, the delay's worst case). Each run is a
child process (this file, --child RUN); --parallel of them run at once against one
dosd (--dosd PATH starts it; --dosd-per-run gives each its own; else $DOS_SOCKET).
On CUDA, runs are spread over --gpus GPUs round robin.

Judged: the relative difference (delayed - exact) / exact of the mean training loss
over the last --window (200) steps, target within 1%, for fp32 and for compact state;
also the validation loss (the corpus's last 5%, never trained on). Prints a table,
writes bench/results/convergence_<machine>_<date>[_<tag>].json and a PNG chart of the
loss curves (if matplotlib is installed).

  bash bench/convergence/make_corpus.sh        # .dist/corpus/corpus.txt, ~20 MB of text
  python3 bench/convergence/run.py --dosd .dist/bin/dosd --corpus .dist/corpus/corpus.txt
  python3 bench/convergence/run.py --dosd build/daemon/dosd --device cpu --size tiny \\
      --seq 64 --steps 30 --runs fp32_exact,compact_exact        # smoke run, no GPU
  python3 bench/convergence/run.py --merge A.json B.json         # one report of two calls

On one H200 (16 cores) the four runs' CPU updates (policy cpu) take about 10 minutes:
bench/convergence/run_gpu.sh runs them as two calls there (fp32, compact) and one call
on nvidia-h200-x2 (32 cores, 2 GPUs).
"""
import argparse
import concurrent.futures
import datetime
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))
sys.path.insert(0, HERE)

import report  # noqa: E402 (bench/convergence)
import train  # noqa: E402

DEFAULT_RUNS = "fp32_exact,fp32_delay,compact_exact,compact_delay"


def _e2e():
    """bench/e2e/run.py as a module: dosd's start and stop, VmHWM, the commit."""
    spec = importlib.util.spec_from_file_location("e2e_run",
                                                  os.path.join(REPO, "bench", "e2e", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------- parent ----

class Daemons:
    """The dosd the runs attach to: one shared (--dosd), one per run
    (--dosd-per-run), or none started (--socket / $DOS_SOCKET)."""

    def __init__(self, args, e2e, tmp):
        self.args, self.e2e, self.tmp = args, e2e, tmp
        self.extra = list(args.dosd_arg or [])
        if args.device == "cpu":
            self.extra.append("--gpu_devices=none")
        self.shared = None
        self.procs = []
        if args.dosd and not args.dosd_per_run:
            self.shared = self._start("shared")

    def _start(self, name):
        d = os.path.join(self.tmp, f"dosd-{name}")
        os.makedirs(d, exist_ok=True)
        proc, sock = self.e2e.start_dosd(self.args.dosd, self.extra, d, "dosd.log")
        self.procs.append((name, proc, os.path.join(d, "dosd.log")))
        return sock

    def socket_for(self, run):
        if self.args.dosd_per_run and self.args.dosd:
            return self._start(run)
        return self.shared or self.args.socket

    def stop(self):
        """{name: {host_peak_bytes, died, log}} of every dosd started."""
        out = {}
        for name, proc, log in self.procs:
            peak, died = self.e2e.stop_dosd(proc)
            out[name] = {"host_peak_bytes": peak, "died": died, "log": log}
        return out


def run_child(args, run, index, sock, work):
    """One run in its own process (this file, --child RUN), on GPU index %
    --gpus; its record (train.py), with "error" when it failed, rc, wall_s."""
    out = os.path.join(work, f"{run}.json")
    if os.path.exists(out):
        os.unlink(out)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", run, "--child-out", out,
           "--gpu-index", str(index % args.gpus), "--gpu-share", str(args.gpu_share)]
    cmd += args.passthrough + (["--socket", sock] if sock else [])
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=args.timeout or None).returncode
    except subprocess.TimeoutExpired:  # subprocess.run killed the child
        rc = "timed out"
    r = {"run": run}
    if os.path.exists(out):
        with open(out) as f:
            r = json.load(f)
    if "last_mean" not in r and "error" not in r:
        r["error"] = rc if isinstance(rc, str) else f"exit {rc}"
    r.update(rc=rc, wall_s=round(time.perf_counter() - t, 1))
    if "error" in r:
        print(f"[{run}] failed: {r['error'].splitlines()[0][:300]}", flush=True)
    return r


def corpus_info(path):
    with open(path, "rb") as f:
        data = f.read()
    train_text, val_text = train.split_corpus(data)
    return {"file": os.path.basename(path), "bytes": len(data), "train_bytes": len(train_text),
            "val_bytes": len(val_text), "sha256": hashlib.sha256(data).hexdigest()}


def parent(args):
    e2e = _e2e()
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in train.RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {', '.join(train.RUNS)}")
    if not os.path.exists(args.corpus):
        raise SystemExit(f"--corpus {args.corpus}: no such file (bash "
                         "bench/convergence/make_corpus.sh writes .dist/corpus/corpus.txt)")
    if not args.dosd and not args.socket:
        raise SystemExit("give --dosd PATH (started here) or --socket / $DOS_SOCKET")
    args.gpus = max(1, args.gpus)
    # Runs at once on one GPU: what each may lend dosd under --policy auto.
    args.gpu_share = -(-min(args.parallel, len(runs)) // args.gpus)
    machine = args.machine or ("vm-cpu" if args.device == "cpu" else "nvidia-h200")
    date = datetime.date.today().isoformat()
    work = args.workdir or tempfile.mkdtemp(prefix="dos-convergence-")
    os.makedirs(work, exist_ok=True)
    config = {"argv": sys.argv[1:], "device": args.device, "steps": args.steps,
              "batch": args.batch, "model": train.model_config(args),
              "checkpoint": args.checkpoint, "lr": args.lr, "lr_warmup": args.lr_warmup,
              "lr_floor": args.lr_floor, "clip": args.clip, "weight_decay": args.weight_decay,
              "betas": [0.9, 0.95], "seed": args.seed, "policy": args.policy,
              "delay_warmup": args.delay_warmup, "window": args.window,
              "val_batches": args.val_batches, "parallel": args.parallel, "gpus": args.gpus,
              "host_cpus": os.cpu_count(),
              "dosd": "per run" if args.dosd_per_run else "shared" if args.dosd else "socket",
              "dosd_args": args.dosd_arg or [], "corpus": corpus_info(args.corpus)}
    print(f"corpus {args.corpus}: {config['corpus']['bytes'] / 1e6:.1f} MB (validation: the "
          f"last {train.VAL_FRACTION:.0%}); runs {', '.join(runs)}, {args.parallel} at once "
          f"on {args.gpus if args.device == 'cuda' else 'no'} GPU(s); logs in {work}",
          flush=True)
    t0 = time.perf_counter()
    daemons = Daemons(args, e2e, work)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futures = [pool.submit(run_child, args, run, i, daemons.socket_for(run), work)
                       for i, run in enumerate(runs)]
            results = [f.result() for f in futures]
    finally:
        config["dosd_exits"] = daemons.stop()
    config["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"all runs: {config['wall_s']:.0f} s", flush=True)
    done = report.write(results, config, machine, date, e2e.git_commit(), args.out, args.tag)
    return 0 if done else 1


def policy_arg(text):
    """cpu, auto or static:<fraction resident on the GPU> (the rest on the host path)."""
    if text in ("cpu", "auto") or (text.startswith("static:") and
                                   0 <= float(text.split(":", 1)[1]) <= 1):
        return text
    raise argparse.ArgumentTypeError(f"--policy {text!r}: cpu, auto or static:<fraction>")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--corpus", default=os.path.join(REPO, ".dist", "corpus", "corpus.txt"))
    ap.add_argument("--size", default="350m", help="gpt.py size (350m: 28 layers unless "
                    "--layers; tiny for a smoke run)")
    for k in ("layers", "d-model", "heads"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    ap.add_argument("--lr-warmup", type=int, default=100, help="steps of linear warm-up")
    ap.add_argument("--lr-floor", type=float, default=0.1,
                    help="the cosine decays to this fraction of the peak")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0, help="weights; the batches use seed + 1")
    ap.add_argument("--checkpoint", action="store_true",
                    help="activation checkpointing (off: 350M at batch 8 x 512 fits easily)")
    ap.add_argument("--policy", default="cpu", type=policy_arg,
                    help="dosd policy (cpu: every subgroup on the host path, where the "
                         "delay applies)")
    ap.add_argument("--gpu-budget-gb", type=float, default=0,
                    help="--policy auto: each run lends dosd this much GPU memory (0: 90%% of "
                         "the GPU, shared evenly by the runs on it at once)")
    ap.add_argument("--delay-warmup", type=int, default=1000,
                    help="delayed runs: the first steps without the delay")
    ap.add_argument("--window", type=int, default=200, help="last steps whose mean is judged")
    ap.add_argument("--val-batches", type=int, default=25)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--time-skip", type=int, default=20,
                    help="steps left out of the time per step")
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help="comma list of: " + ", ".join(train.RUNS))
    ap.add_argument("--parallel", type=int, default=4, help="runs at once")
    ap.add_argument("--gpus", type=int, default=1, help="CUDA: spread runs over this many GPUs")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per run (0: none)")
    ap.add_argument("--dosd", default=None, help="dosd binary, started (and stopped) here")
    ap.add_argument("--dosd-per-run", action="store_true", help="a dosd for each run")
    ap.add_argument("--dosd-arg", action="append", help="extra dosd flag (repeatable)")
    ap.add_argument("--socket", default=os.environ.get("DOS_SOCKET"))
    ap.add_argument("--machine", default=None)
    ap.add_argument("--workdir", default=None,
                    help="the runs' records and dosd's logs (default: a new temporary folder)")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="only report: the runs of these result files in one file (--tag, "
                         "--out name it); nothing runs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gpu-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--gpu-share", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.merge:
        return 0 if report.merge(args.merge, args.out, args.tag) else 1
    if args.child:
        return train.main(args)
    keep = ["--device", args.device, "--corpus", os.path.abspath(args.corpus),
            "--size", args.size, "--seq", str(args.seq), "--batch", str(args.batch),
            "--steps", str(args.steps), "--lr", str(args.lr),
            "--lr-warmup", str(args.lr_warmup), "--lr-floor", str(args.lr_floor),
            "--clip", str(args.clip), "--weight-decay", str(args.weight_decay),
            "--seed", str(args.seed), "--policy", args.policy,
            "--gpu-budget-gb", str(args.gpu_budget_gb),
            "--delay-warmup", str(args.delay_warmup), "--window", str(args.window),
            "--val-batches", str(args.val_batches), "--log-every", str(args.log_every),
            "--time-skip", str(args.time_skip)]
    for k in ("layers", "d_model", "heads"):
        if getattr(args, k) is not None:
            keep += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.checkpoint:
        keep.append("--checkpoint")
    args.passthrough = keep
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
