"""Worker bodies for test_ddp.py, run in processes started by
torch.multiprocessing.spawn (kept out of test_*.py so the children import
nothing pytest collects). Each worker writes a JSON report for the parent."""

import contextlib
import json
import os
import subprocess
import traceback

import torch
import torch.distributed as dist

STEPS = 30
LR = dict(lr=2e-3, weight_decay=0.05)
CLIP = 0.5  # the max_norm the clipping workers use


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def rank_data(rank, n=STEPS):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def train(model, opt, data, clip):
    snaps = []
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        snaps.append([p.detach().clone() for p in model.parameters()])
    return snaps


def init(rank, world, rendezvous):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)


@contextlib.contextmanager
def rank_report(rank, out_dir, **fields):
    """The worker's report for the parent (a dict): an exception goes into
    it as "error", which fails the test; on the way out it is written to
    rank<rank>.json and the process group destroyed."""
    report = {"rank": rank, **fields}
    try:
        yield report
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def ranks_equal(model):
    """Whether this rank's weights equal rank 0's, bit for bit."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, 0)
    return bool(torch.equal(flat, other))


def ddp_worker(rank, world, rendezvous, socket, dosctl, out_dir):
    import dos.torch
    from test_equivalence import ATOL_SCALE, RTOL
    init(rank, world, rendezvous)
    with rank_report(rank, out_dir) as report:
        data = rank_data(rank)
        ref = torch.nn.parallel.DistributedDataParallel(make_model())
        ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
        ref_snaps = train(ref, ref_opt, data, clip=True)

        mine = torch.nn.parallel.DistributedDataParallel(make_model())
        # rank/world_size default to torch.distributed's; local_rank passed through.
        opt = dos.torch.AdamW(mine.parameters(), socket=socket, client_name=f"pytest-ddp-{rank}",
                              local_rank=rank, **LR)
        report["attached"] = [opt.rank, opt.local_rank, opt.world_size]
        snaps = train(mine, opt, data, clip=True)
        worst = 0.0
        for step, (a_list, b_list) in enumerate(zip(snaps, ref_snaps), 1):
            for a, b in zip(a_list, b_list):
                atol = ATOL_SCALE * b.abs().max().item()
                if not torch.allclose(a, b, rtol=RTOL, atol=atol):
                    report.setdefault("mismatch", f"step {step}: differs by "
                                      f"{(a - b).abs().max().item():.3g} (atol {atol:.3g})")
                worst = max(worst, (a - b).abs().max().item())
        report["max_weight_diff"] = worst
        report["steps"] = opt.last_step["step"]
        # Both ranks' sessions are attached now: rank 0 asks the daemon.
        dist.barrier()
        if rank == 0 and dosctl:
            out = subprocess.run([dosctl, f"--socket={socket}", "--json", "sessions"],
                                 capture_output=True, text=True, timeout=30)
            report["dosctl_rc"] = out.returncode
            report["dosctl"] = out.stdout if out.returncode == 0 else out.stderr
        dist.barrier()
        # The two ranks' weights stay identical (DDP averages the gradients).
        report["ranks_equal"] = ranks_equal(mine)
        opt.close()


def fully_shard_fn():
    """torch's FSDP2 entry point, or None (torch < 2.4)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 4):
        return None
    for mod in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            m = __import__(mod, fromlist=["fully_shard"])
            if hasattr(m, "fully_shard"):
                return m.fully_shard
        except Exception:  # ImportError, or a broken import on this Python
            continue
    return None


def fsdp2_worker(rank, world, rendezvous, socket, dosctl, out_dir):
    import dos.torch
    from torch.distributed.device_mesh import init_device_mesh
    init(rank, world, rendezvous)
    with rank_report(rank, out_dir) as report:
        fully_shard = fully_shard_fn()
        mesh = init_device_mesh("cpu", (world,))
        data = rank_data(rank)

        def build():
            m = make_model()
            for layer in m:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            return m

        try:  # can this torch run FSDP2 on the CPU with gloo at all?
            ref = build()
            ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
            probe = build()
            torch.nn.functional.mse_loss(probe(data[0][0]), data[0][1]).backward()
            del probe
        except Exception as e:
            report["unsupported"] = f"{type(e).__name__}: {e}"
            return
        mine = build()
        opt = dos.torch.AdamW(mine.parameters(), socket=socket, client_name=f"pytest-fsdp2-{rank}",
                              **LR)
        report["local_numel"] = sum(e.local.numel() for e in opt._entries)
        report["global_numel"] = sum(p.numel() for p in mine.parameters())
        worst = 0.0
        norms = []  # (torch's total norm, opt.clip_grad_norm_'s): over every rank's shards
        for x, y in data:
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                if o is ref_opt:
                    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
                    norms.append([float(total.full_tensor() if hasattr(total, "full_tensor")
                                        else total)])
                else:
                    norms[-1].append(float(opt.clip_grad_norm_(CLIP)))
                o.step()
            for a, b in zip(mine.parameters(), ref.parameters()):
                a, b = a.to_local(), b.to_local()
                worst = max(worst, (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30))
        report["max_rel_weight_diff"] = worst
        report["clip_norms"] = norms
        report["steps"] = opt.last_step["step"]
        opt.close()


class Branchy(torch.nn.Module):
    """A trunk and two heads; each forward uses one head (as a mixture of
    experts routes tokens): with DDP the other head is unused on this rank,
    and it may be used on the other rank (then DDP writes the averaged
    gradient into it) or on none (then torch leaves it alone)."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(16, 32)
        self.a = torch.nn.Linear(32, 4)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x, use_a):
        h = torch.tanh(self.trunk(x))
        return self.a(h) if use_a else self.b(h)


def branch_of(rank, step):
    if step % 3 == 2:
        return True          # head b unused on every rank
    return (step + rank) % 2 == 0  # each head used on one rank only


def ddp_unused_worker(rank, world, rendezvous, socket, dosctl, out_dir):
    import dos.torch
    init(rank, world, rendezvous)
    with rank_report(rank, out_dir) as report:
        data = rank_data(rank, 12)

        def run(opt_factory):
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(Branchy(),
                                                              find_unused_parameters=True)
            opt = opt_factory(model.parameters())
            snaps = []
            for step, (x, y) in enumerate(data):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x, branch_of(rank, step)), y).backward()
                opt.step()
                snaps.append([p.detach().clone() for p in model.parameters()])
            return model, opt, snaps

        _, _, ref = run(lambda ps: torch.optim.AdamW(ps, **LR))
        model, opt, mine = run(lambda ps: dos.torch.AdamW(
            ps, socket=socket, client_name=f"pytest-ddp-unused-{rank}", local_rank=rank, **LR))
        worst = 0.0
        for step, (a_list, b_list) in enumerate(zip(mine, ref)):
            for i, (a, b) in enumerate(zip(a_list, b_list)):
                d = (a - b).abs().max().item()
                if d > 1e-5 and "mismatch" not in report:
                    report["mismatch"] = f"step {step} param {i}: differs by {d:.3g}"
                worst = max(worst, d)
        report["max_weight_diff"] = worst
        report["ranks_equal"] = ranks_equal(model)
        opt.close()


class _FakePlacement:
    """A DTensor placement's surface clip_shardings reads."""

    def __init__(self, replicate):
        self._replicate = replicate

    def is_replicate(self):
        return self._replicate


class _FakeMesh:
    """A DeviceMesh's surface: the process group of each mesh dimension."""

    def __init__(self, groups):
        self._groups = groups

    def get_group(self, mesh_dim):
        return self._groups[mesh_dim]


class _FakeDTensor:
    """What dos reads of a DTensor gradient: its local shard and layout."""

    def __init__(self, local, mesh, placements):
        self._local_tensor, self.device_mesh, self.placements = local, mesh, placements

    def to_local(self):
        return self._local_tensor


class _FakeParam:
    def __init__(self, grad):
        self.grad = grad


def sharded_norm_worker(rank, world, rendezvous, socket, dosctl, out_dir):
    """opt.clip_grad_norm_'s reduction of sharded gradients' norms (what FSDP2
    needs) without DTensor: each rank holds its shard of two "sharded"
    gradients and the whole of a "replicated" one; the total over every norm
    type must be the norm of the whole, as one process would compute it."""
    import math

    from dos import _grads
    init(rank, world, rendezvous)
    with rank_report(rank, out_dir, mismatch=[]) as report:
        g = torch.Generator().manual_seed(7)  # the same whole tensors on every rank
        whole = [torch.randn(40, generator=g), torch.randn(7, 3, generator=g)]
        replicated = torch.randn(5, generator=g)
        whole[0][3] = 0.0  # norm 0 counts non-zeros
        shards = [w.reshape(-1).tensor_split(world)[rank] for w in whole]
        spec = (dist.group.WORLD,)
        for p in (2.0, 1.0, 3.5, 0.0, math.inf, -math.inf):
            norms = [torch.linalg.vector_norm(t, p, dtype=torch.float32)
                     for t in shards + [replicated]]
            got = float(_grads._sharded_total(norms, [spec, spec, None], p))
            want = float(torch.linalg.vector_norm(
                torch.cat([w.reshape(-1) for w in whole] + [replicated]), p))
            if not math.isclose(got, want, rel_tol=1e-5):
                report["mismatch"].append([p, got, want])
        # Through opt.clip_grad_norm_'s own path (clip_grads, clip_shardings)
        # with gradients shaped as FSDP2's DTensors on a 2-D mesh whose first
        # dimension replicates (HSDP): only the second is reduced over.
        mesh = _FakeMesh({1: dist.group.WORLD})
        placements = (_FakePlacement(True), _FakePlacement(False))
        groups = [{"params": [_FakeParam(_FakeDTensor(t, mesh, placements)) for t in shards] +
                   [_FakeParam(replicated), _FakeParam(None)]}]
        grads = _grads.clip_grads(groups)
        total, clip = _grads.clip_coefficient(grads, 0.5, 2.0, False,
                                              _grads.clip_shardings(groups))
        want = float(torch.linalg.vector_norm(
            torch.cat([w.reshape(-1) for w in whole] + [replicated])))
        report["hsdp"] = [float(total), want, clip.coef, min(1.0, 0.5 / (want + 1e-6))]


def ddp_wrapped_after_worker(rank, world, rendezvous, socket, dosctl, out_dir):
    """The optimizer built before DDP wraps the model (the HF Trainer's and
    accelerate's order), each rank from its own random start: DDP's
    broadcast of rank 0's weights reaches dosd's masters at the first step,
    and the run is torch's."""
    import dos.torch
    from test_equivalence import ATOL_SCALE, RTOL
    init(rank, world, rendezvous)
    with rank_report(rank, out_dir) as report:
        data = rank_data(rank)
        runs = []
        for make in (lambda m: torch.optim.AdamW(m.parameters(), **LR),
                     lambda m: dos.torch.AdamW(m.parameters(), socket=socket, **LR)):
            model = make_model(seed=rank)
            opt = make(model)
            runs.append((train(torch.nn.parallel.DistributedDataParallel(model), opt, data,
                               clip=False), model, opt))
        (ref_snaps, _, _), (snaps, mine, opt) = runs
        report["worst"] = max((a - b).abs().max().item() for sa, sb in zip(snaps, ref_snaps)
                              for a, b in zip(sa, sb))
        report["close"] = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL_SCALE * b.abs().max())
                              for sa, sb in zip(snaps, ref_snaps) for a, b in zip(sa, sb))
        report["ranks_equal"] = ranks_equal(mine)
        opt.close()
