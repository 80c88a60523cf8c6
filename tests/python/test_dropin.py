"""dos.torch.AdamW used exactly where torch.optim.AdamW would be, one test
per usage pattern of ordinary training code: lr schedulers (and their state
dicts), hyperparameters changed by hand, no-decay groups, add_param_group,
tied weights, parameters without a gradient (unused branches, frozen
mid-training, grads set to None), zero_grad's two modes, the optimizer's
state dict through torch.save/torch.load, `opt.state[p]`, torch's keyword
arguments, and a model converted after the optimizer was built.

Each runs the same model, data and calls with torch.optim.AdamW and compares
weights (and state where the pattern is about state) with the tolerance of
test_equivalence.py (1e-6 relative, plus 1e-6 of the tensor's scale).

The patterns that change what the daemon is asked to do (parameters skipped
for want of a gradient, groups added, the model moved, state dicts) also run
on CUDA (`dev` = "cuda": the parameters and gradients on the GPU, dosd's GPU
engine; skipped with a message where there is none).
"""

import copy
import io

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from test_equivalence import assert_same, make_data  # noqa: E402

F = torch.nn.functional
LRS = torch.optim.lr_scheduler
HP = dict(lr=1e-2, weight_decay=0.1)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device visible: GPU variant skipped"))]


class Net(torch.nn.Module):
    """Linear -> LayerNorm -> two heads; `branch` picks the head, so the
    other head's parameters get no gradient in that step."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)])

    def forward(self, x, branch=0):
        return self.heads[branch](torch.tanh(self.norm(self.body(x))))


def pair(dos_socket, groups=None, dev="cpu", **kw):
    """(torch model, its AdamW), (DOS model, its AdamW), same initial
    weights on `dev`; `groups(model)` gives the param groups (default:
    parameters())."""
    groups = groups or (lambda m: m.parameters())
    hp = {**HP, **kw}
    ref, mine = Net().to(dev), Net().to(dev)
    ref_opt = torch.optim.AdamW(groups(ref), **hp)
    opt = dos.torch.AdamW(groups(mine), socket=dos_socket, **hp)
    return (ref, ref_opt), (mine, opt)


def step_both(runs, x, y, branch=0, zero=None):
    losses = []
    for model, o in runs:
        dev = next(model.parameters()).device
        x, y = x.to(dev), y.to(dev)
        if zero is None:
            o.zero_grad()
        else:
            o.zero_grad(set_to_none=zero)
        loss = F.mse_loss(model(x, branch), y)
        loss.backward()
        o.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    return losses[0]


def assert_state_same(opt, ref_opt, model, ref):
    """Per-parameter state equal to torch's: same keys present (a parameter
    never stepped has none in either), step counts equal, moments within
    tolerance."""
    for p, q in zip(model.parameters(), ref.parameters()):
        r = ref_opt.state.get(q)
        s = opt.state[p]
        if not r:
            assert s == {}
            continue
        assert float(s["step"]) == float(r["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(s[k], r[k], rtol=1e-5, atol=1e-6 * r[k].abs().max() + 1e-30)


def no_decay_groups(model):
    """The usual split: matrices decay, biases and norms do not."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


SCHEDULERS = {
    "lambda": lambda o: LRS.LambdaLR(o, lambda s: 0.97 ** s),
    "cosine": lambda o: LRS.CosineAnnealingLR(o, T_max=15, eta_min=1e-4),
    # OneCycleLR also cycles beta1 (cycle_momentum) through param_groups["betas"].
    "onecycle": lambda o: LRS.OneCycleLR(o, max_lr=0.05, total_steps=40),
    "linear": lambda o: LRS.LinearLR(o, start_factor=0.1, total_iters=10),
    "sequential": lambda o: LRS.SequentialLR(
        o, [LRS.LinearLR(o, 0.1, total_iters=5), LRS.CosineAnnealingLR(o, 20)], milestones=[5]),
    "plateau": lambda o: LRS.ReduceLROnPlateau(o, factor=0.5, patience=1),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_scheduler_and_its_state_dict(dos_socket, name):
    """Every scheduler drives param_groups (lr, betas, initial_lr) the same
    on both; halfway its state dict is saved and loaded into a new scheduler
    (a resumed run), and the optimizer's param groups keep its keys."""
    data = make_data(n=30)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, no_decay_groups)
    make = SCHEDULERS[name]
    scheds = [make(ref_opt), make(opt)]
    with opt:
        for i, (x, y) in enumerate(data, 1):
            loss = step_both([(ref, ref_opt), (mine, opt)], x, y)
            for s in scheds:
                s.step(loss) if name == "plateau" else s.step()
            if i == 15:
                sds = [s.state_dict() for s in scheds]
                scheds = [make(ref_opt), make(opt)]
                for s, sd in zip(scheds, sds):
                    s.load_state_dict(sd)
            for g, rg in zip(opt.param_groups, ref_opt.param_groups):
                assert {k: v for k, v in g.items() if k != "params"} == \
                    {k: v for k, v in rg.items() if k != "params"}
            assert_same(mine, ref, i)
        sd = opt.state_dict()
        assert [g.get("initial_lr") for g in sd["param_groups"]] == \
            [g.get("initial_lr") for g in ref_opt.state_dict()["param_groups"]]


def test_hyperparameters_changed_by_hand(dos_socket):
    """param_groups[i]['lr'] (and betas, eps, weight_decay) set between steps
    (a hand-written warmup) take effect at the next step."""
    data = make_data(n=20)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, no_decay_groups)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            for o in (ref_opt, opt):
                for g in o.param_groups:
                    g["lr"] = 2e-2 * min(1.0, i / 10)
                    g["betas"] = (0.9 - 0.01 * (i % 3), 0.99)
                o.param_groups[1]["weight_decay"] = 0.01 * (i % 2)
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)


@pytest.mark.parametrize("dev", DEVICES)
def test_no_decay_groups(dos_socket, dev):
    data = make_data(n=20)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, no_decay_groups, dev=dev)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


@pytest.mark.parametrize("dev", DEVICES)
def test_add_param_group_after_construction(dos_socket, dev):
    """Unfreezing: the body trains alone for 10 steps, then the heads are
    added as a no-decay group; the body's state carries over."""
    data = make_data(n=25)
    ref, mine = Net().to(dev), Net().to(dev)
    ref_opt = torch.optim.AdamW(ref.body.parameters(), **HP)
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data, 1):
            if i == 11:
                for m, o in ((ref, ref_opt), (mine, opt)):
                    o.add_param_group({"params": list(m.norm.parameters()) +
                                       list(m.heads.parameters()), "weight_decay": 0.0,
                                       "lr": 5e-3})
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 5e-3
        assert_state_same(opt, ref_opt, mine, ref)


@pytest.mark.parametrize("bad", ["amsgrad", "lr", "float64", "repeated"])
def test_a_refused_add_param_group_leaves_the_optimizer_as_it_was(dos_socket, bad):
    """A group dosd refuses (amsgrad, a negative lr, a float64 parameter)
    raises, and the optimizer goes on as it was: one group, the state of the
    steps before it, every later step equal to torch's (it once dropped the
    session: later steps updated nothing and state_dict() failed)."""
    data = make_data(n=12)
    ref, mine = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.body.parameters(), **HP)
    group = {"amsgrad": {"params": list(mine.heads.parameters()), "amsgrad": True},
             "lr": {"params": list(mine.heads.parameters()), "lr": -1.0},
             "float64": {"params": [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]},
             "repeated": {"params": [mine.heads[0].weight, mine.heads[0].weight]}}[bad]
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data, 1):
            if i == 6:
                with pytest.raises((NotImplementedError, ValueError, dos.DosError)):
                    opt.add_param_group(group)
                assert len(opt.param_groups) == 1
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)
        assert float(opt.state_dict()["state"][0]["step"]) == 12


@pytest.mark.parametrize("dev", DEVICES)
def test_weights_written_between_steps_reach_dosd_through_reload_weights(dos_socket, dev):
    """WGAN-style weight clipping after each step: dosd's masters would undo
    the clamp at the next step (the next step started from its own weights);
    reload_weights() takes the clamped values, and the run is torch's."""
    data = [(x.to(dev), y.to(dev)) for x, y in make_data(n=8)]
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            with torch.no_grad():
                for m in (ref, mine):
                    for p in m.body.parameters():
                        p.clamp_(-0.05, 0.05)
            opt.reload_weights(mine.body.parameters() if i % 2 else None)
            assert_same(mine, ref, i)
        with pytest.raises(ValueError, match="does not hold"):
            opt.reload_weights([torch.nn.Parameter(torch.ones(2))])
    # The untouched keep their fp32 masters.
    half, before, after = bf16_write_taken(dos_socket, dev, data[0][0],
                                           lambda half: half.body.weight.zero_(),
                                           lambda opt: opt.reload_weights())
    for p, a, b in zip(half.parameters(), before, after):
        assert torch.equal(b, torch.zeros_like(b) if p is half.body.weight else a)


def bf16_write_taken(dos_socket, dev, x, write, take):
    """A bf16 Net stepped once, then `write(model)` under no_grad and
    `take(opt)`: (model, its masters before the write, its masters after)."""
    half = Net().to(dev).to(torch.bfloat16)
    with dos.torch.AdamW(half.parameters(), socket=dos_socket, **HP) as opt:
        half(x.to(torch.bfloat16)).float().pow(2).sum().backward()
        opt.step()
        masters = lambda: [s["master_param"].clone() for s in opt.state_dict()["state"].values()]
        before = masters()
        with torch.no_grad():
            write(half)
        take(opt)
        return half, before, masters()


@pytest.mark.parametrize("dev", DEVICES)
def test_weights_written_in_place_reach_dosd_at_the_next_step(dos_socket, dev):
    """Without reload_weights(): a model loaded after the optimizer was built
    (the weights a checkpoint or DDP's broadcast writes) and weight clipping
    after each step are taken as dosd's masters by the next step, as torch's
    optimizer starts from them; a bf16 parameter written nowhere keeps its
    fp32 master (compared, not rewritten)."""
    data = [(x.to(dev), y.to(dev)) for x, y in make_data(n=6)]
    loaded = Net(seed=7).to(dev).state_dict()
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for m in (ref, mine):
            m.load_state_dict(loaded)
        for i, (x, y) in enumerate(data, 1):
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            if i > 3:
                with torch.no_grad():
                    for m in (ref, mine):
                        for p in m.body.parameters():
                            p.clamp_(-0.05, 0.05)
            assert_same(mine, ref, i)
    def write(half):
        half.body.weight.zero_()
        half.norm.weight.mul_(1)  # written, the same values
        half.heads[0].weight[0, 0] = 1.0  # one element written

    def step_moving_nothing(opt):
        opt.param_groups[0].update(lr=0.0, weight_decay=0.0)
        opt.step()

    half, before, after = bf16_write_taken(dos_socket, dev, data[0][0], write,
                                           step_moving_nothing)
    head = [p is half.heads[0].weight for p in half.parameters()].index(True)
    before[head].view(-1)[0] = 1.0  # that element's master only
    for p, a, b in zip(half.parameters(), before, after):
        assert torch.equal(b, torch.zeros_like(b) if p is half.body.weight else a)


def test_a_write_before_a_rebuild_survives_it(dos_socket):
    """add_param_group() (a new session, the state carried over) after a
    write in place: the written values are the masters carried over."""
    mine = Net()
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, lr=0.0) as opt:
        x, y = make_data(n=1)[0]
        F.mse_loss(mine(x), y).backward()
        opt.step()
        with torch.no_grad():
            mine.body.weight.fill_(5.0)
        opt.add_param_group({"params": list(mine.heads.parameters())})
        opt.zero_grad()
        F.mse_loss(mine(x), y).backward()
        opt.step()
        assert torch.all(mine.body.weight == 5.0)


def test_a_parameter_listed_twice_is_refused(dos_socket):
    """torch.optim warns and updates it twice; dosd keeps one state per
    parameter (it once registered a new session at every step)."""
    m = torch.nn.Linear(6, 3)
    with pytest.raises(ValueError, match="more than once"):
        dos.torch.AdamW([m.weight, m.bias, m.weight], socket=dos_socket)
    with pytest.raises(ValueError, match="more than once"):
        dos.torch.AdamW([{"params": [m.bias]}, {"params": (p for p in [m.weight, m.weight])}],
                        socket=dos_socket)


@pytest.mark.parametrize("dev", DEVICES)
def test_a_gradient_never_computed_is_none_before_backward_and_after_close(dos_socket, dev):
    """A new model's gradients are None: step() before any backward changes
    nothing and makes no state (it once decayed every weight and counted a
    step), as torch's; close() gives the parameters backward never reached
    their None back."""
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for o in (ref_opt, opt):
            o.step()
        assert_same(mine, ref, 0)
        assert opt.state_dict()["state"] == {}
        x, y = (t.to(dev) for t in make_data(n=1)[0])
        step_both([(ref, ref_opt), (mine, opt)], x, y, branch=0)
        assert_same(mine, ref, 1)
        assert_state_same(opt, ref_opt, mine, ref)
    assert all(p.grad is None for p in mine.heads[1].parameters())
    assert all(p.grad is not None for p in mine.heads[0].parameters())


def test_an_optimizer_built_again_over_the_same_model_trains_as_torch(dos_socket):
    """A notebook cell run again: a second optimizer over the model the first
    still holds. The first's zeroed, untouched buffers of the unused head are
    torch's None to it, not zero gradients (it once decayed that head every
    step)."""
    data = make_data(n=4)
    ref, mine = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    first = dos.torch.AdamW(mine.parameters(), socket=dos_socket, **HP)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **HP) as opt:
        first.close()
        for i, (x, y) in enumerate(data, 1):
            step_both([(ref, ref_opt), (mine, opt)], x, y, branch=0)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


class TinyGPT(torch.nn.Module):
    def __init__(self, seed=0, vocab=11, dim=8):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx):
        return self.lm_head(self.ln(torch.tanh(self.mlp(self.wte(idx)))))


def test_tied_weights(dos_socket):
    """model.parameters() yields the tied Parameter once: one tensor, one
    state; passing it in two groups raises ValueError, as torch does."""
    ref, mine = TinyGPT(), TinyGPT()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    g = torch.Generator().manual_seed(3)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **HP) as opt:
        for i in range(1, 21):
            idx = torch.randint(0, 11, (4, 6), generator=g)
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                F.cross_entropy(model(idx).view(-1, 11), idx.view(-1)).backward()
                o.step()
            assert mine.lm_head.weight is mine.wte.weight
            assert_same(mine, ref, i)
        assert len(opt.state_dict()["state"]) == len(ref_opt.state_dict()["state"])
    twice = TinyGPT()
    groups = [{"params": [twice.wte.weight]}, {"params": [twice.lm_head.weight]}]
    with pytest.raises(ValueError, match="more than one parameter group"):
        torch.optim.AdamW(groups)
    with pytest.raises(ValueError, match="more than one parameter group"):
        dos.torch.AdamW(groups, socket=dos_socket)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("zero", [True, None])
def test_unused_branch_is_skipped(dos_socket, zero, dev):
    """A head not used in a step (grad None in torch after
    zero_grad(set_to_none=True), torch 2.x's default) gets no update, no state
    and no step count, as torch skips it; with torch 1.x's default
    (set_to_none=False) both give it a zero-gradient update instead."""
    data = make_data(n=24)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, no_decay_groups, dev=dev)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            branch = 0 if i <= 8 else i % 2  # head 1 unused for 8 steps, then every other
            step_both([(ref, ref_opt), (mine, opt)], x, y, branch=branch, zero=zero)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)
        if zero or (zero is None and dos.torch._SET_TO_NONE_DEFAULT):
            steps = [float(opt.state[p]["step"]) for p in mine.heads.parameters()]
            assert steps == [16, 16, 8, 8]  # head 0: steps 1-8 and even ones; head 1: odd > 8


@pytest.mark.parametrize("dev", DEVICES)
def test_grads_set_to_none_by_hand_are_skipped(dos_socket, dev):
    """`p.grad = None` (or torch 2.x's model.zero_grad()) for every
    parameter, then a backward that reaches only some: the others are
    skipped, the new gradients are copied in."""
    data = make_data(n=12)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            for model, o in ((ref, ref_opt), (mine, opt)):
                for p in model.parameters():
                    p.grad = None
                F.mse_loss(model(x.to(dev), i % 2), y.to(dev)).backward()
                o.step()
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


@pytest.mark.parametrize("dev", DEVICES)
def test_grad_data_replaced_by_hand(dos_socket, dev):
    """`p.grad.data = x` (older code's idiom; p.grad is the registered
    buffer itself, so it moves with it): x is the gradient of that step, and
    backward's gradients are the later steps' (the buffer once stayed where
    it was: that step and every later one read the gradient before it)."""
    data = make_data(n=8)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                F.mse_loss(model(x.to(dev), 1), y.to(dev)).backward()
                for p, r in zip(model.parameters(), ref.parameters()):
                    if r.grad is None:  # backward did not reach it (torch's None)
                        continue
                    if i == 2:
                        p.grad.data = p.grad.data.clone()
                    elif i == 5:
                        p.grad.data = torch.full_like(p.grad, 0.5)
                o.step()
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


@pytest.mark.parametrize("dev", DEVICES)
def test_requires_grad_toggled_mid_training(dos_socket, dev):
    """The body is frozen for steps 6-12 (torch skips it: no gradient after
    zero_grad(set_to_none=True)), then trains again."""
    data = make_data(n=18)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            for m in (ref, mine):
                m.body.requires_grad_(not 6 <= i <= 12)
            step_both([(ref, ref_opt), (mine, opt)], x, y, zero=True)
            assert_same(mine, ref, i)
        assert float(opt.state[mine.body.weight]["step"]) == 11
        assert_state_same(opt, ref_opt, mine, ref)


@pytest.mark.parametrize("dev", DEVICES)
def test_frozen_at_construction_then_unfrozen(dos_socket, dev):
    """A parameter frozen when the optimizer was built is left alone by both
    while frozen; once unfrozen torch starts updating it, and so does DOS
    (it is registered then, with a warning)."""
    data = make_data(n=12)
    ref, mine = Net().to(dev), Net().to(dev)
    for m in (ref, mine):
        m.body.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data, 1):
            if i == 6:
                for m in (ref, mine):
                    m.body.requires_grad_(True)
            if i == 6:
                with pytest.warns(RuntimeWarning, match="frozen"):
                    step_both([(ref, ref_opt), (mine, opt)], x, y)
            else:
                step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert float(opt.state[mine.body.weight]["step"]) == 7
        assert_state_same(opt, ref_opt, mine, ref)


@pytest.mark.parametrize("dev", DEVICES)
def test_zero_grad_set_to_none_false(dos_socket, dev):
    """set_to_none=False: an unused head has a zero gradient (not None), so
    torch and DOS both apply the zero-gradient update (momentum, decay)."""
    data = make_data(n=16)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for i, (x, y) in enumerate(data, 1):
            step_both([(ref, ref_opt), (mine, opt)], x, y, branch=int(i > 8), zero=False)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("into", ["dos", "torch"])
def test_state_dict_through_torch_save(dos_socket, into, dev):
    """opt.state_dict() through torch.save/torch.load (a checkpoint file),
    loaded into a new DOS optimizer or into torch.optim.AdamW (and torch's
    into DOS), then training continues as if uninterrupted."""
    data = make_data(n=20)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, no_decay_groups, dev=dev)
    sched = LRS.CosineAnnealingLR(opt, 20)
    ref_sched = LRS.CosineAnnealingLR(ref_opt, 20)
    for x, y in data[:10]:
        step_both([(ref, ref_opt), (mine, opt)], x, y)
        sched.step()
        ref_sched.step()
    buf = io.BytesIO()
    torch.save({"model": mine.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = Net(seed=5).to(dev)
    resumed.load_state_dict(ckpt["model"])
    if into == "dos":
        new_opt = dos.torch.AdamW(no_decay_groups(resumed), socket=dos_socket, **HP)
    else:
        new_opt = torch.optim.AdamW(no_decay_groups(resumed), **HP)
    new_opt.load_state_dict(ckpt["opt"])
    new_sched = LRS.CosineAnnealingLR(new_opt, 20)
    new_sched.load_state_dict(ckpt["sched"])
    # The other direction: torch's state dict, saved and loaded, into DOS.
    buf = io.BytesIO()
    torch.save(ref_opt.state_dict(), buf)
    buf.seek(0)
    ref2 = Net(seed=6).to(dev)
    ref2.load_state_dict(ref.state_dict())
    dos2 = dos.torch.AdamW(no_decay_groups(ref2), socket=dos_socket, **HP)
    dos2.load_state_dict(torch.load(buf))
    sched2 = LRS.CosineAnnealingLR(dos2, 20)
    sched2.load_state_dict(ref_sched.state_dict())
    try:
        for i, (x, y) in enumerate(data[10:], 11):
            step_both([(ref, ref_opt), (resumed, new_opt), (ref2, dos2)], x, y)
            for s in (ref_sched, new_sched, sched2):
                s.step()
            assert_same(resumed, ref, i)
            assert_same(ref2, ref, i)
        assert_state_same(dos2, ref_opt, ref2, ref)
    finally:
        dos2.close()
        if into == "dos":
            new_opt.close()


@pytest.mark.parametrize("dev", DEVICES)
def test_opt_state_access(dos_socket, dev):
    """opt.state[p]['step' | 'exp_avg' | 'exp_avg_sq'] and opt.state.get(p)
    read dosd's state; iterating opt.state yields nothing. A parameter never
    updated (heads[1], unused) has no state, as in torch."""
    data = make_data(n=5)
    (ref, ref_opt), (mine, opt) = pair(dos_socket, dev=dev)
    with opt:
        for x, y in data:
            step_both([(ref, ref_opt), (mine, opt)], x, y)
        assert opt.state[mine.heads[1].weight] == {}
        assert not ref_opt.state.get(ref.heads[1].weight)
        for p, q in zip(mine.parameters(), ref.parameters()):
            if p is mine.heads[1].weight or p is mine.heads[1].bias:
                continue
            s, r = opt.state[p], ref_opt.state[q]
            assert set(s) == set(r) == {"step", "exp_avg", "exp_avg_sq"}
            assert float(s["step"]) == float(r["step"]) == 5
            assert opt.state.get(p)["exp_avg"].shape == p.shape
            assert torch.allclose(s["exp_avg_sq"], r["exp_avg_sq"], rtol=1e-5,
                                  atol=1e-6 * r["exp_avg_sq"].abs().max())
        assert opt.state.get(torch.zeros(1)) is None
        assert len(opt.state) == 0


def test_torch_keyword_arguments(dos_socket):
    """foreach=, fused=, capturable= (implementation choices) are accepted
    and kept in param_groups; maximize=True and differentiable=True raise
    NotImplementedError, also when set in a param group later."""
    model = Net()
    for kw in (dict(foreach=True), dict(foreach=False), dict(fused=None), dict(fused=True),
               dict(capturable=False), dict(capturable=True), dict(differentiable=False)):
        with dos.torch.AdamW(model.parameters(), socket=dos_socket, **kw) as opt:
            for k, v in kw.items():  # None/False: only where torch's AdamW has the key
                if k in opt.param_groups[0] or v not in (None, False):
                    assert opt.param_groups[0][k] == v
    for kw in (dict(maximize=True), dict(differentiable=True), dict(amsgrad=True)):
        with pytest.raises(NotImplementedError):
            dos.torch.AdamW(model.parameters(), socket=dos_socket, **kw)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket) as opt:
        opt.param_groups[0]["maximize"] = True
        F.mse_loss(model(torch.randn(2, 16)), torch.zeros(2, 4)).backward()
        with pytest.raises(NotImplementedError, match="maximize"):
            opt.step()


def test_model_converted_after_construction(dos_socket):
    """model.to(torch.bfloat16) after the optimizer was built: the next step
    re-registers (with a warning), keeping the fp32 master and moments and
    the step count; the bf16 weights are the master rounded."""
    data = make_data(n=8)
    mine = Net()
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **HP) as opt:
        for x, y in data[:4]:
            opt.zero_grad()
            F.mse_loss(mine(x), y).backward()
            opt.step()
        before = opt.state_dict()
        mine.to(torch.bfloat16)
        for i, (x, y) in enumerate(data[4:]):
            opt.zero_grad()
            F.mse_loss(mine(x.bfloat16()).float(), y).backward()
            if i == 0:
                with pytest.warns(RuntimeWarning, match="re-registering"):
                    opt.step()
                mid = copy.deepcopy(opt.state_dict())  # kept as it is now, as with torch
            else:
                opt.step()
        sd = opt.state_dict()
    for k, s in sd["state"].items():
        unused = float(before["state"][k]["step"]) == 0  # heads[1]: never reached
        assert float(s["step"]) == (0 if unused else 8)
        assert float(mid["state"][k]["step"]) == (0 if unused else 5)
    for (k, s), p in zip(before["state"].items(), mine.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), sd["state"][k]["master_param"].to(torch.bfloat16))
        assert s["exp_avg"].shape == p.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible: test skipped")
def test_model_moved_to_cuda_after_construction(dos_socket):
    """The optimizer built over a CPU model that is then moved with
    model.cuda() (as scripts do after loading a checkpoint): the next step
    re-registers on the GPU with a warning, keeping master, moments and step
    counts, and training goes on as torch's does (its state moved to the
    parameters' device by load_state_dict). opt.state[p] is on the GPU."""
    data = make_data(n=12)
    ref, mine = Net(), Net()
    ref_opt = torch.optim.AdamW(no_decay_groups(ref), **HP)
    with dos.torch.AdamW(no_decay_groups(mine), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data[:5], 1):
            step_both([(ref, ref_opt), (mine, opt)], x, y, branch=int(i == 3))
            assert_same(mine, ref, i)
        for m in (ref, mine):
            m.cuda()
        ref_opt.load_state_dict(ref_opt.state_dict())
        for i, (x, y) in enumerate(data[5:], 6):
            if i == 6:
                with pytest.warns(RuntimeWarning, match="re-registering"):
                    step_both([(ref, ref_opt), (mine, opt)], x, y)
            else:
                step_both([(ref, ref_opt), (mine, opt)], x, y, branch=int(i == 9))
            assert_same(mine, ref, i)
        assert all(p.is_cuda for p in mine.parameters())
        assert opt.state[mine.body.weight]["exp_avg"].is_cuda
        assert_state_same(opt, ref_opt, mine, ref)


def test_pickling_or_copying_the_optimizer_is_refused(dos_socket):
    """The state is in dosd: a pickled or copied optimizer was a closed one
    without it, silently (torch.save(opt) then load lost the state)."""
    import copy
    import pickle
    (_, _), (mine, opt) = pair(dos_socket)
    with opt:
        for what in (copy.deepcopy, copy.copy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
            with pytest.raises(TypeError, match="cannot be pickled or copied.*state_dict"):
                what(opt)
        assert opt.state_dict()["param_groups"]  # the optimizer itself goes on
