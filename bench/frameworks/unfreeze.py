#!/usr/bin/env python3
"""A rebuild at the scale users bring: a Llama-shaped model trains with its
embeddings frozen, then unfreezes them with optimizer.add_param_group (what
Lightning's BackboneFinetuning and hand-written unfreezing schedules call).
dosd registers a session's tensors once, so the stepped state of every other
parameter (12 bytes each) is carried from the old session to the new one
through the trainer (client/python/dos/_carry.py): in memory where the host
has room for it twice over, else through an unnamed file on disk, else
refused before anything changes.

  unfreeze.py --size 2b|3b|7b --spill auto|always|never --out R.json
      trains 3 steps, unfreezes, trains 2 more; records the add_param_group
      time, where the state went (memory or the spill directory), the
      trainer's peak RssAnon and dosd's peak RSS (sampled every 0.1 s), the
      host's MemAvailable before, and the losses.
  unfreeze.py --size mlp:36 ...: a 0.7B plain-torch stand-in (no transformers),
      for the CPU.
  unfreeze.py --size 7b ...: where neither memory nor the disk has room,
      the refusal: its message, time, and that training goes on unchanged.

Needs DOS_SOCKET (a running dosd) and DOS_DOSD_PID (for its RSS).
"""
import argparse
import contextlib
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf7b import SIZES, GiB, status_kb  # noqa: E402

import dos  # noqa: E402
import dos.torch  # noqa: E402
from dos import _carry  # noqa: E402


class Peaks:
    def __init__(self, dosd_pid):
        self.dosd_pid, self.peak = dosd_pid, {"trainer_rss_anon": 0, "dosd_rss": 0}
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            for k, v in (("trainer_rss_anon", status_kb(os.getpid(), "RssAnon")),
                         ("dosd_rss", status_kb(self.dosd_pid, "VmRSS"))):
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.1)

    def reset(self):
        self.peak = {k: 0 for k in self.peak}


class Stand(torch.nn.Module):
    """A plain-torch stand-in for the CPU (no transformers needed), "mlp:L":
    a frozen 32000 x 4096 embedding and L 4096 x 4096 layers (16.8M
    parameters each), fp32: the memory a rebuild takes, measured where
    there is no GPU (a rebuild's carry is host memory and disk, no PCIe)."""

    def __init__(self, size: str, dev: str):
        super().__init__()
        layers = int(size.split(":", 1)[1])
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(32000, 4096)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4096, 4096, bias=False)
                                          for _ in range(layers))
        self.to(dev)

    def forward(self, input_ids, labels):
        h = self.model.embed_tokens(input_ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        class Out:  # noqa: E306 - the one field the loop reads
            loss = (h.float() ** 2).mean()
        return Out


def llama(a, dev):
    """The Llama-shaped model of hf7b.py's SIZES, bf16 on `dev`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    layers, hidden, inter, heads = SIZES[a.size]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      max_position_embeddings=a.seq)
    torch.set_default_dtype(torch.bfloat16)
    # Built on the device (torch >= 2.0); torch 1.13 builds it on the CPU.
    with torch.device(dev) if hasattr(torch.device, "__enter__") else contextlib.nullcontext():
        model = LlamaForCausalLM(cfg).to(dev)
    torch.set_default_dtype(torch.float32)
    try:  # non-reentrant: frozen embeddings leave the layers' inputs without grad
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model


def stepper(model, opt, seq, dev, losses):
    """One training step on random tokens (seeded), its loss appended to `losses`."""
    gen = torch.Generator().manual_seed(1)

    def step():
        ids = torch.randint(0, 32000, (1, seq), generator=gen).to(dev)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="3b")
    ap.add_argument("--spill", default="auto")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["DOS_SPILL"] = a.spill
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = llama(a, dev) if a.size in SIZES else Stand(a.size, dev)
    emb = model.model.embed_tokens.weight
    emb.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in model.parameters())
    carried = sum(p.numel() for p in params)
    spills = []
    orig = _carry.Carry.__init__

    def noted(self, *args, **kw):
        orig(self, *args, **kw)
        spills.append(self)
    _carry.Carry.__init__ = noted
    peaks = Peaks(int(os.environ["DOS_DOSD_PID"]))
    opt = dos.torch.AdamW(params, lr=1e-5)
    losses = []
    step = stepper(model, opt, a.seq, dev, losses)
    for _ in range(3):
        step()
    opt.synchronize()
    before = dict(peaks.peak)
    peaks.reset()
    avail = _carry.available_memory()
    emb.requires_grad_(True)
    t0 = time.perf_counter()
    refused = None
    try:
        opt.add_param_group({"params": [emb], "lr": 1e-5})
    except dos.DosError as err:
        refused = str(err)
        emb.requires_grad_(False)
    rebuild_s = time.perf_counter() - t0
    during = dict(peaks.peak)
    for _ in range(2):
        step()
    peaks.stop.set()
    c = spills[-1] if spills else None
    out = {
        "machine": os.environ.get("DOS_MACHINE", "unknown"),
        "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("DOS_COMMIT", ""),
        "size": a.size, "params": n_params, "carried_params": carried,
        "carried_bytes": c.nbytes if c else None, "spill": a.spill,
        "spill_dir": c.path if c else None,
        "host_mem_available_before": avail, "rebuild_s": rebuild_s, "refused": refused,
        "param_groups_after": len(opt.param_groups),
        "trainer_rss_anon_peak_steps": before["trainer_rss_anon"],
        "trainer_rss_anon_peak_rebuild": during["trainer_rss_anon"],
        "dosd_rss_peak_rebuild": during["dosd_rss"], "losses": losses,
        "losses_finite": all(x == x and abs(x) < 1e4 for x in losses),
    }
    opt.close()
    print(json.dumps({k: v for k, v in out.items() if k != "losses"}, indent=1))
    print(f"unfreeze {a.size} ({n_params / 1e9:.2f}B, {carried * 12 / 1e9:.1f} GB carried): "
          f"{'refused' if refused else 'rebuilt'} in {rebuild_s:.1f} s via "
          f"{c.path if c and c.path else 'memory'}; trainer RssAnon peak "
          f"{during['trainer_rss_anon'] / GiB:.2f} GiB during the rebuild (the carried state "
          f"is {carried * 12 / GiB:.1f} GiB); host MemAvailable before {avail / GiB:.1f} GiB")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
