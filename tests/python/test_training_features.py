"""What real training needs from dos.torch beyond plain steps:
clip_grad_norm_, AMP GradScaler (both torch protocols) and grad_scale,
parameters whose storage moved (re-registered with a warning), and
overlap=True (post-accumulate-grad hooks, torch >= 2.1).

Tolerances as in test_equivalence.py. Loss scales are powers of two, so
dividing a scaled fp32 gradient by the scale gives back the unscaled
gradient exactly (the runs with and without a scale agree to the same
tolerance as without)."""


import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from test_equivalence import assert_same, make_data, make_mlp  # noqa: E402

LR = dict(lr=2e-3, weight_decay=0.05)
HAS_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _recording_checked(monkeypatch):
    """The gradients_checked flag of every step request dos.torch builds."""
    import dos._drivers as drivers
    seen, real = [], drivers.step_args

    def record(groups, grad_scale, clip_coef, gradients_checked=False, skip=()):
        seen.append(bool(gradients_checked))
        return real(groups, grad_scale, clip_coef, gradients_checked, skip)
    monkeypatch.setattr(drivers, "step_args", record)
    return seen


@pytest.mark.parametrize("clip", ["torch", "dos"])
def test_clip_grad_norm(dos_socket, monkeypatch, clip):
    """torch's clip_grad_norm_ in place, or opt.clip_grad_norm_ (the
    coefficient goes to dosd with the step): torch's clipped AdamW step.
    opt.clip_grad_norm_'s finite norm also proves every gradient finite: the
    step tells dosd so (kStepGradientsChecked, no second pass over the
    gradients); after an in-place clip dosd scans them itself."""
    seen = _recording_checked(monkeypatch)
    data = make_data(n=30)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR) as opt:
        for step, (x, y) in enumerate(data, 1):
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                (loss_of(model, x, y) * 10).backward()
                if o is opt and clip == "dos":
                    norm = opt.clip_grad_norm_(0.1)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                assert norm > 0.1  # clipping is active
                o.step()
            assert not opt.found_inf
            assert_same(mine, ref, step)
    assert len(seen) == len(data) and set(seen) == {clip == "dos"}


@pytest.mark.parametrize("norm_type", [2.0, 0.0])
def test_a_gradient_written_after_the_clip_is_scanned_again(dos_socket, monkeypatch, norm_type):
    """A NaN written in place after the clip (a version counter moved), or a
    norm that proves nothing (order 0 counts non-zeros): dosd scans the
    gradients itself and skips the step."""
    seen = _recording_checked(monkeypatch)
    model = make_mlp()
    x, y = make_data(n=1)[0]
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, x, y).backward()
        opt.clip_grad_norm_(1.0, norm_type=norm_type)
        if norm_type == 2.0:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        else:
            assert not opt._parts.clip.checked(opt.param_groups)
            next(model.parameters()).grad.data.view(-1)[0] = float("nan")  # no version moves
        opt.step()
        assert opt.found_inf
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b)
    assert seen == [False]


def test_grad_scale_argument(dos_socket):
    """step(grad_scale=S): the daemon unscales while reading (no pass over
    the gradients in the trainer)."""
    data = make_data(n=40)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR) as opt:
        for step, (x, y) in enumerate(data, 1):
            ref_opt.zero_grad()
            loss_of(ref, x, y).backward()
            ref_opt.step()
            opt.zero_grad()
            (loss_of(mine, x, y) * 4096.0).backward()
            opt.step(grad_scale=4096.0)
            assert not opt.found_inf
            assert_same(mine, ref, step)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_overflow_skips_step(dos_socket, dtype):
    """16-bit gradients scaled past their range become inf: the daemon skips
    the step, as GradScaler would; a sane scale then trains."""
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(8, 32) * 0.2).to(dtype))
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    huge = 2.0 ** 20
    with dos.torch.AdamW([w], socket=dos_socket, lr=1e-2) as opt:
        before = w.detach().clone()
        opt.zero_grad()
        (torch.nn.functional.mse_loss(x @ w.float().t(), y) * huge).backward()
        if dtype == torch.bfloat16:  # fp32's range: no realistic scale overflows it
            w.grad.view(-1)[3] = float("inf")
        assert not torch.isfinite(w.grad.float()).all()
        opt.step(grad_scale=huge)
        assert opt.found_inf and torch.equal(w.detach(), before)
        opt.zero_grad()
        (torch.nn.functional.mse_loss(x @ w.float().t(), y) * 256.0).backward()
        opt.step(grad_scale=256.0)
        assert not opt.found_inf and not torch.equal(w.detach(), before)


def cpu_grad_scaler(init_scale):
    """A real GradScaler that runs on the CPU (torch >= 2.3), or None."""
    amp = getattr(torch, "amp", None)
    cls = getattr(amp, "GradScaler", None) if amp is not None else None
    if cls is None:
        return None
    try:
        return cls("cpu", init_scale=init_scale, growth_interval=3)
    except Exception:
        return None


@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_scaler_cpu(dos_socket, unscale_first):
    if cpu_grad_scaler(1.0) is None:
        pytest.skip(f"torch {torch.__version__} has no CPU GradScaler (torch.amp.GradScaler "
                    "('cpu') needs torch >= 2.3); the torch 1.x protocol is tested below")
    data = make_data(n=40)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    opt = dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR)
    scalers = [cpu_grad_scaler(2.0 ** 10), cpu_grad_scaler(2.0 ** 10)]
    try:
        for step, (x, y) in enumerate(data, 1):
            for model, o, sc in ((ref, ref_opt, scalers[0]), (mine, opt, scalers[1])):
                o.zero_grad()
                sc.scale(loss_of(model, x, y)).backward()
                if unscale_first:
                    sc.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                sc.step(o)
                sc.update()
            assert float(scalers[0].get_scale()) == float(scalers[1].get_scale())
            assert_same(mine, ref, step)
        # An overflow: both skip the step and back off the scale.
        x, y = data[0]
        for model, o, sc in ((ref, ref_opt, scalers[0]), (mine, opt, scalers[1])):
            o.zero_grad()
            sc.scale(loss_of(model, x, y)).backward()
            next(model.parameters()).grad.view(-1)[0] = float("inf")
            sc.step(o)
            sc.update()
        assert opt.found_inf
        assert float(scalers[0].get_scale()) == float(scalers[1].get_scale())
        assert_same(mine, ref, len(data) + 1)
    finally:
        opt.close()


def test_grad_scaler_torch1_protocol(dos_socket):
    """torch 1.x GradScaler calls step(grad_scaler=self) on optimizers with
    _step_supports_amp_scaling; the scaler (CUDA-only there) is stood in for
    by an object with the attributes that protocol reads."""
    from collections import defaultdict

    class Stage:
        def __init__(self, name):
            self.name = name

    class Scaler:
        def __init__(self, scale):
            self.scale = torch.tensor([scale])
            self._per_optimizer_states = defaultdict(
                lambda: {"stage": Stage("READY"), "found_inf_per_device": {}})

        def _get_scale_async(self):
            return self.scale

    data = make_data(n=20)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR) as opt:
        assert opt._step_supports_amp_scaling
        for step, (x, y) in enumerate(data, 1):
            ref_opt.zero_grad()
            loss_of(ref, x, y).backward()
            ref_opt.step()
            sc = Scaler(512.0)
            opt.zero_grad()
            (loss_of(mine, x, y) * 512.0).backward()
            opt.step(grad_scaler=sc)
            found = sc._per_optimizer_states[id(opt)]["found_inf_per_device"]
            assert [float(v) for v in found.values()] == [0.0]
            assert_same(mine, ref, step)


def test_moved_storage_is_reregistered(dos_socket):
    data = make_data(n=30)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR) as opt:
        for step, (x, y) in enumerate(data, 1):
            if step == 10:  # same values, new storage: the state carries over
                mine[0].weight.data = mine[0].weight.data.clone()
            if step == 20:  # new values: they become the master weights
                for m in (ref, mine):
                    m[2].bias.data = torch.full_like(m[2].bias.data, 0.25)
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                loss_of(model, x, y).backward()
                if step in (10, 20) and o is opt:
                    with pytest.warns(RuntimeWarning, match="re-registering"):
                        o.step()
                else:
                    o.step()
            assert_same(mine, ref, step)
        sd = opt.state_dict()
        assert float(sd["state"][0]["step"]) == 30


@pytest.mark.skipif(not HAS_HOOK, reason=f"overlap=True needs torch >= 2.1 "
                    f"(register_post_accumulate_grad_hook); torch {torch.__version__}")
def test_overlap_begins_at_last_gradient(dos_socket):
    data = make_data(n=40)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, overlap=True, **LR) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 10, 0.5)
        for step, (x, y) in enumerate(data, 1):
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                loss_of(model, x, y).backward()
                if o is opt:
                    assert opt._inflight  # begun by the first hook, before step()
                o.step()
            sched.step()
            ref_sched.step()
            assert opt.last_step["overlapped"]
            assert sorted(i for i, _ in opt.ready_log) == list(range(4))
            assert_same(mine, ref, step)
        # overlap=True waits for step()'s verdict: a clip coefficient is applied.
        opt.zero_grad()
        loss_of(mine, *data[0]).backward()
        opt.step(clip_coef=0.5)
        assert opt.last_step["early"]
    # overlap="update" updates during backward: a clip coefficient at step()
    # comes too late and is refused loudly.
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, overlap="update", **LR) as opt:
        opt.zero_grad()
        loss_of(mine, *data[0]).backward()
        with pytest.raises(dos.DosError, match="too late"):
            opt.step(clip_coef=0.5)


@pytest.mark.skipif(HAS_HOOK, reason="torch has register_post_accumulate_grad_hook")
def test_overlap_falls_back_on_old_torch(dos_socket):
    model = make_mlp()
    with pytest.warns(UserWarning, match="torch >= 2.1"):
        opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, overlap=True)
    with opt:
        loss_of(model, *make_data(n=1)[0]).backward()
        assert not opt._inflight
        opt.step()
        assert not opt.last_step["overlapped"]


def test_grad_scaler_torch2_protocol(dos_socket):
    """torch 2.x GradScaler, for optimizers with _step_supports_amp_scaling
    and no grad_scaler parameter: checks inf itself, then sets
    `opt.grad_scale = scale * getattr(opt, "grad_scale", 1)` (None after
    unscale_) and `opt.found_inf`, calls step(), deletes both. Replayed here
    so that the protocol is tested with any torch."""
    import inspect
    data = make_data(n=20)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR) as opt:
        assert "grad_scaler" not in inspect.signature(opt.step).parameters
        for step, (x, y) in enumerate(data, 1):
            ref_opt.zero_grad()
            loss_of(ref, x, y).backward()
            ref_opt.step()
            opt.zero_grad()
            (loss_of(mine, x, y) * 256.0).backward()
            opt.grad_scale = torch.tensor(256.0) * getattr(opt, "grad_scale", 1)
            opt.found_inf = torch.tensor(0.0)
            opt.step()
            del opt.grad_scale
            del opt.found_inf
            assert opt.found_inf is False and getattr(opt, "grad_scale", None) is None
            assert_same(mine, ref, step)
        # The scaler's own check found an inf: the step is skipped.
        before = [p.detach().clone() for p in mine.parameters()]
        opt.grad_scale = torch.tensor(256.0)
        opt.found_inf = torch.tensor(1.0)
        opt.step()
        del opt.grad_scale
        del opt.found_inf
        assert opt.found_inf
        assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), before))


def test_zero_grad_drops_the_clip_of_the_gradients_it_zeroes(dos_socket):
    """opt.clip_grad_norm_() then zero_grad(): torch's clip scaled gradients
    that are now gone, so the next step is unclipped (the coefficient once
    stayed for it)."""
    data = make_data(n=3)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR) as opt:
        for step, (x, y) in enumerate(data, 1):
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                loss_of(model, x, y).backward()
                if step == 2:  # a clip of a batch given up
                    clip = o.clip_grad_norm_ if o is opt else \
                        lambda n: torch.nn.utils.clip_grad_norm_(model.parameters(), n)
                    clip(1e-3)
                    o.zero_grad()
                    loss_of(model, x, y).backward()
                o.step()
            assert_same(mine, ref, step)
