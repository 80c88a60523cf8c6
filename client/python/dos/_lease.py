"""The GPU lease (GPU mode): how much of this trainer's GPU budget dosd may
hold for the session's resident tier (dos.h: dos_set_gpu_lease).

dosd keeps as many subgroups' optimizer state on the GPU as the lease allows;
those skip PCIe every step. The lease is what the trainer's budget leaves
after its measured peak:

    lease = budget - peak - headroom

- budget: the optimizer's `gpu_budget_bytes=`, else $DOS_GPU_BUDGET (bytes,
  or with a K/M/G/T suffix, binary), else torch.cuda's per-process memory
  limit (get_per_process_memory_fraction x the device's memory, torch >= 2.9,
  when the fraction is below 1), else what the process could use when it
  first lends: its reserved memory plus the device's free memory
  (torch.cuda.mem_get_info; other processes' memory is not lent). A budget of
  0 lends nothing: dosd's --gpu_memory_budget alone decides, as before leases.
- peak: torch.cuda.max_memory_reserved, what the caching allocator took at
  most, measured at every step() (after backward, before the next forward).
- headroom: max(1 GiB, 5% of the budget), or $DOS_GPU_HEADROOM: room for what
  the allocator takes beyond the peak measured so far (fragmentation, a
  longer batch) and for the CUDA context, which its statistics leave out.

The lease goes with every step. When the peak grows it is lowered at once,
and step() returns only after dosd has copied the state it no longer covers
back to host memory and freed it, so the next forward finds the memory free
(the tier gives memory back before the trainer needs it). It is raised only
by more than max(256 MiB, 1% of the budget), so the tier does not churn.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any, Dict, Optional

import torch

from dos import _native
from dos._errors import call

GiB = 1 << 30
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value, what: str = "DOS_GPU_BUDGET") -> int:
    """80G, 81920M, 85899345920 or an int -> bytes (binary units)."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: {value} is negative; give bytes >= 0")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(value), re.I)
    if not m:
        raise ValueError(f"{what}: cannot read {value!r} as a size; use bytes or a K/M/G/T "
                         "suffix, e.g. 80G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class GpuLease:
    """Computes this trainer's lease on `device` and sends it to dosd when it
    changes (update(), called before each step begins)."""

    def __init__(self, device: torch.device, budget_bytes=None, env=None):
        env = os.environ if env is None else env
        self.device = device
        raw = budget_bytes if budget_bytes is not None else env.get("DOS_GPU_BUDGET")
        self._explicit = None if raw is None else parse_bytes(raw, "gpu_budget_bytes")
        raw = env.get("DOS_GPU_HEADROOM")
        self._headroom = None if raw is None else parse_bytes(raw, "DOS_GPU_HEADROOM")
        self._budget: Optional[int] = None
        self._budget_source = ""
        self._sent: Optional[int] = None
        self._session = None
        self.last: Optional[Dict[str, Any]] = None  # what was computed last (for reports)

    @property
    def enabled(self) -> bool:
        return self._explicit != 0

    def budget(self) -> int:
        if self._budget is None:
            self._budget, self._budget_source = self._resolve_budget()
        return self._budget

    def _resolve_budget(self):
        if self._explicit is not None:
            return self._explicit, "gpu_budget_bytes" if self._explicit else "none"
        free, total = torch.cuda.mem_get_info(self.device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if get_fraction is not None:
            fraction = float(get_fraction(self.device))
            if 0 < fraction < 1:
                return int(fraction * total), "per-process memory fraction"
        return int(torch.cuda.memory_reserved(self.device) + free), "free device memory"

    def compute(self) -> Optional[Dict[str, Any]]:
        """The lease now, or None when lending is off."""
        if not self.enabled:
            return None
        budget = self.budget()
        peak = int(torch.cuda.max_memory_reserved(self.device))
        headroom = self._headroom if self._headroom is not None else max(GiB, budget // 20)
        lease = max(0, budget - peak - headroom)
        return {"lease_bytes": lease, "budget_bytes": budget, "peak_bytes": peak,
                "headroom_bytes": headroom, "budget_source": self._budget_source}

    def update(self, session) -> Optional[int]:
        """Sends the lease to `session` when it changed; returns the lease in
        force (None: lending is off)."""
        now = self.compute()
        if now is None:
            return None
        key = getattr(session, "value", session)  # a ctypes.c_void_p: its address
        if key != self._session:
            self._session, self._sent = key, None  # a new session knows no lease yet
        lease = now["lease_bytes"]
        if self._sent is not None and self._sent < lease < self._sent + max(
                256 << 20, now["budget_bytes"] // 100):
            lease = self._sent  # a small rise is not worth moving state for
        now["lease_bytes"] = lease
        self.last = now
        if lease != self._sent:
            arg = _native.GpuLease(lease, now["budget_bytes"], now["peak_bytes"])
            call("dos_set_gpu_lease", session, ctypes.byref(arg))
            self._sent = lease
        return lease
