#!/usr/bin/env python3
"""torch.distributed.checkpoint's in-place load at scale: the state dict's
tensors are views of dosd's memory, and each page DCP writes into one became
the trainer's own (8 bytes a parameter for fp32 parameters, 12 for 16-bit;
81 GB at 7B). dos/_dcp.py moves the views onto an unnamed file first where
memory is short (DOS_SPILL=auto; always here, to measure it where memory is
plenty), so the pages are the page cache's.

  dcp_load.py --size mlp:60 --out R.json
      trains 2 steps, saves with dcp.async_save (saved in place, on this
      thread: no staged copy), trains 1 more, then loads the checkpoint into
      opt.state_dict(all_params=True) and load_state_dict()s it twice: with
      DOS_SPILL=never (the old way) and always (the file); records for each
      the trainer's peak RssAnon during the load, its time, and that the
      loaded state equals what was saved (sampled tensors); then a step.

Needs DOS_SOCKET (a running dosd) and DOS_DOSD_PID (for its RSS); torch >= 2.3.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf7b import GiB  # noqa: E402
from unfreeze import Peaks, Stand, llama, stepper  # noqa: E402

import dos.torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402


def flat(sd):
    return {f"optim.{i}.{k}": v for i, s in sd["state"].items() for k, v in s.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="mlp:60")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dir", default=None, help="checkpoint directory (a disk)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = llama(a, dev) if not a.size.startswith("mlp:") else Stand(a.size, dev)
    n_params = sum(p.numel() for p in model.parameters())
    peaks = Peaks(int(os.environ["DOS_DOSD_PID"]))
    opt = dos.torch.AdamW(model.parameters(), lr=1e-5)
    losses = []
    step = stepper(model, opt, a.seq, dev, losses)
    for _ in range(2):
        step()
    ckpt = tempfile.mkdtemp(prefix="dos-dcp-bench-", dir=a.dir or os.getcwd())
    sd = flat(opt.state_dict())
    sample = {k: v.reshape(-1)[:4096].clone() for k, v in list(sd.items())[::7]
              if v.numel() > 4096}
    state_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=ckpt)
    done_at_return = fut.done()
    fut.result()
    save_s = time.perf_counter() - t0
    del sd
    step()
    runs = {}
    for mode in ("never", "always"):
        os.environ["DOS_SPILL"] = mode
        opt.synchronize()
        sd = opt.state_dict(all_params=True)
        peaks.reset()
        t0 = time.perf_counter()
        dcp.load(flat(sd), checkpoint_id=ckpt)
        load_s = time.perf_counter() - t0
        during_load = dict(peaks.peak)
        f = flat(sd)
        same = all(torch.equal(f[k].reshape(-1)[:4096], v) for k, v in sample.items())
        t0 = time.perf_counter()
        opt.load_state_dict(sd)
        push_s = time.perf_counter() - t0
        after = dict(peaks.peak)
        del sd, f
        runs[mode] = {"dcp_load_s": load_s, "load_state_dict_s": push_s,
                      "trainer_rss_anon_peak_load": during_load["trainer_rss_anon"],
                      "trainer_rss_anon_peak_load_and_push": after["trainer_rss_anon"],
                      "dosd_rss_peak": after["dosd_rss"], "loaded_equals_saved": same}
        print(f"{mode}: dcp.load {load_s:.1f} s, load_state_dict {push_s:.1f} s, trainer "
              f"RssAnon peak {after['trainer_rss_anon'] / GiB:.2f} GiB (state in the "
              f"checkpoint {state_bytes / GiB:.1f} GiB), loaded == saved: {same}", flush=True)
    step()
    peaks.stop.set()
    out = {"machine": os.environ.get("DOS_MACHINE", "unknown"), "date": time.strftime("%Y-%m-%d"),
           "commit": os.environ.get("DOS_COMMIT", ""), "size": a.size, "params": n_params,
           "state_bytes_in_checkpoint": state_bytes, "async_save_s": save_s,
           "async_save_done_at_return": done_at_return, "runs": runs, "losses": losses,
           "losses_finite": all(x == x and abs(x) < 1e4 for x in losses)}
    opt.close()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
