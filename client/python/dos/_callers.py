"""Frameworks' own calls on the optimizer, recognised by the calling frame,
that DOS answers differently from the same call made by a user:

  - torch.distributed.checkpoint's state_dict(): every parameter's state
    (`all_params`), a layout that DCP loads into in place;
  - DCP's `_init_optim_state` (get/set_optimizer_state_dict when torch's
    `opt.state` is empty and every gradient None, as after FSDP2's
    zero_grad(set_to_none=True)): step() with zero gradients and lr 0, to
    make torch's optimizers create their state. dosd holds every
    parameter's state already; run, the step would decay the moments and
    count a step in the live state and in the checkpoint. step() ignores it;
  - accelerate's device placement (`AcceleratedOptimizer.__init__` with
    device_placement=True, which `accelerator.prepare` and the HF Trainer
    use): state_dict(), every tensor moved to the accelerator's device,
    load_state_dict(). DOS's state lives in dosd, on no device, so there is
    nothing to place; done as written, once the optimizer has state (a
    resumed session, a second prepare, a load before prepare) the round trip
    copies the whole state (12 bytes a parameter: 81 GB at 7B) onto the GPU
    and back. state_dict() answers it with the param groups and no state,
    and load_state_dict() takes that answer back as nothing to do.
"""

from __future__ import annotations

__all__ = ["from_dcp", "from_dcp_init", "from_placement"]


def from_dcp(frame) -> bool:
    return frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint")


def from_placement(frame) -> bool:
    return (frame.f_globals.get("__name__") == "accelerate.optimizer"
            and frame.f_code.co_name == "__init__")


def from_dcp_init(frame, depth: int = 8) -> bool:
    """step()'s caller, looked for through the wrappers torch puts around
    step() (no_grad, the profiler's hook): a few frames up at most."""
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "_init_optim_state" and from_dcp(frame):
            return True
        frame, depth = frame.f_back, depth - 1
    return False
