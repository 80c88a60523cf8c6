#!/usr/bin/env python3
"""PyTorch Lightning with dos.torch.AdamW: configure_optimizers, ModelCheckpoint, resume.

    DOS_SOCKET=/run/dos/dosd.sock python3 lightning_train.py --workdir /tmp/pl

`configure_optimizers` builds the DOS optimizer (Lightning calls it after moving the module to its
device, so the parameters are registered where they train) and returns it with a per-step
scheduler. Lightning's automatic optimization calls `optimizer.zero_grad()` inside its closure,
before the first backward, and wraps the optimizer in a LightningOptimizer whose class derives
from the optimizer's. ModelCheckpoint saves at every epoch's end (an epoch is --save-at steps, so
a resumed run starts at an epoch boundary) through `state_dict()`s that wait for a step in flight;
`trainer.fit(ckpt_path=...)` resumes. framework_common.py says what is checked.
"""
import os
import sys

import torch

import dos.torch
from framework_common import compare_saved, cpu_state, parse_args, report

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl


class Regressor(pl.LightningModule):
    def __init__(self, socket, total_steps, seed):
        super().__init__()
        torch.manual_seed(seed)
        layers = []
        for i in range(4):
            layers += [torch.nn.Linear(32 if i == 0 else 96, 96), torch.nn.Tanh()]
        layers.append(torch.nn.Linear(96, 8))
        self.net = torch.nn.Sequential(*layers)
        self.socket, self.total_steps = socket, total_steps
        self.losses = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step + 1] = float(loss.detach())
        return loss

    def configure_optimizers(self):
        opt = dos.torch.AdamW(self.parameters(), lr=3e-3, weight_decay=0.05, socket=self.socket,
                              client_name="lightning-example", model=self)
        n = float(self.total_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2.0 * n))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(steps_per_epoch):
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(steps_per_epoch * 16, 32, generator=g), torch.randn(steps_per_epoch * 16, 8,
                                                                             generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16,
                                       shuffle=False)


def fit(args, seed, ckpt_dir, ckpt_path=None):
    module = Regressor(args.socket, args.steps, seed)
    trainer = pl.Trainer(max_epochs=args.steps // args.save_at,
                         accelerator="gpu" if args.device.type == "cuda" else "cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, gradient_clip_val=1.0,
                         callbacks=[pl.callbacks.ModelCheckpoint(
                             dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1,
                             filename="{epoch}-{step}")])
    trainer.fit(module, loader(args.save_at), ckpt_path=ckpt_path)
    # After fit() Lightning's teardown has moved the module to the CPU; reading the optimizer's
    # state on the way (optimizers_to_device) finished the last step first.
    return module.losses, cpu_state(module)


def main():
    args = parse_args(__doc__)
    ckpts = os.path.join(args.workdir, "ckpt")
    first, final = fit(args, seed=0, ckpt_dir=ckpts)
    epochs = args.steps // args.save_at
    last = os.path.join(ckpts, f"epoch={epochs - 1}-step={args.steps}.ckpt")
    mid = os.path.join(ckpts, f"epoch=0-step={args.save_at}.ckpt")
    saved = torch.load(last, map_location="cpu", weights_only=False)["state_dict"]
    equal, problems = compare_saved(saved, final)
    resumed, _ = fit(args, seed=1, ckpt_dir=os.path.join(args.workdir, "ckpt-resumed"),
                     ckpt_path=mid)
    return report("lightning", args, equal, problems, first, resumed)


if __name__ == "__main__":
    sys.exit(main())
