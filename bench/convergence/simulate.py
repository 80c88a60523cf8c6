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
from reference import TorchReference  # noqa: E402
from train import Batches, split_corpus  # noqa: E402

CORPUS = os.environ.get("CORPUS", os.path.join(REPO, ".dist", "corpus", "corpus.txt"))


def run(frac, steps=1500, warmup=20):
    model = gpt.build("tiny", None, None, None, 64, 256, dtype=torch.float32, device="cpu",
                      checkpoint=False, seed=0)
    opt = TorchReference(torch, gpt.param_groups(model, 0.1), 3e-4, (0.9, 0.95),
                         1 if frac > 0 else 0, warmup, frac)
    with open(CORPUS, "rb") as f:
        train_text, val_text = split_corpus(f.read())
    data = Batches(torch, train_text, val_text, steps, 8, 64, 1, 5, torch.device("cpu"))
    losses = []
    for t in range(steps):
        x, y = data.step(t)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(opt.params, 1.0)
        for g in opt.param_groups:
            g["lr"] = 3e-4 * min(1, (t + 1) / 100)
        opt.step()
        losses.append(loss.item())
    return sum(losses[-200:]) / 200


if __name__ == "__main__":
    for frac in [float(a) for a in sys.argv[1:]] or [0.0, 1.0]:
        t0 = time.time()
        print(frac, round(run(frac), 4), round(time.time() - t0, 1), flush=True)
