"""Worker bodies for test_dcp.py (spawned by torch.multiprocessing; kept out
of test_*.py so that the children import nothing pytest collects).

save_worker: `world` ranks train a DDP or FSDP2 model with dos.torch.AdamW
(each rank its own session on the test's dosd) and save the optimizer state
with torch.distributed.checkpoint (or, where torch's DCP cannot be
imported, rank 0 with torch.save: DDP state is replicated); rank 0 also writes the full state
(gathered from the shards for FSDP2) with torch.save as the reference.
load_worker: a different number of ranks builds the same model and optimizer,
loads the checkpoint with DCP (resharding) and reports how its full state
compares with the reference. Each worker writes a JSON report."""

import json
import os
import traceback

import torch
import torch.distributed as dist

from ddp_workers import LR, fully_shard_fn, init

STEPS = 5


def make_model():
    # Every dimension divisible by 1, 2 and 3: no rank holds an empty FSDP2 shard.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 6))


def rank_data(rank, n):
    g = torch.Generator().manual_seed(200 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 6, generator=g)) for _ in range(n)]


def dcp_module():
    try:
        import torch.distributed.checkpoint as dcp  # torch >= 2.0
    except ImportError:
        import torch.distributed._shard.checkpoint as dcp  # torch 1.13
    return dcp


def dcp_save(flat, path, backend):
    if backend == "torch.save":  # replicated (DDP) state: rank 0 writes it
        if dist.get_rank() == 0:
            torch.save(flat, path + ".pt")
        dist.barrier()
        return
    dcp = dcp_module()
    writer = dcp.FileSystemWriter(path)
    if hasattr(dcp, "save"):  # torch >= 2.2
        dcp.save(flat, storage_writer=writer)
    else:
        dcp.save_state_dict(flat, writer)


def dcp_load(flat, path, backend):
    if backend == "torch.save":
        saved = torch.load(path + ".pt")
        for key, t in flat.items():
            t.copy_(saved[key])
        return
    dcp = dcp_module()
    reader = dcp.FileSystemReader(path)
    if hasattr(dcp, "load"):
        dcp.load(flat, storage_reader=reader)
    else:
        dcp.load_state_dict(flat, reader)


def build(mode, world):
    model = make_model()
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    fully_shard = fully_shard_fn()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def flatten(model, sd):
    """The optimizer state as a flat {name: tensor} dict keyed by parameter
    name (stable across world sizes), as torch.distributed.checkpoint 1.13
    needs it; the tensors are sd's own, so loading into them fills sd."""
    names = [n for n, _ in model.named_parameters()]
    flat = {}
    for idx, s in sd["state"].items():
        for key, value in s.items():
            flat[f"optim.{names[idx]}.{key}"] = value
    return flat


def full_state(model, sd):
    """{name: {key: full CPU tensor}} (DTensor shards gathered: collective)."""
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for idx, s in sd["state"].items():
        out[names[idx]] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                           for k, v in s.items()}
    return out


def dcp_get_changes(model, opt):
    """DCP's get_optimizer_state_dict after zero_grad(set_to_none=True), as
    accelerate's and Lightning's FSDP2 saves call it: what it changed in the
    optimizer's state (its zero-gradient init step must change nothing)."""
    try:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    except ImportError:  # torch < 2.2
        return []
    opt.zero_grad(set_to_none=True)
    before = full_state(model, opt.state_dict())
    get_optimizer_state_dict(model, opt)
    after = full_state(model, opt.state_dict())
    return [f"{n}.{k}" for n, s in before.items() for k, v in s.items()
            if not torch.equal(after[n][k], v)]


def report_to(out_dir, name, report):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(report, f)


def save_worker(rank, world, rendezvous, socket, out_dir, mode, backend, ckpt):
    import dos.torch
    init(rank, world, rendezvous)
    report = {"rank": rank}
    try:
        model = build(mode, world)
        opt = dos.torch.AdamW(model.parameters(), socket=socket,
                              client_name=f"pytest-dcp-save-{rank}", **LR)
        for x, y in rank_data(rank, STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if backend == "dcp":
            report["dcp_get_changed"] = dcp_get_changes(model, opt)
        sd = opt.state_dict()
        report["devices"] = sorted({str(t.device) for s in sd["state"].values()
                                    for t in s.values()})
        report["dtensor"] = any(hasattr(t, "device_mesh") for s in sd["state"].values()
                                for t in s.values())
        dcp_save(flatten(model, sd), ckpt, backend)
        full = full_state(model, sd)
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "reference.pt"))
        opt.close()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    finally:
        report_to(out_dir, f"save{rank}.json", report)
        dist.destroy_process_group()


def load_worker(rank, world, rendezvous, socket, out_dir, mode, backend, ckpt):
    import dos.torch
    init(rank, world, rendezvous)
    report = {"rank": rank}
    try:
        model = build(mode, world)
        opt = dos.torch.AdamW(model.parameters(), socket=socket,
                              client_name=f"pytest-dcp-load-{rank}", **LR)
        # This rank's layout, filled in place by DCP (a fresh optimizer has no
        # state, as torch's: all_params gives every parameter's, as DCP's
        # get_optimizer_state_dict does).
        sd = opt.state_dict(all_params=True)
        dcp_load(flatten(model, sd), ckpt, backend)
        opt.load_state_dict(sd)
        full = full_state(model, opt.state_dict())  # read back from the daemon
        ref = torch.load(os.path.join(out_dir, "reference.pt"))
        worst, keys = 0.0, 0
        for name, s in ref.items():
            for key, want in s.items():
                got = full[name][key]
                keys += 1
                if got.shape != want.shape:
                    report.setdefault("mismatch", f"{name}.{key}: {got.shape} vs {want.shape}")
                    continue
                worst = max(worst, (got.float() - want.float()).abs().max().item())
        report["keys"] = keys
        report["max_diff"] = worst
        report["local_numel"] = sum(e.local.numel() for e in opt._entries)
        # Training goes on from the loaded state.
        x, y = rank_data(rank, 1)[0]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        report["step_after"] = opt.last_step["step"]
        opt.close()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    finally:
        report_to(out_dir, f"load{rank}.json", report)
        dist.destroy_process_group()


def refusal_worker(rank, world, rendezvous, spill_dir, out_dir, case):
    """dos/_dcp.py's decision across ranks: rank 1 has no disk for the
    moved views ("no disk") or fails before its vote ("an error": a DOS_SPILL
    typo); rank 0 has a disk. Both must refuse (rank 0 naming the other rank)
    instead of rank 0 going on into DCP's collectives alone, and rank 0's
    reserved file must be given back."""
    from dos import _carry, _dcp
    from ddp_workers import rank_report
    init(rank, world, rendezvous)
    os.environ["DOS_SPILL"] = "always" if rank == 0 or case != "an error" else "Always"
    os.environ["DOS_SPILL_DIR"] = spill_dir
    _carry._disk_room = (lambda d: (1 << 40, "")) if rank == 0 else (
        lambda d: (0, "a test: no disk on this rank"))
    with rank_report(rank, out_dir) as report:
        moved = _dcp._Moved(None)
        t = torch.ones(1 << 16)
        try:
            if case == "a stateful error":  # through the wrapped load: rank 1's value fails
                import sys
                import types
                mod = types.ModuleType("torch.distributed.checkpoint")
                mod.load = lambda sd, **kw: dist.all_reduce(torch.ones(1))  # DCP's collective
                sys.modules["torch.distributed.checkpoint"] = mod
                _dcp.install()

                class Bad:
                    def state_dict(self):
                        if rank == 1:
                            raise RuntimeError("a test: state_dict failed")
                        return {"t": t}

                    def load_state_dict(self, sd):
                        pass
                mod.load({"app": Bad()})
            else:
                moved.add([t])
            report["refused"] = ""
        except Exception as e:  # noqa: BLE001 - the refusal is what is measured
            report["refused"] = str(e)
        report["moved"] = bool(moved._moved)
        with open("/proc/self/maps") as f:
            report["maps"] = [ln for ln in f if spill_dir in ln]


def stateful_worker(rank, world, rendezvous, spill_dir, out_dir, case):
    """Rank 0 loads a dict with a Stateful value, rank 1 one without, through
    a stand-in of DCP's load that runs a collective of its own (as DCP's
    planning does): the ranks' votes must not meet it."""
    import sys
    import types
    from datetime import timedelta
    from dos import _dcp
    from ddp_workers import rank_report
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=20))
    mod = types.ModuleType("torch.distributed.checkpoint")

    def load(state_dict, checkpoint_id=None):
        state = {k: (v.state_dict() if hasattr(v, "load_state_dict") else v)
                 for k, v in state_dict.items()}
        total = torch.ones(1)
        dist.all_reduce(total)  # DCP's own collective
        for v in state.values():
            for t in (v.values() if isinstance(v, dict) else [v]):
                t.fill_(float(total))
        for k, v in state_dict.items():
            if hasattr(v, "load_state_dict"):
                v.load_state_dict(state[k])
    mod.load = load
    sys.modules["torch.distributed.checkpoint"] = mod
    _dcp.install()

    class App:
        def __init__(self):
            self.t = torch.zeros(2)

        def state_dict(self):
            return {"x": self.t}

        def load_state_dict(self, sd):
            pass
    with rank_report(rank, out_dir) as report:
        a, app = torch.zeros(2), App()
        d = {"a": a, "app": app if rank == 0 else {"x": app.t}}
        mod.load(d)
        report["loaded"] = a.tolist() + app.t.tolist()
