#!/usr/bin/env python3
"""Hugging Face Accelerate with dos.torch.AdamW: prepare, save_state, load_state.

    DOS_SOCKET=/run/dos/dosd.sock python3 accelerate_train.py --workdir /tmp/acc

Build the model on its device first (`accelerator.device`), then the optimizer (it registers the
parameters where they are), then `accelerator.prepare(model, opt)`. `save_state` writes the
model's weights (through `model.state_dict()`, which waits for a step still in flight) and the
optimizer state (`opt.state_dict()`, pulled from dosd); `load_state` loads both back, and the
daemon continues from the loaded state. framework_common.py says what is checked.
"""
import os
import sys

import torch

import dos.torch
from framework_common import compare_saved, cpu_state, parse_args, report


def make_model(device, seed):
    torch.manual_seed(seed)
    layers = []
    for i in range(6):
        layers += [torch.nn.Linear(32 if i == 0 else 96, 96), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(96, 8))
    return torch.nn.Sequential(*layers).to(device)  # 7 Linear layers: 14 tensors


def data(steps):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g))
            for _ in range(steps)]


def train(args, seed, first_step, ckpt_dir=None, resume_from=None):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=args.device.type == "cpu")
    model = make_model(accelerator.device, seed)
    opt = dos.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, socket=args.socket,
                          client_name="accelerate-example", model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2.0 * args.steps))
    model, opt, sched = accelerator.prepare(model, opt, sched)
    if resume_from:
        accelerator.load_state(resume_from)
    losses = {}
    batches = data(args.steps)
    for step in range(first_step, args.steps + 1):
        x, y = (t.to(accelerator.device) for t in batches[step - 1])
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses[step] = loss.item()
        if ckpt_dir and step % args.save_at == 0:
            # Right after step(): the step may still be in flight.
            accelerator.save_state(os.path.join(ckpt_dir, f"step{step}"))
    final = cpu_state(accelerator.unwrap_model(model))
    accelerator.end_training()
    return losses, final


def load_weights(folder):
    path = os.path.join(folder, "model.safetensors")
    if os.path.exists(path):
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu")


def main():
    args = parse_args(__doc__)
    ckpts = os.path.join(args.workdir, "ckpt")
    first, final = train(args, seed=0, first_step=1, ckpt_dir=ckpts)
    equal, problems = compare_saved(load_weights(os.path.join(ckpts, f"step{args.steps}")), final)
    resumed, _ = train(args, seed=1, first_step=args.save_at + 1,
                       resume_from=os.path.join(ckpts, f"step{args.save_at}"))
    return report("accelerate", args, equal, problems, first, resumed)


if __name__ == "__main__":
    sys.exit(main())
