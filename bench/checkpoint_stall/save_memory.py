"""dosd's host memory while it saves a checkpoint during training.

A trainer (dos.torch.AdamW over --params bf16 parameters in tensors of
--tensor elements, 4096 x 4096 by default as a Llama's, on the GPU when there
is one) steps with random gradients; after --warmup steps
`dosctl checkpoint save` saves its session while it keeps stepping. A
sampler reads dosd's resident memory (/proc: RssAnon + RssShmem) every 20 ms.
Printed and written to bench/results/checkpoint_memory_<machine>_<date>.json:
the state's bytes, dosd's memory before the save, its peak during it and
after it, the save's write time, and the steps' times before and during it.
The limit it is judged against: a save that kept a copy of the state (the
design before 2026-12-06) peaks at the state twice; this one at the state
plus --checkpoint_staging_limit at most.

    DOS_DOSD=... DOS_DOSCTL=... DOS_CLIENT_LIB=... PYTHONPATH=client/python \\
      /usr/bin/python3 bench/checkpoint_stall/save_memory.py --params 1e9
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from run import start_dosd, stop_dosd  # noqa: E402  (bench/e2e/run.py)


def resident(pid):
    kib = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                kib += int(line.split()[1])
    return kib << 10


class Sampler(threading.Thread):
    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, False

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, resident(self.pid))
            time.sleep(0.02)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--tensor", type=int, default=4096 * 4096)
    ap.add_argument("--subgroup", type=int, default=100_000_000)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--staging-limit", default="auto", help="dosd --checkpoint_staging_limit")
    ap.add_argument("--compact", action="store_true", help="compact_state=True")
    ap.add_argument("--machine", default=os.environ.get("DOS_MACHINE", platform.node()))
    ap.add_argument("--out", default="")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    n = int(args.params)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    tmp = args.workdir or tempfile.mkdtemp(prefix="dos-savemem-")
    os.makedirs(tmp, exist_ok=True)
    ckpt = os.path.join(tmp, "ckpt")
    proc, sock = start_dosd(os.environ["DOS_DOSD"],
                            [f"--checkpoint_dir={ckpt}",
                             f"--checkpoint_staging_limit={args.staging_limit}"], tmp)
    try:
        torch.manual_seed(0)
        sizes = [args.tensor] * (n // args.tensor) + ([n % args.tensor] if n % args.tensor else [])
        ps = [torch.nn.Parameter(torch.randn(k, dtype=torch.bfloat16, device=dev))
              for k in sizes]
        import dos.torch
        opt = dos.torch.AdamW(ps, lr=1e-4, socket=sock, subgroup_size=args.subgroup,
                              compact_state=args.compact, client_name="save_memory")
        grads = [[torch.randn(k, dtype=torch.bfloat16, device=dev) * 1e-3 for k in sizes]
                 for _ in range(2)]

        def step(i):
            t = time.perf_counter()
            for p, g in zip(ps, grads[i % 2]):
                p.grad = g
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t

        before_steps = [step(i) for i in range(args.warmup)]
        base = resident(proc.pid)
        sampler = Sampler(proc.pid)
        sampler.start()
        save = subprocess.Popen([os.environ["DOS_DOSCTL"], f"--socket={sock}", "--json",
                                 "checkpoint", "save", str(opt.session_id)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        during = []
        while save.poll() is None:
            during.append(step(len(during)))
        out = save.stdout.read()
        sampler.stop = True
        sampler.join()
        after = resident(proc.pid)
        if save.returncode != 0:
            raise SystemExit(f"dosctl checkpoint save failed ({save.returncode}): {out}")
        opt.close()
    finally:
        stop_dosd(proc)
    state = n * (8 if args.compact else 12)
    try:
        saved = json.loads(out)
    except ValueError:
        saved = {"dosctl_output": out}
    r = {
        "machine": args.machine, "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("DOS_COMMIT", ""), "device": str(dev), "params": n,
        "tensor_numel": args.tensor, "compact_state": args.compact,
        "staging_limit": args.staging_limit,
        "state_bytes": state, "dosd_resident_before_save": base,
        "dosd_resident_peak_during_save": sampler.peak, "dosd_resident_after_save": after,
        "peak_over_before": sampler.peak - base,
        "limit_a_kept_copy_would_reach": base + state,
        "save": saved,
        "step_s_before_median": sorted(before_steps)[len(before_steps) // 2],
        "step_s_during_save": during,
    }
    print(json.dumps({k: v for k, v in r.items() if k != "save"}, indent=1))
    print(f"dosd peak during the save: {sampler.peak / 2**30:.2f} GiB, before it "
          f"{base / 2**30:.2f} GiB (state {state / 2**30:.2f} GiB; a kept copy would reach "
          f"{(base + state) / 2**30:.2f} GiB); {len(during)} steps during the save, "
          f"longest {max(during, default=0):.3f} s against {r['step_s_before_median']:.3f} s")
    out_path = args.out or os.path.join(
        HERE, "..", "results", f"checkpoint_memory_{args.machine}_{r['date']}.json")
    with open(out_path, "w") as f:
        json.dump(r, f, indent=1)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
