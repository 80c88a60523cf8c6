"""300 steps of the GPT example (tiny size, activation checkpointing, clip
1.0, warm-up schedule, two param groups) with dos.torch.AdamW and with
torch.optim.AdamW from the same seed: the loss must agree at every step.

fp32 parameters: the reference is torch.optim.AdamW on the same parameters.
bf16 parameters: the reference is what DOS computes in the daemon, done by
torch: fp32 master copies updated by torch.optim.AdamW, bf16 weights = the
masters rounded to nearest even (torch.optim.AdamW straight on bf16
parameters keeps bf16 state and is a different algorithm).

Tolerance: |loss_dos - loss_torch| <= 2e-4 + 1e-4 * loss at every step
(fp32), and 1e-2 + 2e-3 * loss (bf16). Seen with torch 1.13 on the CPU:
4.8e-7 (fp32; the loss falls from 5.53 to 0.49) and 3.0e-3 (bf16, at step 245). Why it is rounding: step 1 agrees
exactly or to an ulp; the daemon's fp32 Adam and torch's ATen ops may round
one operation differently (operation order, FMA contraction, torch version),
an ulp of a weight moves the next gradients by about as much, and training
feeds that back; over 300 steps the difference random-walks up to ~1e-5 of
the loss in fp32. In bf16 a master weight near a rounding boundary can round
to the neighbouring bf16 value in one run and not the other (one bf16 ulp is
2^-8 relative), so the bf16 bound is wider; it is still far below what a
skipped step, a wrong lr, a missing weight decay or bias correction would do
(those move the loss by >1e-2 within a few steps; the test checks that a
deliberately wrong lr is caught). The largest difference seen is printed
and written to $DOS_LOSS_REPORT (JSON) when set.
"""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "client", "python",
                                "examples"))
import gpt  # noqa: E402

STEPS = 300
BATCH = 8
LR = 3e-3
TOL = {torch.float32: (2e-4, 1e-4), torch.bfloat16: (1e-2, 2e-3)}


def sched_fn(step):
    return min(1.0, (step + 1) / 20) * max(0.1, 1 - step / STEPS)


class MasterAdamW:
    """torch.optim.AdamW on fp32 masters of 16-bit parameters."""

    def __init__(self, model, **kw):
        self.model = model
        self.pairs = [(p, p.detach().float().clone().requires_grad_()) for p in
                      model.parameters()]
        masters = {id(p): m for p, m in self.pairs}
        groups = [{**g, "params": [masters[id(p)] for p in g["params"]]}
                  for g in gpt.param_groups(model)]
        self.opt = torch.optim.AdamW(groups, **kw)

    def zero_grad(self):
        for p, _ in self.pairs:
            p.grad = None

    def step(self):
        with torch.no_grad():
            for p, m in self.pairs:
                m.grad = p.grad.float()
            self.opt.step()
            for p, m in self.pairs:
                p.copy_(m)  # rounds to nearest even, as the daemon does


def run(model, opt, sched, steps=STEPS):
    cfg = model.cfg
    device = next(model.parameters()).device
    losses = []
    for x, y in gpt.batches(steps, BATCH, cfg["seq"], cfg["vocab"], seed=1, device=device):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def train_pair(dos_socket, dtype, dos_lr=LR, steps=STEPS, device="cpu"):
    ref = gpt.build("tiny", dtype=dtype, seed=0, device=device)
    mine = gpt.build("tiny", dtype=dtype, seed=0, device=device)
    kw = dict(lr=LR, betas=(0.9, 0.95))
    if dtype == torch.float32:
        ref_opt = torch.optim.AdamW(gpt.param_groups(ref), **kw)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, sched_fn)
    else:
        ref_opt = MasterAdamW(ref, **kw)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt.opt, sched_fn)
    ref_losses = run(ref, ref_opt, ref_sched, steps)
    opt = dos.torch.AdamW(gpt.param_groups(mine), socket=dos_socket, client_name="pytest-gpt",
                          **dict(kw, lr=dos_lr))
    try:
        losses = run(mine, opt, torch.optim.lr_scheduler.LambdaLR(opt, sched_fn), steps)
    finally:
        opt.close()
    return losses, ref_losses


def _cuda_ready():
    from dos import _native
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible: the GPU variant is skipped")
    if not _native.cuda_supported():
        pytest.skip("libdos_client was built without CUDA")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_loss_agrees_300_steps(dos_socket, dtype, device):
    if device == "cuda":
        _cuda_ready()
    try:
        losses, ref_losses = train_pair(dos_socket, dtype, device=device)
    except dos.torch.DosError as e:
        if "no GPU engine" in e.message:
            pytest.skip(f"dosd has no GPU engine: {e.message}")
        raise
    atol, rtol = TOL[dtype]
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    worst_step = max(range(STEPS), key=lambda i: abs(losses[i] - ref_losses[i]))
    print(f"\n{dtype} on {device}: largest |loss_dos - loss_torch| over {STEPS} steps = {worst:.3g} "
          f"(step {worst_step}); loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}")
    report = os.environ.get("DOS_LOSS_REPORT")
    if report:
        data = json.load(open(report)) if os.path.exists(report) else {}
        data[f"{dtype} {device}"] = {"steps": STEPS, "max_abs_loss_diff": worst, "at_step": worst_step,
                            "first_loss": ref_losses[0], "last_loss": ref_losses[-1]}
        json.dump(data, open(report, "w"), indent=1)
    assert ref_losses[-1] < ref_losses[0] - 0.3, "the model did not learn: test is vacuous"
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= atol + rtol * abs(b), \
            f"step {i}: loss {a:.6f} (dos) vs {b:.6f} (torch), diff {abs(a - b):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_loss_check_catches_a_wrong_lr(dos_socket, dtype):
    losses, ref_losses = train_pair(dos_socket, dtype, dos_lr=LR * 1.1, steps=60)
    atol, rtol = TOL[dtype]
    assert any(abs(a - b) > atol + rtol * abs(b) for a, b in zip(losses, ref_losses))
