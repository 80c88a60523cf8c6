"""GPU mode of dos.torch: a small MLP on CUDA trained with dos.torch.AdamW
against torch.optim.AdamW on the same GPU, under several scheduling policies.
The parameters and gradients stay where they are on the GPU (the client
exports them by CUDA IPC; the daemon updates them in place).

Tolerance: the same as test_equivalence.py (rtol 1e-6, atol 1e-6 x the
tensor's max |w|), for the same reasons: the daemon's kernels and torch's
CUDA AdamW may round an operation differently by an ulp, and training feeds
those ulps back through the gradients.

Skips without CUDA (torch.cuda.is_available() false) or when the loaded
libdos_client or dosd were built without CUDA.
"""

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402
from dos import _native  # noqa: E402

from test_equivalence import assert_same  # noqa: E402

STEPS = 50

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device visible: GPU-mode tests skipped")


def is_async(opt):
    """step() returns before the update (the mode's completion is not WAIT)."""
    return opt._parts.driver.mode.complete.name != "WAIT"


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4)).cuda()


def make_data(seed=1, n=STEPS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g).cuda(), torch.randn(32, 4, generator=g).cuda())
            for _ in range(n)]


def need_cuda_build():
    if not _native.cuda_supported():
        pytest.skip("libdos_client was built without CUDA")


def make_opt(module, socket, name, **kw):
    try:
        return dos.torch.AdamW(module.parameters(), socket=socket, client_name=name, **kw)
    except dos.DosError as e:
        if "no GPU engine" in e.message:
            pytest.skip(f"dosd has no GPU engine: {e.message}")
        raise


# Small subgroups so that every policy splits the model between both paths.
@pytest.mark.parametrize("policy", ["auto", "cpu", "interleave:2", "static:0.5"])
def test_cuda_matches_torch(dos_socket, policy):
    need_cuda_build()
    data = make_data()
    ref = make_mlp()
    mine = make_mlp()
    ptrs = [p.data_ptr() for p in mine.parameters()]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.05)
    opt = make_opt(mine, dos_socket, f"pytest-cuda-{policy}", lr=2e-3, weight_decay=0.05,
                   subgroup_size=256)
    try:
        opt.set_policy(policy)
        # Registered in place: no copies of the parameters, grads allocated.
        assert [p.data_ptr() for p in mine.parameters()] == ptrs
        assert all(p.grad is not None and p.grad.is_cuda for p in mine.parameters())
        grad_ptrs = [p.grad.data_ptr() for p in mine.parameters()]
        for step, (x, y) in enumerate(data, 1):
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                o.step()
            assert not opt.found_inf
            assert_same(mine, ref, step)
        assert [p.grad.data_ptr() for p in mine.parameters()] == grad_ptrs
        assert opt.last_step["step"] == STEPS

        # state_dict: torch's layout, equal to torch's, on the CPU: reading
        # it allocates no GPU memory (it streams from the daemon).
        ref_sd = ref_opt.state_dict()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        sd = opt.state_dict()
        assert torch.cuda.max_memory_allocated() == before
        for i, p in enumerate(mine.parameters()):
            s, r = sd["state"][i], ref_sd["state"][i]
            assert s["exp_avg"].device.type == "cpu" and s["exp_avg_sq"].device.type == "cpu"
            assert float(s["step"]) == float(r["step"]) == STEPS
            for k in ("exp_avg", "exp_avg_sq"):
                rk = r[k].cpu()
                assert torch.allclose(s[k], rk, rtol=1e-5, atol=1e-6 * rk.abs().max().item())
        # load_state_dict from torch.optim.AdamW (CUDA state: converted in
        # bounded pieces), then one more step each.
        opt.load_state_dict(ref_sd)
        x, y = data[0]
        for model, o in ((ref, ref_opt), (mine, opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
        assert_same(mine, ref, STEPS + 1)
    finally:
        opt.close()
    # After close the model keeps its trained weights where they were.
    assert [p.data_ptr() for p in mine.parameters()] == ptrs
    assert_same(mine, ref, STEPS + 1)


def test_cuda_bf16_registers_in_place(dos_socket):
    need_cuda_build()
    model = make_mlp().to(torch.bfloat16)
    opt = make_opt(model, dos_socket, "pytest-cuda-bf16", lr=1e-3)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        opt.close()


def test_cuda_mixed_devices_rejected(dos_socket):
    need_cuda_build()
    a = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    b = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(dos.DosError, match="several devices"):
        dos.torch.AdamW([a, b], socket=dos_socket)


def wide_data(seed, n):
    """n random (input, target) batches for make_wide(), on the GPU."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 1024, generator=g).cuda(), torch.randn(64, 8, generator=g).cuda())
            for _ in range(n)]


# Early steps begin in post-accumulate-grad hooks.
needs_grad_hooks = pytest.mark.skipif(
    not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
    reason="early steps need torch >= 2.1 (post-accumulate-grad hooks)")


def make_wide(seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(1024, 8))
    return torch.nn.Sequential(*layers).cuda()


@pytest.mark.parametrize("policy", ["auto", "cpu"])
def test_cuda_stream_ordered_steps_equal_synchronous(dos_socket, policy):
    """step() returns once queued: the next forward waits on the GPU, for the
    whole step (default) or per layer (model=). 4.2M parameters in 65 536-
    element subgroups, so the daemon is still writing later layers while the
    next forward is queued; a missing wait would read half-updated weights
    and break the bitwise equality with synchronous steps."""
    need_cuda_build()
    data = wide_data(3, 12)
    models = {k: make_wide() for k in ("sync", "stream", "layers")}
    kw = dict(lr=1e-3, weight_decay=0.05, subgroup_size=65536)
    opts = {"sync": make_opt(models["sync"], dos_socket, "sync", async_step=False, **kw),
            "stream": make_opt(models["stream"], dos_socket, "stream", **kw),
            "layers": make_opt(models["layers"], dos_socket, "layers", model=models["layers"],
                               **kw)}
    try:
        if not opts["stream"]._parts.reg.stream_supported():
            pytest.skip("the CUDA driver has no stream memory operations")
        assert all(is_async(opts[k]) for k in ("stream", "layers")) and not is_async(opts["sync"])
        losses = {k: [] for k in models}
        for k, o in opts.items():
            o.set_policy(policy)
            m = models[k]
            for x, y in data:
                o.zero_grad()
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
                o.step()
                if k != "sync":
                    assert o._inflight  # queued, not waited for
                losses[k].append(loss.detach())
            torch.cuda.synchronize()
        for k in ("stream", "layers"):
            assert opts[k].last_step["step"] == len(data)
            assert [float(v) for v in losses[k]] == [float(v) for v in losses["sync"]], k
            for a, b in zip(models[k].parameters(), models["sync"].parameters()):
                assert torch.equal(a, b), k
    finally:
        for o in opts.values():
            o.close()


@needs_grad_hooks
@pytest.mark.parametrize("policy", ["auto", "cpu", "static:0.5"])
def test_cuda_update_during_backward_skips_an_unused_layer(dos_socket, policy):
    """overlap="update" on the GPU path with a layer the forward never uses
    (registered first, sharing a subgroup with a used weight): it keeps its
    weights, as torch skips a parameter without a gradient, and the rest is
    bitwise the synchronous result, on every path."""
    need_cuda_build()
    data = wide_data(5, 6)
    kw = dict(lr=1e-3, weight_decay=0.05, subgroup_size=65536)

    def build():
        torch.manual_seed(7)
        unused = torch.nn.Linear(1024, 64).cuda()
        return torch.nn.ModuleDict({"unused": unused, "net": make_wide()})
    models = {k: build() for k in ("sync", "early")}
    before = [p.detach().clone() for p in models["early"]["unused"].parameters()]
    opts = {"sync": make_opt(models["sync"], dos_socket, "sync", async_step=False, **kw),
            "early": make_opt(models["early"], dos_socket, "early", overlap="update", **kw)}
    try:
        if not opts["early"]._parts.reg.stream_supported():
            pytest.skip("the CUDA driver has no stream memory operations")
        for k, o in opts.items():
            o.set_policy(policy)
            for x, y in data:
                o.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(models[k]["net"](x), y).backward()
                o.step()
            o.synchronize()
        assert opts["early"].last_step["early"]
        for p, b in zip(models["early"]["unused"].parameters(), before):
            assert torch.equal(p.detach(), b), policy
        for a, b in zip(models["early"].parameters(), models["sync"].parameters()):
            assert torch.equal(a, b), policy
    finally:
        for o in opts.values():
            o.close()


@needs_grad_hooks
@pytest.mark.parametrize("policy", ["auto", "cpu", "static:0.5"])
def test_cuda_early_steps_equal_synchronous(dos_socket, policy):
    """Early steps on the GPU path (stream-ordered ready words): overlap=True
    with opt.clip_grad_norm_ and overlap="update" (dosd updates subgroups
    during backward, the CPU path's gradients copied as soon as the trainer's
    stream marks them) are bitwise equal to synchronous steps with the same
    clip coefficient, with per-layer waits (model=)."""
    need_cuda_build()
    data = wide_data(4, 10)
    kw = dict(lr=1e-3, weight_decay=0.05, subgroup_size=65536)
    for clip in (0.05, None):
        models = {k: make_wide() for k in ("sync", "early")}
        overlap = True if clip is not None else "update"
        opts = {"sync": make_opt(models["sync"], dos_socket, "sync", async_step=False, **kw),
                "early": make_opt(models["early"], dos_socket, "early", model=models["early"],
                                  overlap=overlap, **kw)}
        try:
            if not opts["early"]._parts.reg.stream_supported():
                pytest.skip("the CUDA driver has no stream memory operations")
            for k, o in opts.items():
                o.set_policy(policy)
                m = models[k]
                for x, y in data:
                    o.zero_grad()
                    torch.nn.functional.mse_loss(m(x), y).backward()
                    if k == "early":
                        assert o._parts.flight.machine.hook_begun
                    if clip is not None:
                        o.clip_grad_norm_(clip)
                    o.step()
                torch.cuda.synchronize()
            last = opts["early"].last_step
            assert last["early"] and last["step"] == len(data), last
            for a, b in zip(models["early"].parameters(), models["sync"].parameters()):
                assert torch.equal(a, b), (policy, clip)
        finally:
            for o in opts.values():
                o.close()


CUDA_TRAINER = """
import json, os, signal, sys, torch
sys.path.insert(0, {testdir!r})
import dos.torch
from test_cuda import make_wide, wide_data
data = wide_data(5, {total})
model = make_wide()
opt = dos.torch.AdamW(model.parameters(), socket={socket!r}, subgroup_size=65536, lr=1e-3)
opt.set_policy("auto")
for x, y in data[:{crash_after}]:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
# Killed with a step in flight: the daemon finishes it (a step boundary).
with open({info!r}, "w") as f:
    json.dump(opt.session_info(), f)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_cuda_resume_after_sigkill_mid_step(dos_socket, tmp_path):
    """GPU path of crash survival: a CUDA trainer killed right after queueing
    step k (asynchronous, so mid-step); a new process resumes the session,
    the daemon rewrites its CUDA weights from the fp32 masters, and the run
    continues bit for bit as an uninterrupted one."""
    import json
    import os
    import signal
    import subprocess
    import sys
    need_cuda_build()
    total, crash_after = 10, 4
    info_path = tmp_path / "session.json"
    script = CUDA_TRAINER.format(testdir=os.path.dirname(__file__), socket=dos_socket,
                                 total=total, crash_after=crash_after, info=str(info_path))
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), timeout=180)
    assert proc.returncode == -signal.SIGKILL
    info = json.loads(info_path.read_text())
    data = wide_data(5, total)

    def run(model, opt, batches):
        out = []
        for x, y in batches:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            out.append(float(loss))
        return out

    ref_model = make_wide()
    ref_opt = make_opt(ref_model, dos_socket, "resume-ref", lr=1e-3, subgroup_size=65536)
    model = make_wide(seed=9)  # different weights: the daemon's must win
    opt = make_opt(model, dos_socket, "resumed", lr=1e-3, subgroup_size=65536, resume=info)
    try:
        ref_opt.set_policy("auto")
        ref = run(ref_model, ref_opt, data)
        assert opt.resumed
        got = run(model, opt, data[crash_after:])
        assert opt.last_step["step"] == total
        assert got == ref[crash_after:]
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)
    finally:
        opt.close()
        ref_opt.close()
