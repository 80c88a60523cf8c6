"""torch.distributed.checkpoint (DCP) with dos.torch.AdamW: two ranks (each
its own session on the test's dosd, gloo) train and save the optimizer state
with DCP; then one and three ranks load it (resharding) and must find exactly
the saved state, gathered in full. DDP runs everywhere (torch 1.13's DCP is
torch.distributed._shard.checkpoint); FSDP2 (DTensor state, sharded per rank)
where torch >= 2.4 can run fully_shard on the CPU with gloo, else skipped with
the reason. Where DCP cannot be imported (Debian's torch 1.13 on Python 3.11),
the same N -> M flow runs for DDP with torch.save by rank 0."""

import glob
import json
import os
import shutil
import tempfile

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import dcp_workers  # noqa: E402
import ddp_workers  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def dcp_unavailable():
    """Why torch.distributed.checkpoint cannot be used here, or None."""
    try:
        dcp_workers.dcp_module()
        return None
    except Exception as e:  # Debian's torch 1.13 fails to import it on Python 3.11
        return f"{type(e).__name__}: {str(e)[:200]}"


def spawn(fn, world, socket, out_dir, mode, backend, ckpt, prefix):
    rdv = tempfile.mktemp(prefix="rdv-", dir=out_dir)
    mp.spawn(fn, args=(world, rdv, socket, out_dir, mode, backend, ckpt), nprocs=world,
             join=True)
    reports = {}
    for path in glob.glob(os.path.join(out_dir, f"{prefix}*.json")):
        with open(path) as f:
            r = json.load(f)
        reports[r["rank"]] = r
        os.remove(path)
    assert sorted(reports) == list(range(world)), f"missing worker reports: {reports}"
    for r in reports.values():
        assert "error" not in r, f"{prefix} rank {r['rank']} of {world}: {r['error']}"
    return reports


@pytest.mark.parametrize("mode,backend", [("ddp", "dcp"), ("fsdp2", "dcp"),
                                          ("ddp", "torch.save")])
def test_save_two_ranks_load_one_and_three(dos_socket, mode, backend, request):
    why = dcp_unavailable() if backend == "dcp" else None
    if why:
        pytest.skip(f"torch {torch.__version__}'s torch.distributed.checkpoint cannot be "
                    f"imported here ({why}); the torch.save case covers DDP")
    if mode == "fsdp2":
        if ddp_workers.fully_shard_fn() is None:
            pytest.skip(f"FSDP2 (fully_shard) needs torch >= 2.4; this is torch "
                        f"{torch.__version__}")
    out = tempfile.mkdtemp(prefix=f"dos-dcp-{mode}-")
    request.addfinalizer(lambda: shutil.rmtree(out, ignore_errors=True))
    ckpt = os.path.join(out, "ckpt")
    saved = spawn(dcp_workers.save_worker, 2, dos_socket, out, mode, backend, ckpt, "save")
    for r in saved.values():
        assert r["devices"] == ["cpu"], r
        assert r["dtensor"] == (mode == "fsdp2"), r
        assert r.get("dcp_get_changed", []) == [], r  # DCP's init step changed the state
    full = sum(p.numel() for p in dcp_workers.make_model().parameters())
    for world in (1, 3):
        loaded = spawn(dcp_workers.load_worker, world, dos_socket, out, mode, backend, ckpt,
                       "load")
        for rank, r in loaded.items():
            assert "mismatch" not in r, f"{world} ranks, rank {rank}: {r['mismatch']}"
            assert r["keys"] == 4 * 3, r  # 4 tensors x (step, exp_avg, exp_avg_sq)
            assert r["max_diff"] == 0.0, f"{world} ranks, rank {rank}: {r}"
            assert r["step_after"] == dcp_workers.STEPS + 1
        local = sum(r["local_numel"] for r in loaded.values())
        assert local == (full if mode == "fsdp2" else full * world), loaded
