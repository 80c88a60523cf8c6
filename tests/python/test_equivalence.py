"""dos.torch.Adam/AdamW against torch.optim.Adam/AdamW: same seed, same data,
fp32 weights equal within 1e-6 relative at every one of 200 steps.

Tolerance: torch.allclose(rtol=1e-6, atol=1e-6 * max|w| of the tensor), i.e.
1e-6 relative to each element and to its tensor's scale. Why the atol: the
daemon's fp32 kernel and torch's ATen ops may round differently by an ulp
(operation order, FMA contraction, torch version: 1.13 uses mul_+add_, 2.x
lerp_), and Adam's update is normalised (about lr per element whatever the
gradient), so an ulp of difference in a weight that passes near zero is
large relative to that weight but not to the tensor. Training feeds those
ulps back through the gradients, so they random-walk over 200 steps; the
bound still fails by orders of magnitude on a skipped, doubled or
mis-parameterised step (one step moves each weight by ~lr = 1e-3).
"""

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402

STEPS = 200
RTOL = 1e-6
ATOL_SCALE = 1e-6  # times the tensor's max |w|


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def make_data(seed=1, n=STEPS):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def groups_of(model, two_groups, hp):
    if not two_groups:
        return model.parameters()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, **hp}]


def assert_same(dos_model, ref_model, step):
    for (name, a), b in zip(dos_model.named_parameters(), ref_model.parameters()):
        atol = ATOL_SCALE * b.abs().max().item()
        if not torch.allclose(a, b, rtol=RTOL, atol=atol):
            diff = (a - b).abs().max().item()
            pytest.fail(f"step {step}: {name} differs by up to {diff:.3g} "
                        f"(rtol {RTOL}, atol {atol:.3g})")


CASES = {
    "adamw": dict(cls="AdamW", kw=dict(lr=1e-3)),
    "adamw_wd": dict(cls="AdamW", kw=dict(lr=2e-3, weight_decay=0.1, betas=(0.8, 0.99))),
    "adamw_groups": dict(cls="AdamW", kw=dict(lr=1e-3, weight_decay=0.05),
                         groups=dict(lr=3e-3, weight_decay=0.0, betas=(0.85, 0.995), eps=1e-6)),
    "adamw_sched": dict(cls="AdamW", kw=dict(lr=3e-3, weight_decay=0.01), sched=True),
    "adam_l2": dict(cls="Adam", kw=dict(lr=1e-3, weight_decay=0.01)),
    "adam_groups_sched": dict(cls="Adam", kw=dict(lr=1e-3),
                              groups=dict(lr=5e-4, weight_decay=0.02), sched=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch(dos_socket, case):
    c = CASES[case]
    data = make_data()
    ref = make_mlp()
    mine = make_mlp()
    two = "groups" in c
    ref_opt = getattr(torch.optim, c["cls"])(groups_of(ref, two, c.get("groups")), **c["kw"])
    opt = getattr(dos.torch, c["cls"])(groups_of(mine, two, c.get("groups")), socket=dos_socket,
                                       client_name=f"pytest-{case}", **c["kw"])
    scheds = []
    if c.get("sched"):
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=50, gamma=0.5)
                  for o in (ref_opt, opt)]
    try:
        assert_same(mine, ref, 0)
        for step, (x, y) in enumerate(data, 1):
            for model, o in ((ref, ref_opt), (mine, opt)):
                o.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                o.step()
            for s in scheds:
                s.step()
            assert not opt.found_inf
            assert_same(mine, ref, step)
        assert opt.last_step["step"] == STEPS
    finally:
        opt.close()
    # After close the model keeps its trained weights in ordinary memory.
    assert_same(mine, ref, STEPS)
