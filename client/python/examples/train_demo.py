#!/usr/bin/env python3
"""Trains a small GPT-style model with the DOS optimizer, then checks it against torch.optim.AdamW.

The optimizer state (fp32 master weights, exp_avg, exp_avg_sq) lives in the dosd daemon; this
process only holds the model. The task is synthetic and needs no download: each sequence counts
upwards modulo the vocabulary with a random stride, so the next token is predictable from the
previous two and the loss falls quickly.

    DOS_SOCKET=/run/dos/dosd.sock python3 train_demo.py --steps 200
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn

import dos.torch
from gpt import batches  # the same counting-sequence task, beside this file


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=64, layers=2, heads=4, seq=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]])
        return self.head(self.norm(h))


def param_groups(model, weight_decay):
    """No weight decay on norms, biases and embeddings-of-position, as real training does."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def train(model, opt, sched, args, device):
    losses = []
    start = time.perf_counter()
    data = batches(args.steps, args.batch, 32, 64, seed=args.seed, device=device)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.4f}", flush=True)
    return losses, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--socket", default=os.environ.get("DOS_SOCKET"))
    ap.add_argument("--device", default="auto",
                    help="auto (cuda when there is a GPU and libdos_client has CUDA, else cpu), "
                         "cpu (shared memory with the daemon) or cuda (the GPU path)")
    ap.add_argument("--no-compare", action="store_true", help="skip the torch.optim.AdamW run")
    args = ap.parse_args()
    if args.device == "auto":
        from dos import _native
        args.device = "cuda" if torch.cuda.is_available() and _native.cuda_supported() else "cpu"
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = TinyGPT().to(device)
    reference = copy.deepcopy(model)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"DOS demo: TinyGPT with {nparams} parameters on {device}, torch {torch.__version__}")

    # model=: step() returns at once and each layer of the next forward waits
    # for just its own subgroups (on the GPU stream in GPU mode).
    opt = dos.torch.AdamW(param_groups(model, 0.1), lr=args.lr, socket=args.socket,
                          client_name="train_demo", model=model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    print("training with dos.torch.AdamW (optimizer state in dosd):")
    losses, dos_s = train(model, opt, sched, args, device)
    dosctl = os.environ.get("DOSCTL")
    if dosctl:
        print("dosctl sessions (while the demo is attached):")
        subprocess.run([dosctl, f"--socket={args.socket}", "sessions"], check=False)
    opt.close()

    if args.no_compare:
        return 0
    ref_opt = torch.optim.AdamW(param_groups(reference, 0.1), lr=args.lr)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, args.steps)
    print("same model, data and seed with torch.optim.AdamW:")
    ref_losses, ref_s = train(reference, ref_opt, ref_sched, args, device)
    max_loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    max_w_diff = max((a - b).abs().max().item()
                     for a, b in zip(model.parameters(), reference.parameters()))
    summary = {"steps": args.steps, "final_loss_dos": losses[-1], "final_loss_torch": ref_losses[-1],
               "max_loss_diff": max_loss_diff, "max_weight_diff": max_w_diff,
               "dos_seconds": round(dos_s, 3), "torch_seconds": round(ref_s, 3)}
    print(json.dumps(summary, indent=2))
    # fp32 rounding differences (torch 1.13 fuses one multiply-add in its exp_avg update that DOS
    # rounds separately) are amplified by training; the losses must still agree closely.
    ok = losses[-1] < losses[0] * 0.5 and max_loss_diff < 1e-3
    print("DEMO OK" if ok else "DEMO FAILED: loss did not fall or DOS's losses left AdamW's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
