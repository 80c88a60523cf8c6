"""Lightning's gradient_clip_val with dos.torch.AdamW (issue 22): norm and
value clipping with precision "32", "bf16-mixed" and "16-mixed" (CUDA) train
exactly as torch.optim.AdamW does under the same Trainer. Lightning refused
this before ("does not allow for gradient clipping because it performs
unscaling of gradients internally"). Skips where Lightning is not installed
(CI; the GPU machine has it)."""

import os

import pytest

torch = pytest.importorskip("torch")
pl = None
for name in ("lightning.pytorch", "pytorch_lightning"):
    try:
        pl = __import__(name, fromlist=["Trainer"])
        break
    except ImportError:
        continue
if pl is None:
    pytest.skip("Lightning is not installed", allow_module_level=True)
import dos.torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get(
    "DOS_FRAMEWORK_DEVICE", "auto") != "cpu" else "cpu"
PRECISIONS = ["32", "bf16-mixed"] + (["16-mixed"] if DEVICE == "cuda" else [])


class Net(pl.LightningModule):
    def __init__(self, make_opt):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 8))
        self.make_opt = make_opt

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g) * 4, torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def fit(make_opt, precision, algorithm, clip):
    model = Net(make_opt)
    trainer = pl.Trainer(max_steps=6, accelerator="gpu" if DEVICE == "cuda" else "cpu",
                         devices=1, precision=precision, gradient_clip_val=clip,
                         gradient_clip_algorithm=algorithm, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, data())
    params = [p.detach().float().cpu().clone() for p in model.parameters()]
    opt = trainer.optimizers[0]
    if hasattr(opt, "close"):
        opt.close()
    return params


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("algorithm,clip", [("norm", 0.05), ("value", 0.002)])
def test_lightning_clipping_matches_torch(dos_socket, precision, algorithm, clip):
    kw = dict(lr=1e-2, weight_decay=0.01)
    ref = fit(lambda ps: torch.optim.AdamW(ps, **kw), precision, algorithm, clip)
    got = fit(lambda ps: dos.torch.AdamW(ps, socket=dos_socket, **kw), precision, algorithm,
              clip)
    unclipped = fit(lambda ps: torch.optim.AdamW(ps, **kw), precision, algorithm, 0.0)
    assert any(not torch.equal(a, b) for a, b in zip(ref, unclipped)), "clipping had no effect"
    for a, b in zip(ref, got):
        # Lightning clips the gradients itself; what differs is the Adam
        # arithmetic's rounding (dosd's kernel against torch's foreach).
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
