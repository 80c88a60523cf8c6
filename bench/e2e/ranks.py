#!/usr/bin/env python3
"""Several ranks, one dosd: aggregate update throughput of N ranks against one.

Run under torchrun, one process per GPU; every rank trains the GPT example
(gpt.py) wrapped in DDP or FSDP2 (`fully_shard`, each rank registering its local
shard) with dos.torch.AdamW attached to the same dosd, and times its update phase
(`opt.step()`, after a barrier so that the ranks' updates run concurrently).
Rank 0 writes one JSON line: parameters updated per second by all ranks together
(sum of registered parameters / slowest rank's median update time).

    dosd --socket=/tmp/dos.sock &
    DOS_SOCKET=/tmp/dos.sock torchrun --nproc_per_node=1 bench/e2e/ranks.py --wrap ddp
    DOS_SOCKET=/tmp/dos.sock torchrun --nproc_per_node=2 bench/e2e/ranks.py --wrap ddp
    DOS_SOCKET=/tmp/dos.sock torchrun --nproc_per_node=2 bench/e2e/ranks.py --wrap fsdp2

With DDP every rank holds (and updates) the whole model, so two ranks update twice
the parameters of one; with FSDP2 each updates its half. The issue's target compares
two DDP ranks' aggregate rate with one rank's (>= 1.7x).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gpt  # noqa: E402
import dos.torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    ap.add_argument("--size", default="1.5b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--socket", default=os.environ.get("DOS_SOCKET"))
    ap.add_argument("--out", default=None, help="append the JSON line to this file")
    args = ap.parse_args()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{local}" if cuda else "cpu"
    # bf16 on GPUs; fp32 on the CPU (gloo in torch 1.x cannot broadcast bf16)
    model = gpt.build(args.size, dtype=torch.bfloat16 if cuda else torch.float32,
                      device=device, seed=0)
    cfg = model.cfg
    if args.wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda
                                                          else None)
        inner = model.module
    else:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        inner = model
    opt = dos.torch.AdamW(gpt.param_groups(inner), lr=1e-4, betas=(0.9, 0.95),
                          socket=args.socket, client_name=f"ranks-{args.wrap}-{rank}")
    opt.set_policy(args.policy)
    registered = sum(e.local.numel() for e in opt._entries)
    times = []
    for it, (x, y) in enumerate(gpt.batches(args.warmup + args.iters, args.batch, cfg["seq"],
                                            cfg["vocab"], seed=1 + rank, device=device)):
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()  # every rank's update starts together: they share the daemon
        t = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if it >= args.warmup:
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    rows = [None] * world
    dist.all_gather_object(rows, {"rank": rank, "params": registered, "update_s": med})
    if rank == 0:
        slowest = max(r["update_s"] for r in rows)
        total = sum(r["params"] for r in rows)
        line = {"wrap": args.wrap, "world": world, "size": args.size, "policy": args.policy,
                "params_per_rank": [r["params"] for r in rows],
                "update_s_per_rank": [round(r["update_s"], 4) for r in rows],
                "aggregate_gparam_per_s": round(total / slowest / 1e9, 3)}
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
