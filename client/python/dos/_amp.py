"""The GradScaler protocol: what torch.cuda.amp.GradScaler (torch.amp in 2.x)
hands an optimizer that sets `_step_supports_amp_scaling`, and what it reads
back. dosd divides the gradients by the loss scale while it reads them and
skips the whole step if any is not finite, so nothing is unscaled in place.

torch 1.x passes the scaler itself to step() as `grad_scaler` and reads
`found_inf_per_device` from its per-optimizer state afterwards; torch 2.x
sets `opt.grad_scale` (a tensor, or None after unscale_) and `opt.found_inf`
(after its own inf check) around step() and deletes them after.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["amp_args", "record_amp"]


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


def record_amp(opt_id: int, grad_scaler, found_inf: bool) -> None:
    """Fills GradScaler's found_inf_per_device from the daemon's verdict
    (torch 1.x protocol, where the scaler did not check itself)."""
    if grad_scaler is None:
        return
    state = grad_scaler._per_optimizer_states[opt_id]
    if state.get("found_inf_per_device"):
        return
    scale = grad_scaler._get_scale_async()
    state["found_inf_per_device"][scale.device] = torch.full(
        (1,), 1.0 if found_inf else 0.0, dtype=torch.float32, device=scale.device)
