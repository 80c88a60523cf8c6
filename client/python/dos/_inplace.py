"""torch's in-place clip beside a delayed step's captures (protocols 9, 10).

With delay=1 and early steps (overlap=True), dosd copies each delayed
subgroup's gradients into host memory during backward, as soon as they are
final. torch.nn.utils.clip_grad_norm_ (what the Hugging Face Trainer, through
accelerate, and Lightning call) then multiplies them in place before step(),
and dosd had to copy them all again after the verdict: at 6B about 7 GB over
PCIe on the step's critical path.

On by default on CUDA (DOS_TORCH_CLIP_SCALED=stream, below; =0 turns it
off), opt-in on the CPU (DOS_TORCH_CLIP_SCALED=1 in the trainer's
environment): while an optimizer here has such a step in flight, torch's
function is wrapped
(`install`; anything else goes straight to torch's own):

  1. dosd's captures stop, and the multiply waits until the copy dosd had
     begun, if any, is complete (on CUDA the current stream waits; the CPU
     thread goes on); never for dosd to reach the step (protocol 10);
  2. torch's own clip_grad_norm_ runs, unchanged;
  3. when it multiplied every gradient the step marked ready exactly once
     (their version counters say so; nothing else wrote them), fp32 or
     bf16, by torch's coefficient min(1, max_norm / (norm + 1e-6))
     (recomputed the same way, and checked on samples of the first and last
     gradient), the verdict tells dosd that coefficient (`Scaled`): dosd
     multiplies what it copied by it when it updates, in fp32 and rounded to
     the gradient's dtype, the same bits as the trainer's multiply.

Anything else (a clip over some of the parameters, a second write, fp16
gradients, a coefficient the samples disagree with) is a rewrite as before:
the verdict has dosd copy the gradients again. The result is exact either
way; only where the copies happen changes.

Why opt-in: on 2026-12-04 step 1's wait was for dosd to reach this step's
captures, which dosd does only once the last step's delayed update is over.
At 6B (nvidia-h200) the kept copies shortened dosd's apply from 132-167 to
122-131 ms, but the clip then waited for the whole delayed update: 0.725
s/iter against 0.379 all-GPU (the copied-again path ran 0.47-0.50 s/iter in
the same session). Protocol 10's handshake waits only for a copy in flight:
measured the same day, 6B fp32 0.435 s/iter against 0.432 copying again, and
the HF Trainer's 7B compact job 1.17x and 1.26x all-GPU against 1.158x and
1.18x (dosd's apply shorter, the trainer's backward longer, likely because
`float(coef_t)` and the sample checks below synchronise with the GPU; not
measured). Still opt-in.

DOS_TORCH_CLIP_SCALED=stream (protocol 11; the default where the steps are
ordered on a CUDA stream since 2026-12-05): on CUDA the coefficient and the
sample checks stay
on the device (`_coef_on_device`, NaN for "not a scale"), and the verdict has
the trainer's stream copy it into the control block before its event, which
dosd reads after the event: the trainer never waits for its GPU here. Where
the session cannot (no stream memory operations) the verdict says rewritten.
Measured on nvidia-h100 on 2026-12-05 (bench/README.md, thirty-second
session), the HF Trainer's 7B compact job with delay=1: 0.334 s/iter against
0.371 copying again, all-GPU 0.318 on the same machine (1.05x against 1.17x);
bit for bit torch's AdamW one step late in test_delay.py on CUDA.

Either way, a clip whose norm (of order > 0, over every gradient the step
reads) was finite proves the gradients finite: the verdict says
kStepGradientsChecked and dosd skips its scan for non-finite ones (on the
device a norm that was not finite is sent as NaN, and dosd scans).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
import weakref
from typing import Dict, List

import torch

__all__ = ["install", "watch", "Scaled"]

_SAMPLES = 64  # elements of the first and last gradient checked against c
# Gradients dosd scales as torch does (fp32 math, bf16 rounded to nearest
# even: the kernels' grad_coef); an fp16 one is copied again.
_DTYPES = (torch.float32, torch.bfloat16)
_drivers: "weakref.WeakSet" = weakref.WeakSet()
_torch_clip = None  # torch's own clip_grad_norm_, once wrapped


class Scaled:
    """A clip the verdict may report as a scale: the coefficient, each
    ready entry's gradient version right after it, and whether a coefficient
    dosd receives proves every gradient of the norm finite (a norm of order
    > 0 that was finite: NaN or inf anywhere makes it NaN or inf; on the
    device a norm that was not is sent as NaN), which spares dosd's scan for
    non-finite gradients (kStepGradientsChecked)."""

    def __init__(self, coef, versions: Dict[int, int], proves_finite: bool):
        self.coef = coef
        self.versions = versions
        self.proves_finite = proves_finite


def clip_mode(stream) -> str:
    """DOS_TORCH_CLIP_SCALED; unset: stream where the driver's steps are
    ordered on a CUDA stream (`stream`, the driver's), else 0."""
    mode = os.environ.get("DOS_TORCH_CLIP_SCALED")
    if mode is None:
        return "stream" if stream is not None else "0"
    return mode


def watch(driver) -> None:
    """Routes torch.nn.utils.clip_grad_norm_ calls through `driver`
    (dos/_early.py's VerdictDriver of a delayed optimizer) while it lives."""
    mode = clip_mode(driver.stream())
    if mode not in ("1", "stream"):
        if mode not in ("", "0"):
            warnings.warn(f"DOS_TORCH_CLIP_SCALED={mode!r} is not 0, 1 or stream: torch's "
                          "in-place clip has dosd copy the gradients again (as with 0); set "
                          "1 or stream to have it scale them", RuntimeWarning, stacklevel=3)
        return
    install()
    _drivers.add(driver)


def install() -> None:
    """Wraps torch.nn.utils.clip_grad_norm_ (once per process)."""
    global _torch_clip
    if _torch_clip is not None:
        return
    import torch.nn.utils.clip_grad as clip_grad
    _torch_clip = clip_grad.clip_grad_norm_

    @functools.wraps(_torch_clip)
    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for driver in list(_drivers):
            entries = driver.scalable(params)
            if entries is not None:
                return _clip_scaled(driver, entries, params, max_norm, args, kwargs)
        return _torch_clip(params, max_norm, *args, **kwargs)

    clip_grad.clip_grad_norm_ = clip_grad_norm_
    if torch.nn.utils.clip_grad_norm_ is _torch_clip:
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


def _clip_scaled(driver, entries: List, params, max_norm, args, kwargs):
    """torch's clip over `params` after dosd's captures stopped; leaves the
    driver a Scaled when the multiply is one dosd can repeat."""
    grads = [e.grad_shm for e in entries]
    before = _samples(grads)
    versions = [g._version for g in grads]
    if not driver.stop_captures():
        return _torch_clip(params, max_norm, *args, **kwargs)
    total = _torch_clip(params, max_norm, *args, **kwargs)
    if any(g._version != v + 1 for g, v in zip(grads, versions)):
        return total  # not one multiply each: the verdict says rewritten
    positive_order = _norm_type(args, kwargs) > 0  # order 0 counts non-zeros
    with torch.no_grad():
        coef_t = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if coef_t.dtype not in _DTYPES:
            return total
        after = _samples(grads)
        if coef_t.is_cuda and driver.on_stream():
            coef = _coef_on_device(coef_t, total, before, after)
            proves_finite = positive_order
        else:
            coef = float(coef_t)  # waits for the clip (as opt.clip_grad_norm_ does)
            if not math.isfinite(coef) or not all(
                    torch.equal(b * coef_t.to(b.device), a) for b, a in zip(before, after)):
                return total
            proves_finite = positive_order and math.isfinite(float(total))
    versions = {e.index: g._version for e, g in zip(entries, grads)}
    driver.note_scaled(Scaled(coef, versions, proves_finite))
    return total


def _norm_type(args, kwargs) -> float:
    """clip_grad_norm_'s norm_type (its third argument; 2 by default)."""
    try:
        return float(args[0] if args else kwargs.get("norm_type", 2.0))
    except (TypeError, ValueError):
        return 0.0  # torch raises for it; no proof of anything


def _coef_on_device(coef_t, total, before, after) -> torch.Tensor:
    """The coefficient as a one-element fp32 tensor on its device, NaN where
    it or the norm `total` is not finite (an inf norm makes it 0) or a
    sample disagrees: dosd reads it through the stream (protocol 11), and
    the trainer never waits for its GPU."""
    ok = torch.isfinite(coef_t) & torch.isfinite(total).to(coef_t.device)
    for b, a in zip(before, after):
        ok = ok & torch.eq(b * coef_t.to(b.device), a).all().to(coef_t.device)
    nan = torch.full((), float("nan"), dtype=torch.float32, device=coef_t.device)
    return torch.where(ok, coef_t.float(), nan).reshape(1)


def _samples(grads: List[torch.Tensor]) -> List[torch.Tensor]:
    picked = [grads[0]] if len(grads) == 1 else [grads[0], grads[-1]]
    return [g.detach().reshape(-1)[:_SAMPLES].clone() for g in picked]


def scalable(entries: List, params) -> bool:
    """Whether a clip of `params` may be reported as a scale of `entries`
    (a driver's ready entries): each one's gradient is in its registered
    buffer, fp32 or bf16, among `params`, and unwritten since its ready
    mark."""
    ids = {id(p) for p in params}
    for e in entries:
        g = e.param.grad
        if (id(e.param) not in ids or e.copy_grad or g is not e.grad_shm
                or g.dtype not in _DTYPES or g._version != e.ready_version):
            return False
    return bool(entries)
