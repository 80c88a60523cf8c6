"""The GradScaler protocol: what torch.cuda.amp.GradScaler (torch.amp in 2.x)
hands an optimizer that sets `_step_supports_amp_scaling`, and what it reads
back. dosd divides the gradients by the loss scale while it reads them and
skips the whole step if any is not finite, so nothing is unscaled in place.

torch 1.x passes the scaler itself to step() as `grad_scaler` and reads
`found_inf_per_device` from its per-optimizer state afterwards; torch 2.x
sets `opt.grad_scale` (a tensor, or None after unscale_) and `opt.found_inf`
(after its own inf check) around step() and deletes them after.

accelerate's AcceleratedOptimizer (the HF Trainer's, Accelerate's) learns
that its GradScaler skipped a step only from step() not being called: while
the scaler steps, it puts over `opt.step` a function that sets its own
`_accelerate_step_called`. DOS's step() is called for a skipped step too (the
scaler hands it the verdict), so a skip is told to that wrapper here; its
`step_was_skipped` is then true and the Trainer does not step its LR
scheduler, as with torch's own optimizers.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["amp_args", "verdict", "record_amp", "tell_skipped"]


def amp_args(opt_id: int, grad_scaler, grad_scale, found_inf) -> Tuple[float, bool]:
    """(loss scale, skip) for the step of optimizer `opt_id`: from the torch
    1.x `grad_scaler`, else from the torch 2.x attributes `grad_scale` and
    `found_inf` (None where unset)."""
    if grad_scaler is not None:  # torch 1.x protocol
        state = grad_scaler._per_optimizer_states[opt_id]
        stage = getattr(state.get("stage"), "name", "READY")
        found = state.get("found_inf_per_device") or {}
        if stage == "UNSCALED":  # the user unscaled (and checked) already
            return 1.0, any(float(v) != 0 for v in found.values())
        return float(grad_scaler._get_scale_async()), False
    skip = False
    if found_inf is not None:
        skip = float(found_inf) != 0
    scale = 1.0 if grad_scale is None else float(grad_scale)
    return scale, skip


def verdict(opt, grad_scaler) -> Tuple[float, bool]:
    """amp_args() for optimizer `opt` (its torch 2.x attributes), a skip told
    to a wrapper that must know (tell_skipped)."""
    scale, skip = amp_args(id(opt), grad_scaler, getattr(opt, "grad_scale", None),
                           opt._parts.amp_found_inf)
    if skip:
        tell_skipped(opt)
    return scale, skip


def record_amp(opt, grad_scaler, found_inf: bool) -> None:
    """Fills GradScaler's found_inf_per_device from the daemon's verdict
    (torch 1.x protocol, where the scaler did not check itself); a skip is
    told to a wrapper that must know (tell_skipped)."""
    if found_inf:
        tell_skipped(opt)
    if grad_scaler is None:
        return
    state = grad_scaler._per_optimizer_states[id(opt)]
    if state.get("found_inf_per_device"):
        return
    scale = grad_scaler._get_scale_async()
    state["found_inf_per_device"][scale.device] = torch.full(
        (1,), 1.0 if found_inf else 0.0, dtype=torch.float32, device=scale.device)


def tell_skipped(opt) -> None:
    """Tells accelerate's AcceleratedOptimizer, if its function is over
    `opt.step` now (found in that function's closure by the flag it sets),
    that this step was skipped."""
    for cell in getattr(opt.__dict__.get("step"), "__closure__", None) or ():
        try:
            wrapper = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(getattr(wrapper, "_accelerate_step_called", None), bool):
            wrapper._accelerate_step_called = False
