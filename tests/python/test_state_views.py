"""The optimizer state never passes through the trainer's memory (issue 22):
torch's lazy state (nothing before a parameter's first step, so a framework's
round trip before training moves nothing), state_dict() tensors that are
views of dosd's memory (no private memory of the trainer's: RssAnon does not
grow; equal to the daemon's values; showing later steps, never half of one),
a state dict that loads back into its own optimizer without a copy, compact
moments as bf16, and the Lightning clipping flag."""

import gc
import io
import types

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from dos import _views  # noqa: E402
from test_state_io import daemon_state  # noqa: E402

LR = dict(lr=1e-3, weight_decay=0.01)
MiB = 1 << 20


def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def big_model(seed=0):
    """About 4.3M parameters in tensors large enough to be page-aligned in
    dosd (>= 64 Ki elements) plus small ones (biases) that are copied."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(),
                               torch.nn.Linear(2048, 1024))


def train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 1024, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_no_state_before_the_first_step_as_torch(dos_socket):
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        ref = torch.optim.AdamW(big_model().parameters(), **LR)
        sd = opt.state_dict()
        assert sd["state"] == {} == ref.state_dict()["state"]
        assert len(opt.state) == 0
        assert opt.state[model[0].weight] == {}
        # accelerate's prepare: state_dict() -> move -> load_state_dict():
        # nothing moves, and training then goes on as if it never happened.
        before = rss_anon()
        opt.load_state_dict(sd)
        assert rss_anon() - before < 16 * MiB
        train(model, opt, 2)
        sd = opt.state_dict()
        assert sorted(sd["state"]) == list(range(4))
        assert float(sd["state"][0]["step"]) == 2


def test_a_parameter_not_stepped_yet_has_no_state(dos_socket):
    model = big_model()
    model[2].weight.requires_grad_(True)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(4, 1024, generator=g)
        opt.zero_grad()
        # Only the first layer gets gradients; torch skips the others.
        (model[0](x).pow(2).mean()).backward()
        opt.step()
        sd = opt.state_dict()
        assert sorted(sd["state"]) == [0, 1]


# Also for subgroup sizes that are no multiple of the map alignment (2048
# elements): dosd rounds them up (a review found 1_000_000 copying it all).
@pytest.mark.parametrize("subgroup_size", [0, 1_000_000, 100_000])
def test_state_dict_is_views_of_dosd_memory_equal_to_its_values(dos_socket, subgroup_size):
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=subgroup_size,
                         **LR) as opt:
        train(model, opt, 3)
        gc.collect()
        before = rss_anon()
        sd = opt.state_dict()
        grew = rss_anon() - before
        total = sum(p.numel() for p in model.parameters()) * 8  # exp_avg + exp_avg_sq
        assert grew < total / 4, f"state_dict() grew RssAnon by {grew} of {total} state bytes"
        assert _views.live() >= 4  # the two weights' moments are views
        for e in opt._entries:
            s = sd["state"][e.index]
            buf, step = daemon_state(opt, e)
            assert float(s["step"]) == step == 3
            assert torch.equal(s["exp_avg"].reshape(-1), buf[1])
            assert torch.equal(s["exp_avg_sq"].reshape(-1), buf[2])
            assert s["exp_avg"].shape == e.param.shape
        # torch.save streams it (from dosd's pages) and it loads as torch's.
        f = io.BytesIO()
        torch.save(sd, f)
        f.seek(0)
        loaded = torch.load(f)
        ref = torch.optim.AdamW(big_model().parameters(), **LR)
        ref.load_state_dict(loaded)
        assert torch.equal(ref.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
        # A write into a view changes the writer's page, never dosd's state.
        sd["state"][0]["exp_avg"].fill_(7.0)
        buf, _ = daemon_state(opt, opt._entries[0])
        assert not torch.equal(buf[1], torch.full_like(buf[1], 7.0))
        del sd, loaded, ref, s
        gc.collect()
        assert _views.live() == 0


def test_views_show_later_steps_whole(dos_socket):
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, 2)
        sd = opt.state_dict()
        m0 = sd["state"][0]["exp_avg"].clone()
        train(model, opt, 1, seed=5)  # returns only when finished: views are alive
        buf, step = daemon_state(opt, opt._entries[0])
        assert step == 3
        assert torch.equal(sd["state"][0]["exp_avg"].reshape(-1), buf[1])
        assert not torch.equal(sd["state"][0]["exp_avg"], m0)


def test_own_state_dict_loads_without_a_copy_and_changes_nothing(dos_socket):
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, 2)
        before = [daemon_state(opt, e)[0].clone() for e in opt._entries]
        opt.load_state_dict(opt.state_dict())
        after = [daemon_state(opt, e)[0] for e in opt._entries]
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_saved_state_resumes_into_a_new_optimizer_exactly(dos_socket, tmp_path):
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, 2)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "c.pt")
        train(model, opt, 2, seed=9)
        want = [p.detach().clone() for p in model.parameters()]
    ck = torch.load(tmp_path / "c.pt")
    model2 = big_model(seed=4)
    model2.load_state_dict(ck["model"])
    with dos.torch.AdamW(model2.parameters(), socket=dos_socket, **LR) as opt2:
        opt2.load_state_dict(ck["opt"])
        train(model2, opt2, 2, seed=9)
        for a, b in zip(want, model2.parameters()):
            assert torch.equal(a, b.detach())


def test_compact_state_dict_has_bf16_moments(dos_socket):
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, compact_state=True,
                         **LR) as opt:
        train(model, opt, 2)
        sd = opt.state_dict()
        for s in sd["state"].values():
            assert s["exp_avg"].dtype == torch.bfloat16 == s["exp_avg_sq"].dtype
        ref = torch.optim.AdamW(big_model().parameters(), **LR)
        ref.load_state_dict(sd)  # torch converts to the parameter's dtype
        with dos.torch.AdamW(big_model().parameters(), socket=dos_socket, **LR) as opt2:
            opt2.load_state_dict(sd)
            got = opt2.state_dict()["state"][0]["exp_avg"]
            assert torch.equal(got, sd["state"][0]["exp_avg"].float())


def test_lightning_sees_no_internal_unscaling_torch_does(dos_socket):
    """Lightning refuses gradient_clip_val for optimizers whose step()
    unscales (it reads _step_supports_amp_scaling): DOS answers False to
    Lightning's modules, True to torch's GradScaler."""
    model = big_model()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        assert opt._step_supports_amp_scaling
        for name in ("lightning.pytorch.plugins.precision.amp",
                     "pytorch_lightning.plugins.precision.native_amp"):
            mod = types.ModuleType(name)
            exec("def handles(o):\n    return getattr(o, '_step_supports_amp_scaling', False)\n",
                 mod.__dict__)
            assert mod.handles(opt) is False
        mod = types.ModuleType("torch.amp.grad_scaler")
        exec("def handles(o):\n    return getattr(o, '_step_supports_amp_scaling', False)\n",
             mod.__dict__)
        assert mod.handles(opt) is True


def refusal(error, call):
    """The message of the `error` that call() raises, keeping no traceback
    (its frames would keep the test's views alive in a reference cycle)."""
    try:
        call()
    except error as e:
        return str(e)
    pytest.fail(f"{call} did not raise {error.__name__}")


def test_views_of_a_closed_optimizer_keep_its_memory_charged():
    """state_dict()'s views outlive close(), as torch's tensors outlive their
    optimizer; the memory they map stays charged to --host_memory_limit (and
    to the uid's --max_state_views_per_uid) until they are dropped, so a
    trainer that keeps them cannot make dosd hold more than its limit."""
    from conftest import running_dosd
    from dos import DosError
    model = big_model()  # ~4.3M parameters: ~50 MiB of fp32 state
    with running_dosd("--host_memory_limit=80M") as (sock, _):
        opt = dos.torch.AdamW(model.parameters(), socket=sock, **LR)
        train(model, opt, 1)
        sd = opt.state_dict()
        kept = sd["state"][0]["exp_avg"]
        expected = kept.clone()
        opt.close()
        text = refusal(DosError, lambda: dos.torch.AdamW(model.parameters(), socket=sock, **LR))
        assert "RESOURCE_EXHAUSTED" in text and "--host_memory_limit" in text, text
        assert "state_dict() views a trainer still holds" in text, text
        assert torch.equal(kept, expected)  # the views still read the closed state
        del sd, kept
        gc.collect()
        with dos.torch.AdamW(model.parameters(), socket=sock, **LR) as opt:
            train(model, opt, 1)
    gc.collect()  # the refused optimizer's remains
    assert not _views.live()  # a live view would turn later tests' delay off


def test_state_views_per_uid_are_bounded():
    from conftest import running_dosd
    from dos import DosError
    with running_dosd("--max_state_views_per_uid=2") as (sock, _):
        models = [big_model(seed) for seed in range(3)]
        opts = [dos.torch.AdamW(m.parameters(), socket=sock, **LR) for m in models]
        held = []
        try:
            for m, o in zip(models, opts):
                train(m, o, 1)
            held.append(opts[0].state_dict())
            opts[0].close()  # closed, its views kept: still counted
            held.append(opts[1].state_dict())
            text = refusal(DosError, opts[2].state_dict)
            assert "--max_state_views_per_uid=2" in text, text
            held.pop(0)
            gc.collect()
            assert len(opts[2].state_dict()["state"]) == 4
        finally:
            for o in opts:
                o.close()
            held.clear()
            gc.collect()
    assert not _views.live()  # a live view would turn later tests' delay off


def test_the_per_uid_state_cap_counts_dropped_views_no_more():
    """A closed optimizer's state stays charged to --max_state_bytes_per_uid
    while its state_dict() views are held, and no longer once they are
    dropped: the next registration goes through at once (dosd looks for
    released views before refusing, as --host_memory_limit does)."""
    from conftest import running_dosd
    from dos import DosError
    model = big_model()  # ~4.3M parameters: ~50 MiB of fp32 state
    with running_dosd("--max_state_bytes_per_uid=80M") as (sock, _):
        opt = dos.torch.AdamW(model.parameters(), socket=sock, **LR)
        train(model, opt, 1)
        sd = opt.state_dict()
        opt.close()
        text = refusal(DosError, lambda: dos.torch.AdamW(model.parameters(), socket=sock, **LR))
        assert "--max_state_bytes_per_uid" in text, text
        del sd
        gc.collect()
        with dos.torch.AdamW(model.parameters(), socket=sock, **LR) as opt:
            train(model, opt, 1)
    gc.collect()
    assert not _views.live()


@pytest.mark.parametrize("delay", [0, 1])
def test_a_state_dict_kept_across_steps_shows_each_later_step_whole(dos_socket, delay):
    """As torch's, whose state dict holds its live state tensors: every tensor
    of a state dict kept across steps shows the latest step, the step counts
    and the small tensors' copies as well as the views. The copies once kept
    the step they were taken at while the views showed later ones; a copy
    written by its holder keeps what was written."""
    model = big_model()
    x = torch.randn(16, 1024)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, delay=delay, delay_warmup=1,
                         model=model, **LR) as opt:
        def train(n):
            for _ in range(n):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()

        train(3)
        held = opt.state_dict()
        small = min(held["state"], key=lambda k: held["state"][k]["exp_avg"].numel())
        held["state"][small]["exp_avg_sq"].fill_(7.0)  # its holder's now
        train(2)
        fresh = opt.state_dict()
        for k, s in fresh["state"].items():
            assert float(held["state"][k]["step"]) == 5, k
            for n, t in s.items():
                if (k, n) != (small, "exp_avg_sq"):
                    assert torch.equal(torch.as_tensor(held["state"][k][n]),
                                       torch.as_tensor(t)), (k, n)
        assert torch.all(held["state"][small]["exp_avg_sq"] == 7.0)
        del held, fresh, s, t
    gc.collect()
    assert not _views.live()  # a live view would turn later tests' delay off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_cuda_views_kept_across_steps_show_resident_subgroups_whole(dos_socket):
    """A GPU session keeps subgroups resident on the GPU between steps, and
    dosd's host arrays (what views show) then lag: views kept across steps,
    here the moments' alone without their step counts, show each later step
    as the host path's do."""
    if not dos._native.cuda_supported():
        pytest.skip("libdos_client was built without CUDA")
    model = big_model().cuda()
    g = torch.Generator().manual_seed(1)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model, **LR) as opt:
        def train_cuda(n):
            for _ in range(n):
                opt.zero_grad()
                model(torch.randn(16, 1024, generator=g).cuda()).pow(2).mean().backward()
                opt.step()

        train_cuda(3)
        sd = opt.state_dict()
        views = {k: s["exp_avg"] for k, s in sd["state"].items()
                 if s["exp_avg"].data_ptr() in _views._origins}
        assert views  # the large tensors' moments are views of dosd's memory
        del sd
        train_cuda(2)
        opt.synchronize()
        seen = {k: v.clone() for k, v in views.items()}  # before any read asks dosd
        del views
        fresh = opt.state_dict()
        for k, v in seen.items():
            assert float(fresh["state"][k]["step"]) == 5
            assert torch.equal(v, fresh["state"][k]["exp_avg"]), k
        del fresh
    gc.collect()
    assert not _views.live()
