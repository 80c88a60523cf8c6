"""`opt.state` of dos.torch's optimizer: torch's per-parameter state
mapping over the state dosd holds (dos/_state.py reads it)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Optional

import torch

from dos._register import is_dtensor

__all__ = ["DaemonState"]


class DaemonState(defaultdict):
    """`opt.state`: torch's per-parameter state mapping, empty (the state
    lives in dosd, and frameworks that iterate it to move or save the state
    find nothing to copy), except that `state[p]` and `state.get(p)` of a
    registered parameter read its state from dosd ({} before its first step,
    as torch's): not kept here (writes into it change nothing), on the
    parameter's device as torch's (the step count stays a CPU scalar, as
    torch keeps it). `state_of(p)` is the optimizer's: the state of a
    registered parameter, None for another key."""

    def __init__(self, state_of: Callable[[Any], Optional[Dict[str, Any]]]):
        super().__init__(dict)
        self._state_of = state_of

    def __missing__(self, key):
        s = self._read(key)
        if s is None:
            return super().__missing__(key)
        return s

    def get(self, key, default=None):
        if key in self:
            return self[key]
        s = self._read(key)
        return default if s is None else s

    def _read(self, key):
        if not isinstance(key, torch.Tensor):
            return None
        s = self._state_of(key)  # {} before the parameter's first step
        if s is None:
            return None
        dev = key.device
        if dev.type != "cpu" and not is_dtensor(key):
            # Copies on the device are not brought up to later steps: the step
            # count is copied too, so that a kept dict is one whole step.
            s = {k: v.clone() if k == "step" else v.to(dev) for k, v in s.items()}
        return s

    def __reduce__(self):  # copies and pickles are plain (torch's own type)
        return (defaultdict, (dict, dict(self)))
