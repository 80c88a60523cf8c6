#!/usr/bin/env python3
"""A GPT-style decoder in plain PyTorch, sized from ~100M to 8B parameters by
flags, trained on random tokens (no downloads) with dos.torch.AdamW.

Pre-norm blocks (LayerNorm, causal multi-head attention, 4x GELU MLP),
learned positions, untied output head; bf16 parameters; activation
checkpointing per block (torch.utils.checkpoint). Used by bench/e2e/run.py
and tests/python/test_gpt_loss.py.

    DOS_SOCKET=/run/dos/dosd.sock python3 gpt.py --size 125m --device cuda --steps 20
    python3 gpt.py --size tiny --device cpu --steps 50 --socket /tmp/dosd.sock
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# name: (layers, d_model, heads, seq, vocab). Parameters ~ 12*L*d^2 + 2*V*d.
SIZES = {
    "tiny": (2, 64, 4, 32, 256),        # 0.14M, for CPU tests
    "small": (4, 256, 4, 128, 4096),    # 5M, CPU smoke runs
    "125m": (12, 768, 12, 1024, 32000),
    "350m": (24, 1024, 16, 1024, 32000),
    "1.5b": (28, 2048, 16, 2048, 32000),
    "3b": (32, 2816, 22, 2048, 32000),
    "6b": (28, 4096, 32, 2048, 32000),
    "8b": (38, 4096, 32, 2048, 32000),
}

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def attn(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if _HAS_SDPA and x.is_cuda:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.13 / CPU: the same math spelled out
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            att = att.float().masked_fill(mask, float("-inf")).softmax(-1).to(q.dtype)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers, d_model, heads, seq, vocab, checkpoint=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.checkpoint = checkpoint
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled residual init
            if name.endswith("proj.weight") or name.endswith("out.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        s = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(s, device=idx.device))
        for blk in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = _checkpoint(blk, x)
            else:
                x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _checkpoint(fn, x):
    from torch.utils.checkpoint import checkpoint
    try:
        return checkpoint(fn, x, use_reentrant=False)
    except TypeError:  # very old torch
        return checkpoint(fn, x)


def build(size="tiny", layers=None, d_model=None, heads=None, seq=None, vocab=None,
          dtype=torch.bfloat16, device="cpu", checkpoint=True, seed=0, init_in_dtype=False):
    """The model on `device` in `dtype`, built there (where torch.device is a
    context manager). init_in_dtype: create and initialise the weights in
    `dtype` directly instead of in fp32 and then converting, so that a large
    model never holds its fp32 copy (4 bytes a parameter) on the device; the
    random values differ from the fp32 init's."""
    L, d, h, s, v = SIZES[size]
    L, d, h = layers or L, d_model or d, heads or h
    s, v = seq or s, vocab or v
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    if init_in_dtype:
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if hasattr(torch, "device") and \
                hasattr(torch.device, "__enter__") else _nullctx():
            model = GPT(L, d, h, s, v, checkpoint=checkpoint)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(device=device, dtype=dtype)
    model.cfg = dict(layers=L, d_model=d, heads=h, seq=s, vocab=v)
    return model


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def param_groups(model, weight_decay=0.1):
    """No weight decay on norms, biases and embeddings, as GPT training does."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "tok" not in name and "pos" not in name
         else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def batches(steps, batch, seq, vocab, seed=1, device="cpu"):
    """Random token sequences that count upwards modulo the vocabulary with a
    random start and stride (1..4): the next token follows from the previous
    two, so the loss falls well below log(vocab). Same cost per token as any
    other random tokens."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 5, (batch, 1), generator=g)
        x = (start + stride * torch.arange(seq + 1)) % vocab
        yield x[:, :-1].to(device), x[:, 1:].to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    for k in ("layers", "d-model", "heads", "seq", "vocab"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--clip", type=float, default=1.0, help="0: no gradient clipping")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--socket", default=os.environ.get("DOS_SOCKET"))
    ap.add_argument("--policy", default=None, help="dosd policy: auto, cpu, static:<f>, ...")
    args = ap.parse_args()

    import dos.torch
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build(args.size, args.layers, args.d_model, args.heads, args.seq, args.vocab,
                  dtype=dtype, device=args.device, checkpoint=not args.no_checkpoint)
    n = sum(p.numel() for p in model.parameters())
    cfg = model.cfg
    print(f"GPT {cfg}: {n / 1e6:.1f}M parameters, {dtype}, {args.device}", flush=True)
    opt = dos.torch.AdamW(param_groups(model), lr=args.lr, betas=(0.9, 0.95),
                          socket=args.socket, client_name="gpt-example")
    if args.policy:
        opt.set_policy(args.policy)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(batches(args.steps, args.batch, cfg["seq"], cfg["vocab"],
                                          device=args.device)):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f} "
                  f"({(time.perf_counter() - t0) / (step + 1):.3f} s/it)", flush=True)
    opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
