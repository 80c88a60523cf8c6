#!/usr/bin/env python3
"""The delayed update's staleness alone, in plain torch on the CPU (no dosd): the
convergence benchmark's tiny GPT (bench/convergence/train.py's corpus and batches) trained
with torch.optim.AdamW on fp32 masters, the forward seeing the weights of the step before
for the last FRACTION of the parameters (registration order, as dosd's CPU path takes the
tail) from step 20 on, the others the current ones. Prints FRACTION, the mean loss of the
last 200 steps and the seconds it took. A control for bench/results/convergence_*.json:
what the algorithm costs, apart from DOS.

  /usr/bin/python3 bench/convergence/simulate.py 0 0.15 0.5 1.0   # ~3 min each on 2 cores
"""
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))
sys.path.insert(0, HERE)
import gpt  # noqa: E402
from train import Batches, split_corpus  # noqa: E402

CORPUS = os.environ.get("CORPUS", os.path.join(REPO, ".dist", "corpus", "corpus.txt"))


def run(frac, steps=1500, warmup=20):
    model = gpt.build("tiny", None, None, None, 64, 256, dtype=torch.float32, device="cpu",
                      checkpoint=False, seed=0)
    groups = gpt.param_groups(model, 0.1)
    params = [p for g in groups for p in g["params"]]
    master = [p.detach().clone().requires_grad_(True) for p in params]
    n0 = len(groups[0]["params"])
    opt = torch.optim.AdamW([{"params": master[:n0], "weight_decay": 0.1},
                             {"params": master[n0:], "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95))
    total = sum(p.numel() for p in params)
    delayed, acc = [], 0
    for p in params:
        delayed.append(acc >= (1 - frac) * total)
        acc += p.numel()
    with open(CORPUS, "rb") as f:
        train_text, val_text = split_corpus(f.read())
    data = Batches(torch, train_text, val_text, steps, 8, 64, 1, 5, torch.device("cpu"))
    losses = []
    for t in range(steps):
        x, y = data.step(t)
        for p in params:
            p.grad = None
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for p, m in zip(params, master):
            m.grad = p.grad.clone()
        before = [m.detach().clone() for m in master]
        for g in opt.param_groups:
            g["lr"] = 3e-4 * min(1, (t + 1) / 100)
        opt.step()
        with torch.no_grad():
            for p, m, w, d in zip(params, master, before, delayed):
                p.copy_(w if (d and t >= warmup) else m)
        losses.append(loss.item())
    return sum(losses[-200:]) / 200


if __name__ == "__main__":
    for frac in [float(a) for a in sys.argv[1:]] or [0.0, 1.0]:
        t0 = time.time()
        print(frac, round(run(frac), 4), round(time.time() - t0, 1), flush=True)
