"""The GPU lease (dos/_lease.py, issue 14) without a GPU: torch.cuda's memory
functions are replaced by fakes, so the lease's arithmetic (budget from the
explicit argument, $DOS_GPU_BUDGET, the per-process fraction or free memory;
peak; headroom), when it is sent (lowered at once, raised only past a
threshold, never with lending off), and that it reaches dosd (the session's
stats in dosctl) are checked on the CPU."""

import json
import os
import subprocess

import pytest
import torch

import dos._lease as lease_mod
import dos.torch
from dos._lease import GiB, GpuLease, parse_bytes


class FakeCuda:
    """The torch.cuda memory functions the lease reads, with settable values."""

    def __init__(self, monkeypatch, total=141 * GiB, free=100 * GiB, fraction=None,
                 reserved=20 * GiB, peak=24 * GiB):
        self.total, self.free, self.fraction = total, free, fraction
        self.reserved, self.peak = reserved, peak
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (self.free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: self.peak)
        if fraction is None:
            monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
        else:
            monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction",
                                lambda d=None: self.fraction, raising=False)


@pytest.fixture
def sent(monkeypatch):
    """Leases the library would have been given: (session, lease, budget, peak)."""
    calls = []

    def fake_call(name, session, arg):
        assert name == "dos_set_gpu_lease"
        lease = arg._obj
        calls.append((session, lease.lease_bytes, lease.budget_bytes, lease.peak_bytes))

    monkeypatch.setattr(lease_mod, "call", fake_call)
    return calls


def test_parse_bytes():
    assert parse_bytes("80G") == 80 * GiB
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("1.5T") == int(1.5 * (1 << 40))
    assert parse_bytes(12345) == 12345
    assert parse_bytes("0") == 0
    with pytest.raises(ValueError, match="80 gigs"):
        parse_bytes("80 gigs")
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-1)


def test_budget_from_the_per_process_fraction(monkeypatch, sent):
    cuda = FakeCuda(monkeypatch, fraction=74 / 141)
    lease = GpuLease("cuda:0", env={})
    got = lease.update(1)
    budget = lease.last["budget_bytes"]
    assert abs(budget - 74 * GiB) < (1 << 20)
    assert got == budget - 24 * GiB - budget // 20
    assert lease.last["budget_source"] == "per-process memory fraction"
    assert sent == [(1, lease.last["lease_bytes"], lease.last["budget_bytes"], 24 * GiB)]
    assert cuda.peak == lease.last["peak_bytes"]


def test_explicit_budget_and_headroom_win(monkeypatch, sent):
    FakeCuda(monkeypatch, fraction=0.5)
    lease = GpuLease("cuda:0", env={"DOS_GPU_BUDGET": "80G", "DOS_GPU_HEADROOM": "2G"})
    assert lease.update(1) == 80 * GiB - 24 * GiB - 2 * GiB
    assert lease.last["budget_source"] == "gpu_budget_bytes"
    # The constructor's argument beats the environment.
    lease = GpuLease("cuda:0", budget_bytes=40 * GiB, env={"DOS_GPU_BUDGET": "80G"})
    assert lease.update(1) == 40 * GiB - 24 * GiB - 2 * GiB  # headroom: max(1 GiB, 5%)


def test_without_a_limit_the_budget_is_what_was_free(monkeypatch, sent):
    FakeCuda(monkeypatch, fraction=None, free=100 * GiB, reserved=20 * GiB)
    lease = GpuLease("cuda:0", env={})
    budget = 120 * GiB
    assert lease.update(1) == budget - 24 * GiB - budget // 20
    assert lease.last["budget_source"] == "free device memory"
    # A fraction of 1 (torch's default) is no limit either.
    FakeCuda(monkeypatch, fraction=1.0, free=100 * GiB, reserved=20 * GiB)
    assert GpuLease("cuda:0", env={}).update(1) == budget - 24 * GiB - budget // 20


def test_a_growing_peak_lowers_the_lease_at_once_and_small_rises_are_ignored(monkeypatch, sent):
    cuda = FakeCuda(monkeypatch)
    lease = GpuLease("cuda:0", budget_bytes=80 * GiB, env={})
    first = lease.update(1)
    assert first == 80 * GiB - 24 * GiB - 4 * GiB
    assert lease.update(1) == first and len(sent) == 1  # unchanged: not sent again
    cuda.peak = 30 * GiB  # the trainer grew: the lease shrinks by as much, sent now
    assert lease.update(1) == first - 6 * GiB
    assert len(sent) == 2 and sent[-1][1] == first - 6 * GiB
    # The peak never falls in torch, but a larger budget would raise the
    # lease: a rise under max(256 MiB, 1%) is not sent, a larger one is.
    lease._budget += 100 << 20
    assert lease.update(1) == first - 6 * GiB and len(sent) == 2
    lease._budget += 2 * GiB
    assert lease.update(1) > first - 6 * GiB and len(sent) == 3


def test_a_new_session_is_sent_the_lease_again(monkeypatch, sent):
    FakeCuda(monkeypatch)
    lease = GpuLease("cuda:0", budget_bytes=80 * GiB, env={})
    lease.update(1)
    lease.update(2)  # re-registration attached another session
    assert [s for s, *_ in sent] == [1, 2]


def test_lending_off(monkeypatch, sent):
    FakeCuda(monkeypatch)
    for lease in (GpuLease("cuda:0", budget_bytes=0, env={}),
                  GpuLease("cuda:0", env={"DOS_GPU_BUDGET": "0"})):
        assert not lease.enabled
        assert lease.update(1) is None
    assert sent == []


def find_dosctl():
    env = os.environ.get("DOS_DOSCTL")
    return env if env and os.path.exists(env) else None


def test_the_optimizer_sends_its_lease_to_dosd_before_each_step(dos_socket, monkeypatch):
    """A CPU session with the lease of a faked CUDA trainer: the lease goes
    through the real library and control block, the client waits for dosd's
    lease bell (a first lease), and dosd reports it in the session's stats."""
    model = torch.nn.Linear(8, 4)
    opt = dos.torch.AdamW(model.parameters(), lr=1e-2, socket=dos_socket,
                          client_name="pytest-lease")
    try:
        FakeCuda(monkeypatch, peak=5 * GiB)
        opt._parts.lease = GpuLease("cuda:0", budget_bytes=16 * GiB, env={})
        opt._parts.configure()  # a driver that lends it
        ref = torch.nn.Linear(8, 4)
        ref.load_state_dict(model.state_dict())
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for _ in range(3):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                m(torch.ones(2, 8)).sum().backward()
                o.step()
        assert opt.gpu_lease["lease_bytes"] == 16 * GiB - 5 * GiB - GiB
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)  # the lease changes no result
        dosctl = find_dosctl()
        if dosctl is None:
            pytest.skip("lease sent; no dosctl (set DOS_DOSCTL) to read it back from dosd")
        out = subprocess.run([dosctl, f"--socket={dos_socket}", "--json", "stats",
                              str(opt.session_id)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert str(10 * GiB) in text, text  # gpu_lease_bytes
        assert str(16 * GiB) in text, text  # the trainer's budget
        doc = json.loads(text)
        assert doc
    finally:
        opt.close()


def _train_cuda(socket, budget, grow_peak_at=None, steps=8):
    """Trains a bf16 MLP of 9 subgroups through dosd on CUDA with `budget`
    (gpu_budget_bytes; 0: no lease); at step `grow_peak_at` the trainer's
    peak grows by 400 MiB first. Returns the weights, the leases sent and
    the device memory dosd gave back at that step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(64, 2048, generator=g).to("cuda", torch.bfloat16) for _ in range(steps)]
    try:
        opt = dos.torch.AdamW(model.parameters(), lr=1e-3, socket=socket,
                              client_name="pytest-lease-cuda", subgroup_size=4 << 20,
                              gpu_budget_bytes=budget)
    except dos.DosError as e:
        if "no GPU engine" in e.message:
            pytest.skip(f"dosd has no GPU engine: {e.message}")
        raise
    leases, freed = [], None
    try:
        for i, x in enumerate(data):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            if i == grow_peak_at:
                blob = torch.empty(400 << 20, dtype=torch.uint8, device="cuda")
                del blob  # cached by torch: max_memory_reserved grew by 400 MiB
                torch.cuda.synchronize()
                free_before = torch.cuda.mem_get_info()[0]
                opt.step()  # returns once dosd has given the memory back
                freed = torch.cuda.mem_get_info()[0] - free_before
            else:
                opt.step()
            leases.append(None if opt.gpu_lease is None else opt.gpu_lease["lease_bytes"])
        opt.synchronize()
        weights = [p.detach().clone() for p in model.parameters()]
    finally:
        opt.close()
    return weights, leases, freed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_cuda_a_growing_peak_shrinks_the_tier_first_and_results_stay_exact(dos_socket,
                                                                          monkeypatch):
    """GPU mode through a real dosd: a lease of 8 resident subgroups, then
    the trainer's peak grows by 400 MiB; step() returns only after dosd freed
    them, and the weights equal a run without any lease, bit for bit."""
    if not dos._native.cuda_supported():
        pytest.skip("libdos_client was built without CUDA")
    monkeypatch.setenv("DOS_GPU_HEADROOM", "64M")
    ref, ref_leases, _ = _train_cuda(dos_socket, 0)
    assert ref_leases == [None] * len(ref_leases)
    # Budget: what the trainer held (the same model again reuses torch's
    # cache, so its peak stays there), the headroom, dosd's two staging
    # slots and 8 of the 9 subgroups (48 MiB of state each); the 400 MiB
    # growth then leaves the lease too small for any.
    torch.cuda.reset_peak_memory_stats()
    sg = 48 << 20
    budget = torch.cuda.max_memory_reserved() + (64 << 20) + 2 * sg + 8 * sg + (24 << 20)
    got, leases, freed = _train_cuda(dos_socket, budget, grow_peak_at=4)
    assert leases[4] <= leases[3] - (400 << 20), leases
    assert freed is not None and freed >= 6 * sg, f"dosd gave back only {freed} bytes"
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
