#!/usr/bin/env python3
"""DOS across nodes: a torchrun worker whose optimizer attaches to its own node's dosd.

Across nodes nothing changes in the training code: PyTorch distributed (gloo or NCCL) carries the
gradients between ranks as usual, and every rank hands its parameters (DDP: all of them; FSDP2:
its local shard) to the dosd of the node it runs on, found through $DOS_SOCKET. One dosd per node,
one session per rank; no daemon talks to another.

On each node i of N (the same command everywhere except --node_rank):

    dosd --socket=/run/dos/dosd.sock &     # or the systemd unit (deploy/): one daemon per node
    DOS_SOCKET=/run/dos/dosd.sock torchrun --nnodes=N --node_rank=i --nproc_per_node=G \\
        --rdzv_backend=c10d --rdzv_endpoint=NODE0_HOST:29400 --rdzv_id=JOB \\
        multinode.py --wrap ddp --out /shared/results

Two "nodes" on one machine (what tests/python/test_multinode.py and multinode_localhost.sh do):
two dosd on two sockets, two torchrun agents on 127.0.0.1, each with its own DOS_SOCKET.

Each rank writes OUT/rank<R>.json: its node, socket, session, losses, and a SHA-256 of its final
weights (DDP: all ranks equal; FSDP2: its shard).
"""
import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist

import dos.torch


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 8))


def rank_data(rank, steps, device):
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    return [(torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device))
            for _ in range(steps)]


def fully_shard_fn():
    """torch's FSDP2 entry point, or None before torch 2.4."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 4):
        return None
    for mod in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            m = __import__(mod, fromlist=["fully_shard"])
        except Exception:  # ImportError, or a broken import on this Python
            continue
        if hasattr(m, "fully_shard"):
            return m.fully_shard
    return None


def wrap(model, how, device):
    if how == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    fully_shard = fully_shard_fn()
    if fully_shard is None:
        raise SystemExit(f"--wrap fsdp2 needs torch >= 2.4 (fully_shard); this is {torch.__version__}")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def weights_digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def read_reports(folder):
    reports = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                r = json.load(f)
            reports[r["rank"]] = r
    return reports


def compare(run_a, run_b):
    """Per rank: losses and final weights of two runs of the same job (e.g. two nodes with
    a dosd each vs one dosd). Returns (max |loss difference|, list of problems)."""
    a, b = read_reports(run_a), read_reports(run_b)
    problems = []
    if sorted(a) != sorted(b) or not a:
        problems.append(f"ranks differ: {sorted(a)} vs {sorted(b)}")
        return float("inf"), problems
    worst = 0.0
    for rank in sorted(a):
        la, lb = a[rank]["losses"], b[rank]["losses"]
        if len(la) != len(lb):
            problems.append(f"rank {rank}: {len(la)} vs {len(lb)} losses")
            continue
        worst = max([worst] + [abs(x - y) for x, y in zip(la, lb)])
        if a[rank]["weights_sha256"] != b[rank]["weights_sha256"]:
            problems.append(f"rank {rank}: final weights differ")
    return worst, problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", help="folder for rank<R>.json")
    ap.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"),
                    help="compare two runs' folders instead of training; exit 1 if they differ")
    args = ap.parse_args()
    if args.compare:
        worst, problems = compare(*args.compare)
        for p in problems:
            print("multinode compare:", p)
        print(f"multinode compare: max |loss difference| {worst:.3g}; "
              f"{'EQUAL' if not problems and worst == 0 else 'DIFFERENT'}")
        raise SystemExit(0 if not problems and worst == 0 else 1)
    if not args.out:
        ap.error("--out is required when training")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = wrap(make_model().to(device), args.wrap, device)
    # Attaches to $DOS_SOCKET: this node's dosd. rank/local_rank/world_size come from
    # torch.distributed and torchrun's environment (dosctl sessions shows them).
    opt = dos.torch.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05,
                          client_name=f"multinode-{args.wrap}")
    losses = []
    for x, y in rank_data(rank, args.steps, device):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if args.wrap == "ddp":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    report = {"rank": rank, "world_size": world, "local_rank": local_rank,
              "node": int(os.environ.get("GROUP_RANK", "-1")),
              "socket": os.environ.get("DOS_SOCKET", dos.default_socket()),
              "session_id": opt.session_id, "steps": opt.last_step["step"], "losses": losses,
              "weights_sha256": weights_digest(model), "wrap": args.wrap,
              "torch": torch.__version__}
    opt.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if rank == 0:
        print(f"multinode: {world} ranks, {args.wrap}, last loss {losses[-1]:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
