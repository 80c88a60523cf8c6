"""Several ranks, one daemon: two processes (torch.multiprocessing.spawn,
gloo) train a DDP-wrapped MLP with dos.torch.AdamW, each rank attached to the
same dosd as its own session, against the same DDP run with
torch.optim.AdamW (clip_grad_norm_ on). Tolerance as in test_equivalence.py.
`dosctl sessions --json` must list both sessions, ranks 0 and 1 of 2.

FSDP2 (torch >= 2.4, fully_shard on CPU with gloo): each rank registers its
local shard; skipped with a message where torch lacks it.
"""

import glob
import json
import os
import shutil
import tempfile

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import ddp_workers  # noqa: E402

WORLD = 2

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def find_dosctl():
    env = os.environ.get("DOS_DOSCTL")
    if env and os.path.exists(env):
        return env
    dosd = os.environ.get("DOS_DOSD", "")
    for cand in (os.path.join(os.path.dirname(dosd), "dosctl"),
                 os.path.join(os.path.dirname(os.path.dirname(dosd)), "client", "dosctl",
                              "dosctl")):
        if os.path.exists(cand):
            return cand
    return None


def run_workers(fn, socket, dosctl):
    tmp = tempfile.mkdtemp(prefix="dos-ddp-")
    try:
        mp.spawn(fn, args=(WORLD, os.path.join(tmp, "rdv"), socket, dosctl, tmp), nprocs=WORLD,
                 join=True)
        reports = {}
        for path in glob.glob(os.path.join(tmp, "rank*.json")):
            with open(path) as f:
                r = json.load(f)
            reports[r["rank"]] = r
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the rendezvous file and the reports
    assert sorted(reports) == list(range(WORLD)), f"missing worker reports: {reports}"
    for r in reports.values():
        assert "error" not in r, f"rank {r['rank']}: {r['error']}"
    return reports


def test_ddp_two_ranks_one_daemon(dos_socket):
    dosctl = find_dosctl()
    reports = run_workers(ddp_workers.ddp_worker, dos_socket, dosctl)
    for rank, r in reports.items():
        assert r["attached"] == [rank, rank, WORLD]
        assert "mismatch" not in r, f"rank {rank}: {r['mismatch']}"
        assert r["steps"] == ddp_workers.STEPS
        assert r["ranks_equal"]
        print(f"rank {rank}: max |w_dos - w_torch| = {r['max_weight_diff']:.3g}")
    if dosctl is None:
        pytest.skip("training agreed; no dosctl found (set DOS_DOSCTL) to check ListSessions")
    r0 = reports[0]
    assert r0["dosctl_rc"] == 0, r0["dosctl"]
    sessions = json.loads(r0["dosctl"]).get("sessions", [])
    ours = [s for s in sessions if s.get("clientName", s.get("client_name", ""))
            .startswith("pytest-ddp-")]
    ranks = sorted(int(s.get("rank", 0)) for s in ours)
    worlds = {int(s.get("worldSize", s.get("world_size", 0))) for s in ours}
    assert ranks == [0, 1], f"ListSessions: {sessions}"
    assert worlds == {WORLD}


def test_fsdp2_two_ranks_register_local_shards(dos_socket):
    if ddp_workers.fully_shard_fn() is None:
        pytest.skip(f"FSDP2 (fully_shard) needs torch >= 2.4; this is torch {torch.__version__}")
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    except ImportError:
        pytest.skip("torch.distributed.device_mesh is missing")
    reports = run_workers(ddp_workers.fsdp2_worker, dos_socket, None)
    bad = [r["unsupported"] for r in reports.values() if "unsupported" in r]
    if bad:
        pytest.skip(f"torch {torch.__version__} cannot run fully_shard on the CPU with gloo: "
                    f"{bad[0][:300]}")
    total = sum(r["local_numel"] for r in reports.values())
    for rank, r in reports.items():
        assert r["local_numel"] < r["global_numel"], "each rank must register only its shard"
        # opt.clip_grad_norm_ adds the other ranks' shards, as torch's does
        for ref_norm, dos_norm in r["clip_norms"]:
            assert dos_norm == pytest.approx(ref_norm, rel=1e-5), r["clip_norms"]
        assert r["steps"] == ddp_workers.STEPS
        # fully_shard on CPU computes the same math on a different layout
        # (gradients reduce-scattered as averages); 1e-5 relative per tensor.
        assert r["max_rel_weight_diff"] < 1e-5, r
    assert total == reports[0]["global_numel"]


def test_clip_norm_of_sharded_gradients_adds_every_ranks_shards(dos_socket):
    """opt.clip_grad_norm_ over FSDP2's sharded gradients: the total norm
    covers every rank's shards (p-th powers summed, max for inf, min for -inf,
    counts for 0) and the gradients whole on every rank once, for every norm
    type; checked with plain shards and a gloo group, which any torch runs,
    then through opt.clip_grad_norm_'s own functions with gradients shaped as
    HSDP's DTensors (a replicated mesh dimension is not reduced over)."""
    reports = run_workers(ddp_workers.sharded_norm_worker, dos_socket, None)
    for r in reports.values():
        assert r["mismatch"] == [], f"rank {r['rank']}: (norm type, got, want) {r['mismatch']}"
        total, want, coef, want_coef = r["hsdp"]
        assert total == pytest.approx(want, rel=1e-5), f"rank {r['rank']}: HSDP-shaped total"
        assert coef == pytest.approx(want_coef, rel=1e-5), f"rank {r['rank']}: coefficient"


def test_ddp_parameters_unused_on_one_rank(dos_socket):
    """DDP with find_unused_parameters and a head used on one rank only: DDP
    writes the averaged gradient into the other rank's (unreached) parameter,
    so both ranks must update it, exactly as torch.optim.AdamW does; a head
    unused on every rank keeps its weights and state, as torch skips it."""
    reports = run_workers(ddp_workers.ddp_unused_worker, dos_socket, None)
    for r in reports.values():
        assert "mismatch" not in r, f"rank {r['rank']}: {r['mismatch']}"
        assert r["ranks_equal"], f"rank {r['rank']}: the ranks' weights differ"


def test_an_optimizer_built_before_the_ddp_wrap_trains_from_rank_0s_weights(dos_socket):
    """Each rank starts from other weights and builds its optimizer before
    DDP(model) broadcasts rank 0's: dosd's masters take the broadcast values
    at the first step (they kept each rank's own, and the ranks diverged)."""
    reports = run_workers(ddp_workers.ddp_wrapped_after_worker, dos_socket, None)
    for rank, r in reports.items():
        assert r["ranks_equal"], f"rank {rank}'s weights differ from rank 0's"
        assert r["close"], f"rank {rank}: differs from torch's AdamW by {r['worst']:.3g}"
