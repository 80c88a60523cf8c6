#!/usr/bin/env python3
"""What host work beside a trainer does to the trainer's launch thread.

A trainer that is near launch-bound (the HF 7B job: batch 1 x 2048, eager
Llama) runs its forward and backward at the speed of one Python thread
issuing ops. dosd's delayed update runs beside it on the other cores. This
measures the cost of one cheap torch op (the dispatcher path every launch
takes) on a thread pinned to CPU 0 while K other threads, pinned to the
other CPUs (one process each), run one of:

  idle     nothing (the baseline)
  memory   large copies (numpy copyto of 512 MiB arrays: DRAM bandwidth, as
           the Adam update does)
  compute  small in-cache matrix products (AVX-512 FMAs, no DRAM traffic)
  spin     a pure-Python busy loop per process (one core each, no memory)

Printed and written as JSON: the median op cost per load, and its ratio to
idle. The ratio says which resource the delayed update takes from the
trainer: DRAM/cache (memory high, compute low), the cores' frequency or
shared physical cores (compute and spin high).

  interference.py [--threads 4,8,14] [--out bench/results/interference_<machine>_<date>.json]
"""
import argparse
import datetime
import json
import os
import multiprocessing
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def op_cost_us(seconds=1.0):
    """Median over 20 rounds of one t.view(4, 4) + t.add_(1) pair, in us."""
    t = torch.zeros(16)
    rounds = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(rounds) < 20:
        n = 2000
        a = time.perf_counter()
        for _ in range(n):
            t.view(4, 4)
            t.add_(1)
        rounds.append((time.perf_counter() - a) / n * 1e6)
    return statistics.median(rounds)


def hog(kind, cpu, stop):
    """One load process (processes, not threads: no GIL between the load
    and the measured thread)."""
    os.sched_setaffinity(0, {cpu})
    if kind == "memory":
        a = np.ones(64 << 20, dtype=np.float64)  # 512 MiB
        b = np.empty_like(a)
        while not stop.is_set():
            np.copyto(b, a)
    elif kind == "compute":
        a = np.random.rand(192, 192).astype(np.float32)
        while not stop.is_set():
            for _ in range(50):
                a @ a
    elif kind == "spin":
        x = 0
        while not stop.is_set():
            for _ in range(10000):
                x += 1


def measure(kind, k, cpus):
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    ts = [ctx.Process(target=hog, args=(kind, cpus[1 + i % (len(cpus) - 1)], stop),
                      daemon=True) for i in range(k)]
    for t in ts:
        t.start()
    time.sleep(1.0)  # the memory loads allocate and touch 1 GiB each
    cost = op_cost_us()
    stop.set()
    for t in ts:
        t.join()
    return cost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="4,8,14")
    ap.add_argument("--machine", default=os.environ.get("DOS_MACHINE", "unknown"))
    ap.add_argument("--out")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})
    res = {"machine": args.machine, "date": datetime.date.today().isoformat(),
           "cpus": len(cpus), "op": "t.view(4,4); t.add_(1) (us, median)", "runs": {}}
    base = [measure("idle", 0, cpus)]
    for k in [int(x) for x in args.threads.split(",")]:
        for kind in ("memory", "compute", "spin"):
            c = measure(kind, k, cpus)
            base.append(measure("idle", 0, cpus))
            res["runs"][f"{kind}_{k}"] = c
    idle = statistics.median(base)
    res["idle_us"] = idle
    res["ratio"] = {k: v / idle for k, v in res["runs"].items()}
    print(f"idle: {idle:.2f} us per op pair (medians of {len(base)} idle runs: "
          f"{', '.join(f'{b:.2f}' for b in base)})")
    for k, v in res["runs"].items():
        print(f"{k:12s} {v:6.2f} us  {v / idle:4.2f}x idle")
    out = args.out or f"bench/results/interference_{args.machine}_{res['date']}.json"
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
