"""What the framework examples (hf_trainer.py, accelerate_train.py, lightning_train.py) share:
the command line, the device choice, the checks they report, and the result file.

Each example trains a small model with dos.torch.AdamW under its framework, saves checkpoints at
step K and at the last step N, then
- compares the checkpoint written at step N with the model's final weights, bit for bit
  (`saved_equals_final`: what a framework saves must be what was trained), and
- resumes a fresh model and optimizer from the step-K checkpoint and trains to N: the losses of
  steps K+1..N must equal the first run's (`resume_max_loss_diff`).
"""
import argparse
import json
import os

import torch


def parse_args(doc, steps=12, save_at=6):
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--socket", default=os.environ.get("DOS_SOCKET"),
                    help="dosd's socket (default: $DOS_SOCKET, else /run/dos/dosd.sock)")
    ap.add_argument("--device", default="auto",
                    help="auto (cuda when there is a GPU and libdos_client has CUDA), cpu, cuda")
    ap.add_argument("--steps", type=int, default=steps, help="N: optimizer steps in all")
    ap.add_argument("--save-at", type=int, default=save_at, help="K: the mid-run checkpoint")
    ap.add_argument("--workdir", required=True, help="folder for checkpoints")
    ap.add_argument("--result", help="write the result as JSON here")
    args = ap.parse_args()
    if args.steps % args.save_at:
        ap.error("--steps must be a multiple of --save-at (checkpoints every K steps)")
    args.device = pick_device(args.device)
    return args


def pick_device(name):
    if name == "auto":
        from dos import _native
        name = "cuda" if torch.cuda.is_available() and _native.cuda_supported() else "cpu"
    return torch.device(name)


def cpu_state(module):
    """The module's state_dict as CPU copies."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def compare_saved(saved, final, prefix=""):
    """(equal, problems): `saved` (a checkpoint's tensors, names with `prefix` removed) against
    `final` (the trained weights), bit for bit, every saved tensor present in the model."""
    problems = []
    names = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in saved.items()}
    for name, t in names.items():
        if name not in final:
            problems.append(f"{name}: saved but not in the model")
        elif t.dtype != final[name].dtype or t.shape != final[name].shape:
            problems.append(f"{name}: saved {t.dtype} {tuple(t.shape)}, model "
                            f"{final[name].dtype} {tuple(final[name].shape)}")
        elif not torch.equal(t.cpu(), final[name]):
            problems.append(f"{name}: differs by {(t.cpu().float() - final[name].float()).abs().max():.3g}")
    if not names:
        problems.append("the checkpoint holds no tensors")
    return not problems, problems


def resume_diff(first, resumed):
    """Largest |loss difference| over the steps both runs have (dicts step -> loss)."""
    common = sorted(set(first) & set(resumed))
    if not common:
        return float("inf")
    return max(abs(first[s] - resumed[s]) for s in common)


def report(framework, args, saved_equal, problems, first, resumed, extra=None):
    """Prints the outcome and writes it to --result; returns the exit status."""
    diff = resume_diff(first, resumed)
    expected = set(range(args.save_at + 1, args.steps + 1))
    missing = sorted(expected - set(resumed))
    result = {"framework": framework, "device": str(args.device), "torch": torch.__version__,
              "steps": args.steps, "save_at": args.save_at,
              "saved_equals_final": 1 if saved_equal else 0, "saved_problems": problems[:10],
              "resume_max_loss_diff": diff, "resumed_steps_missing": missing,
              "losses": {str(k): v for k, v in sorted(first.items())},
              "resumed_losses": {str(k): v for k, v in sorted(resumed.items())}}
    result.update(extra or {})
    print(f"{framework}: saved_equals_final={result['saved_equals_final']} "
          f"resume_max_loss_diff={diff:.3g} on {args.device}")
    for p in problems[:10]:
        print(f"  saved checkpoint: {p}")
    if missing:
        print(f"  resumed run has no loss for steps {missing}")
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if saved_equal and diff == 0 and not missing else 1
