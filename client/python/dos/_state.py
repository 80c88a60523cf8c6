"""Optimizer state I/O: state_dict() and load_state_dict() in
torch.optim.AdamW's format, read from and written to the daemon.

`_StateMixin` is one part of dos.torch's optimizer class.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from typing import Any, Dict, Optional

import torch

from dos._errors import DosError, call
from dos._native import Status
from dos._register import Entry, local_of

__all__ = []


class _StateMixin:
    def _read(self, e: Entry):
        self._finish_inflight()
        n = e.local.numel()
        buf = torch.empty(3, n, dtype=torch.float32)
        step = ctypes.c_int64()
        call("dos_state_read", self._session, ctypes.c_uint32(e.index),
                     buf[0].data_ptr(), buf[1].data_ptr(), buf[2].data_ptr(), ctypes.byref(step))
        return buf, int(step.value)

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's format: state[i] = {'step', 'exp_avg',
        'exp_avg_sq'} (fp32, shaped like the param), plus 'master_param' (fp32)
        for 16-bit params. Pulled from the daemon."""
        self._check_open("state_dict")
        self._sync_device()
        state = defaultdict(dict)
        for e in self._entries:
            buf, step = self._read(e)
            shape = e.local.shape  # a DTensor's local shard: this rank's state
            dev = e.local.device  # torch.optim keeps state beside the param
            s = {"step": torch.tensor(float(step)), "exp_avg": buf[1].view(shape).to(dev),
                 "exp_avg_sq": buf[2].view(shape).to(dev)}
            if e.param.dtype != torch.float32:
                s["master_param"] = buf[0].view(shape).to(dev)
            state[e.param] = s
        saved, self.state = self.state, state
        try:
            return super().state_dict()
        finally:
            self.state = saved

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Accepts this class's or torch.optim.Adam/AdamW's state dicts and
        pushes the state to the daemon. The master weight is 'master_param'
        where present, else the parameter itself."""
        self._check_open("load_state_dict")
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, sg in zip(groups, saved_groups):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
            if sg.get("amsgrad", False):
                raise NotImplementedError("dos.torch: cannot load an amsgrad=True state dict")
        id_map = {}
        for g, sg in zip(groups, saved_groups):
            for old, p in zip(sg["params"], g["params"]):
                id_map[old] = p
        by_param = {id(e.param): e for e in self._entries}
        saved_state = state_dict["state"]
        # The daemon rewrites the weights from the loaded masters: let the
        # trainer's pending work on them finish first.
        self._finish_inflight()
        self._sync_device()
        pushed = set()
        with torch.no_grad():
            for old, s in saved_state.items():
                p = id_map.get(old)
                if p is None:
                    continue
                e = by_param.get(id(p))
                if e is None:
                    continue  # frozen: no state in the daemon
                self._write(e, s)
                pushed.add(id(p))
            for e in self._entries:
                if id(e.param) not in pushed:
                    self._write(e, None)  # torch would start this param afresh
        self._copy_out()
        for g, sg in zip(groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})

    def _write(self, e: Entry, s: Optional[Dict[str, Any]]):
        p = local_of(e.param)
        n = p.numel()

        def fp32(t, what):
            t = local_of(torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t).detach()
            if t.numel() != n:
                raise DosError(Status.INVALID_ARGUMENT,
                               f"load_state_dict: {e.name} has {n} elements but its saved "
                               f"'{what}' has {t.numel()}")
            return t.to(device="cpu", dtype=torch.float32).contiguous().view(-1)

        if s is None:
            master = p.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)
            m = torch.zeros(n, dtype=torch.float32)
            v = torch.zeros(n, dtype=torch.float32)
            step = 0
        else:
            master = fp32(s["master_param"] if "master_param" in s else p, "master_param")
            m = fp32(s["exp_avg"], "exp_avg")
            v = fp32(s["exp_avg_sq"], "exp_avg_sq")
            step = int(float(s.get("step", 0)))
        self._finish_inflight()
        call("dos_state_write", self._session, ctypes.c_uint32(e.index),
                     master.data_ptr(), m.data_ptr(), v.data_ptr(), ctypes.c_int64(step))

