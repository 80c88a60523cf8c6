"""torch.optim optimizers whose fp32 state lives in the node's dosd daemon.

    import dos.torch
    opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

How it works: at construction the optimizer attaches a session to dosd,
allocates one shared-memory arena (dos_buffer_alloc) holding every trainable
parameter and its gradient, copies each parameter into it and rebinds
`p.data` and `p.grad` to tensors over that memory. Autograd then accumulates
gradients straight into shared memory, and the daemon writes the updated
weights straight into the model's parameters. `step()` only publishes the
per-group hyperparameters (so lr schedulers work) and waits for the daemon.

Rules that follow from the shared binding:
- `zero_grad()` always zeroes in place (set_to_none is ignored) so the binding
  survives. If something else sets `p.grad` to None or to a new tensor (e.g.
  `model.zero_grad()` in torch 2.x), `step()` copies the new gradient into
  shared memory and rebinds; a registered parameter whose grad is None at
  `step()` is an error (DOS updates every registered tensor each step).
- Do not replace `p.data` after construction (`model.to(...)`, assigning a
  new tensor); in-place writes such as `model.load_state_dict()` are fine, but
  call `opt.load_state_dict()` (or construct the optimizer) afterwards so the
  daemon's master weights follow.
- `close()` (also run by `__del__`) copies parameters and gradients back into
  ordinary memory, then detaches; tensors kept from before that which alias
  the arena become invalid.

CUDA parameters (GPU mode): if every trainable parameter is on one CUDA
device, nothing is copied: the parameters and their gradients are registered
where they are (the client library exports their CUDA allocations by CUDA
IPC) and the daemon updates them in place on that GPU. Gradients are
allocated at construction (`p.grad = torch.zeros_like(p)` where missing) and
must stay where they are: `zero_grad()` zeroes them in place, and a gradient
that autograd or the user replaced is copied back into the registered one at
`step()`. `step()` synchronises the current CUDA stream before ringing the
daemon, and returns once the new weights are in place on the device. The
parameters must be contiguous, and the memory must come from PyTorch's
default CUDA allocator (not `expandable_segments`).

Parameters with requires_grad=False are not registered and never updated.
Threads: like torch optimizers, use one optimizer from one thread at a time.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

from dos import _native
from dos._native import DosError

__all__ = ["AdamW", "Adam", "DosError"]

_DTYPES = {
    torch.float32: _native.DTYPE_F32,
    torch.bfloat16: _native.DTYPE_BF16,
    torch.float16: _native.DTYPE_F16,
}
_ALIGN = 64
_INVALID_ARGUMENT = 3
_FAILED_PRECONDITION = 9
_UNIMPLEMENTED = 12


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Entry:
    """One registered parameter: its shared-memory param and grad views."""

    # param_shm / grad_shm: the registered memory (shared memory in CPU mode,
    # the parameter's own CUDA storage and its gradient in GPU mode).
    __slots__ = ("param", "name", "index", "group", "param_shm", "grad_shm")

    def __init__(self, param, name, index, group):
        self.param = param
        self.name = name
        self.index = index  # registration order, the daemon's tensor index
        self.group = group  # daemon group index
        self.param_shm = None
        self.grad_shm = None


class _DosAdamBase(torch.optim.Optimizer):
    _decoupled = True  # AdamW; Adam (L2) overrides

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, socket: Optional[str] = None, subgroup_size: int = 0,
                 client_name: Optional[str] = None, maximize: bool = False):
        if amsgrad:
            raise NotImplementedError("dos.torch: amsgrad=True is not supported by dosd")
        if maximize:
            raise NotImplementedError("dos.torch: maximize=True is not supported by dosd")
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self._session = None
        self._entries: List[_Entry] = []
        self._arena = None
        self._device = None  # torch.device of the parameters in GPU mode, else None
        self._registering = True
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False)
        super().__init__(params, defaults)
        self._registering = False
        self.found_inf = False
        self.last_step = None  # dict of the daemon's report on the last step
        self._attach(socket, client_name)
        try:
            self._register(subgroup_size)
        except BaseException:
            self.close()
            raise

    # ---- setup ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not getattr(self, "_registering", True):
            raise NotImplementedError(
                "dos.torch: param groups cannot be added after construction (dosd registers a "
                "session's tensors once); pass every group to the constructor")
        super().add_param_group(param_group)

    def _attach(self, socket, client_name):
        opts = _native.AttachOptions()
        _native.lib.dos_attach_options_init(ctypes.byref(opts))
        if socket is not None:
            opts.socket_path = os.fspath(socket).encode()
        opts.client_name = (client_name or os.path.basename(sys.argv[0] or "python")).encode()
        for field, var in (("rank", "RANK"), ("local_rank", "LOCAL_RANK"),
                           ("world_size", "WORLD_SIZE")):
            if os.environ.get(var, "").lstrip("-").isdigit():
                setattr(opts, field, int(os.environ[var]))
        handle = ctypes.c_void_p()
        _native.call("dos_attach", ctypes.byref(opts), ctypes.byref(handle))
        self._session = handle

    def _register(self, subgroup_size):
        # Collect trainable parameters; daemon group indices skip groups that
        # have none.
        entries = []
        group_map = []  # daemon group -> torch group index
        for gi, group in enumerate(self.param_groups):
            dgroup = None
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                label = f"param {len(entries)} (group {gi}, shape {tuple(p.shape)})"
                if p.dtype not in _DTYPES:
                    raise DosError(_INVALID_ARGUMENT,
                                   f"register: {label} has dtype {p.dtype}; dosd supports "
                                   "torch.float32, torch.bfloat16 and torch.float16 parameters")
                if p.device.type not in ("cpu", "cuda"):
                    raise DosError(_UNIMPLEMENTED,
                                   f"register: {label} is on {p.device}; dosd supports CPU "
                                   "(shared-memory) and CUDA parameters")
                if p.is_sparse:
                    raise DosError(_INVALID_ARGUMENT, f"register: {label} is sparse")
                if p.grad is not None and (p.grad.dtype != p.dtype or p.grad.shape != p.shape):
                    raise DosError(_INVALID_ARGUMENT,
                                   f"register: {label} is {p.dtype} {tuple(p.shape)} but its "
                                   f"grad is {p.grad.dtype} {tuple(p.grad.shape)}; gradients "
                                   "must have the parameter's dtype and shape")
                if p.numel() == 0:
                    continue
                if dgroup is None:
                    dgroup = len(group_map)
                    group_map.append(gi)
                entries.append(_Entry(p, label, len(entries), dgroup))
        self._group_map = group_map
        if not entries:
            self._entries = []
            return
        devices = {e.param.device for e in entries}
        if len(devices) > 1:
            raise DosError(_INVALID_ARGUMENT,
                           f"register: parameters are on several devices ({sorted(map(str, devices))})"
                           "; one optimizer (one dosd session) takes parameters of one device: "
                           "build one optimizer per device")
        device = devices.pop()
        if device.type == "cuda":
            self._register_cuda(entries, device, subgroup_size)
            return

        # One arena: param then grad for each tensor, each 64-byte aligned.
        offsets = []
        total = 0
        for e in entries:
            nbytes = e.param.numel() * e.param.element_size()
            offsets.append((total, _align(total + nbytes)))
            total = _align(total + nbytes) + _align(nbytes)
        base = ctypes.c_void_p()
        _native.call("dos_buffer_alloc", self._session, ctypes.c_uint64(total), ctypes.byref(base))
        self._arena = (ctypes.c_ubyte * total).from_address(base.value)

        tensors = (_native.Tensor * len(entries))()
        name_bufs = []
        with torch.no_grad():
            for e, (poff, goff), t in zip(entries, offsets, tensors):
                p = e.param
                n = p.numel()
                e.param_shm = torch.frombuffer(self._arena, dtype=p.dtype, count=n,
                                               offset=poff).view(p.shape)
                e.grad_shm = torch.frombuffer(self._arena, dtype=p.dtype, count=n,
                                              offset=goff).view(p.shape)
                e.param_shm.copy_(p.data)
                if p.grad is not None:
                    e.grad_shm.copy_(p.grad)
                name = e.name.encode()
                name_bufs.append(name)
                t.name = name
                t.param_dtype = t.grad_dtype = _DTYPES[p.dtype]
                t.param = e.param_shm.data_ptr()
                t.grad = e.grad_shm.data_ptr()
                t.numel = n
                t.group = e.group
        groups = self._hparams()
        opts = _native.RegisterOptions(subgroup_size=int(subgroup_size))
        _native.call("dos_register", self._session, tensors, len(entries), groups, len(groups),
                     ctypes.byref(opts))
        # Only now rebind the model: on failure above it is left untouched.
        for e in entries:
            e.param.data = e.param_shm
            e.param.grad = e.grad_shm
        self._entries = entries

    def _register_cuda(self, entries, device, subgroup_size):
        """GPU mode: registers each parameter and its gradient where they are."""
        if not _native.cuda_supported():
            raise DosError(_UNIMPLEMENTED,
                           f"register: the parameters are on {device} but the loaded "
                           "libdos_client was built without CUDA; rebuild it with "
                           "-DDOS_WITH_CUDA=ON (or set DOS_CLIENT_LIB to a CUDA build)")
        tensors = (_native.Tensor * len(entries))()
        name_bufs = []
        with torch.no_grad():
            for e, t in zip(entries, tensors):
                p = e.param
                if not p.is_contiguous():
                    raise DosError(_INVALID_ARGUMENT,
                                   f"register: {e.name} is not contiguous; dosd updates "
                                   "parameters as flat arrays (make it contiguous before "
                                   "building the optimizer)")
                if p.grad is None:
                    p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                elif not p.grad.is_contiguous() or p.grad.device != p.device:
                    p.grad = p.grad.to(device=p.device).contiguous()
                e.param_shm = p.data
                e.grad_shm = p.grad
                name = e.name.encode()
                name_bufs.append(name)
                t.name = name
                t.param_dtype = t.grad_dtype = _DTYPES[p.dtype]
                t.param = p.data_ptr()
                t.grad = p.grad.data_ptr()
                t.numel = p.numel()
                t.group = e.group
            # The daemon reads the initial weights on its own streams.
            torch.cuda.synchronize(device)
        groups = self._hparams()
        opts = _native.RegisterOptions(subgroup_size=int(subgroup_size))
        _native.call("dos_register", self._session, tensors, len(entries), groups, len(groups),
                     ctypes.byref(opts))
        self._device = device
        self._entries = entries

    def _sync_device(self):
        """Makes the trainer's pending work on the device visible to the
        daemon (and the daemon's state writes to later trainer work)."""
        if self._device is not None:
            torch.cuda.current_stream(self._device).synchronize()

    def _hparams(self):
        arr = (_native.Hparams * len(self._group_map))()
        for dg, gi in enumerate(self._group_map):
            g = self.param_groups[gi]
            h = arr[dg]
            h.lr = float(g["lr"])
            h.beta1 = float(g["betas"][0])
            h.beta2 = float(g["betas"][1])
            h.eps = float(g["eps"])
            h.weight_decay = float(g["weight_decay"])
            h.decoupled_weight_decay = 1 if self._decoupled else 0
        return arr

    def _check_open(self, what):
        if self._session is None:
            raise DosError(_FAILED_PRECONDITION, f"{what}: the optimizer is closed")

    # ---- training ----

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Zeroes every gradient in place (set_to_none is ignored for
        registered parameters: their gradients must stay in shared memory)."""
        registered = {id(e.param) for e in self._entries}
        with torch.no_grad():
            for e in self._entries:
                e.grad_shm.zero_()
                if e.param.grad is not e.grad_shm:
                    e.param.grad = e.grad_shm
            for group in self.param_groups:
                for p in group["params"]:
                    if id(p) in registered or p.grad is None:
                        continue
                    if set_to_none is None or set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()

    def _bind_grads(self):
        where = ("the CUDA memory registered with dosd" if self._device is not None
                 else "DOS shared memory")
        with torch.no_grad():
            for e in self._entries:
                p = e.param
                if p.data_ptr() != e.param_shm.data_ptr() or p.dtype != e.param_shm.dtype:
                    raise DosError(
                        _FAILED_PRECONDITION,
                        f"step: {e.name} no longer lives in {where} (its .data was replaced, "
                        f"now {p.dtype} {tuple(p.shape)} on {p.device}); do not move or re-create "
                        "parameters after building the optimizer (copy into them in place)")
                g = p.grad
                if g is None:
                    raise DosError(
                        _FAILED_PRECONDITION,
                        f"step: {e.name} has no gradient (grad is None); DOS updates every "
                        "registered parameter each step: make it take part in the loss, freeze "
                        "it (requires_grad=False) before building the optimizer, or use "
                        "opt.zero_grad() instead of setting grads to None")
                if g.data_ptr() == e.grad_shm.data_ptr() and g.dtype == p.dtype:
                    continue
                if g.dtype != p.dtype or g.shape != p.shape:
                    raise DosError(
                        _INVALID_ARGUMENT,
                        f"step: {e.name} is {p.dtype} {tuple(p.shape)} but its grad is "
                        f"{g.dtype} {tuple(g.shape)}; gradients must have the parameter's "
                        "dtype and shape")
                if g.is_sparse:
                    raise DosError(_INVALID_ARGUMENT, f"step: {e.name} has a sparse gradient")
                e.grad_shm.copy_(g)
                p.grad = e.grad_shm

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, clip_coef: float = 1.0):
        """One Adam(W) step in the daemon. `grad_scale` divides the gradients
        (an AMP loss scale), `clip_coef` then multiplies them. Sets
        `self.found_inf` (non-finite gradients: nothing was applied)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open("step")
        if not self._entries:
            return loss
        self._bind_grads()
        self._sync_device()
        groups = self._hparams()
        args = _native.StepArgs()
        _native.lib.dos_step_args_init(ctypes.byref(args))
        args.groups = groups
        args.num_groups = len(groups)
        args.grad_scale = float(grad_scale)
        args.clip_coef = float(clip_coef)
        res = _native.StepResult()
        _native.call("dos_step", self._session, ctypes.byref(args), ctypes.byref(res))
        self.found_inf = bool(res.found_inf)
        self.last_step = {"found_inf": self.found_inf, "step": int(res.step),
                          "wall_us": float(res.wall_us), "update_us": float(res.update_us)}
        return loss

    def set_policy(self, policy: str) -> None:
        """Scheduling policy of this session: "cpu", "static:<f>",
        "interleave:<k>" or "auto"."""
        self._check_open("set_policy")
        _native.call("dos_set_policy", self._session, policy.encode())

    # ---- state ----

    def _read(self, e: _Entry):
        n = e.param.numel()
        buf = torch.empty(3, n, dtype=torch.float32)
        step = ctypes.c_int64()
        _native.call("dos_state_read", self._session, ctypes.c_uint32(e.index),
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
            shape = e.param.shape
            dev = e.param.device  # torch.optim keeps state beside the param
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
        for g, sg in zip(groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})

    def _write(self, e: _Entry, s: Optional[Dict[str, Any]]):
        p = e.param
        n = p.numel()

        def fp32(t, what):
            t = torch.as_tensor(t).detach()
            if t.numel() != n:
                raise DosError(_INVALID_ARGUMENT,
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
        _native.call("dos_state_write", self._session, ctypes.c_uint32(e.index),
                     master.data_ptr(), m.data_ptr(), v.data_ptr(), ctypes.c_int64(step))

    # ---- teardown ----

    def close(self) -> None:
        """Moves parameters and gradients back to ordinary memory and detaches
        (the daemon frees this session's state). Idempotent."""
        session = getattr(self, "_session", None)
        if session is None:
            return
        with torch.no_grad():
            for e in getattr(self, "_entries", []):
                p = e.param
                if self._device is not None:  # GPU mode: the memory is the model's own
                    e.param_shm = e.grad_shm = None
                    continue
                if p.data_ptr() == e.param_shm.data_ptr():
                    p.data = e.param_shm.clone()
                if p.grad is not None and p.grad.data_ptr() == e.grad_shm.data_ptr():
                    p.grad = e.grad_shm.clone()
                e.param_shm = e.grad_shm = None
        self._session = None
        self._arena = None
        _native.call("dos_detach", session)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown or daemon gone: nothing to do
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AdamW(_DosAdamBase):
    """torch.optim.AdamW (decoupled weight decay) with its state in dosd."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class Adam(_DosAdamBase):
    """torch.optim.Adam (L2 weight decay: g += wd * p) with its state in dosd."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
