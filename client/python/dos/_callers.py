"""Frameworks' own calls on the optimizer, recognised by the calling frame,
that DOS answers differently from the same call made by a user:

  - torch.distributed.checkpoint's state_dict(): every parameter's state
    (`all_params`), a layout that DCP loads into in place;
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

__all__ = ["from_dcp", "from_placement"]


def from_dcp(frame) -> bool:
    return frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint")


def from_placement(frame) -> bool:
    return (frame.f_globals.get("__name__") == "accelerate.optimizer"
            and frame.f_code.co_name == "__init__")
