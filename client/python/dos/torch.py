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
`step()`. The parameters must be contiguous, and the memory must come from
PyTorch's default CUDA allocator (not `expandable_segments`).

Asynchronous steps (GPU mode, by default): `step()` never blocks the
trainer's CPU thread. It records an interprocess CUDA event on the current
stream (dosd's streams wait for it on the GPU before reading a gradient),
rings the daemon and returns; the current stream then waits, on the GPU, until
the daemon has written every subgroup's new weights (cuStreamWaitValue32 on
the control block), so whatever is queued next (zero_grad, the next forward)
sees them. With `model=` (the module whose forward uses the parameters) the
stream waits per layer instead: a forward pre-hook on each module with
registered parameters waits for just the subgroups holding them, so the next
forward starts while later layers are still being updated (`zero_grad()`
then defers each gradient's zeroing to its layer's wait, and each
parameter's gradient hook waits too, so backward never writes a gradient
the daemon still reads). On the CPU (shared memory), `model=` gives the same
per-layer waits on the host. The daemon's result (found_inf, errors) is
collected at the next `step()`, or when `found_inf`, `last_step` or the
state is read; `async_step=False` restores a `step()` that returns after the
update. FSDP2 (DTensor) parameters always step synchronously.

Crash survival: `opt.session_info()` gives the session id and token (keep
them private to the job); a restarted trainer builds its optimizer with
`resume=info` within dosd's --session_lease, and the daemon rewrites the new
process's weights from its fp32 masters, so training continues exactly.

Several ranks (DDP, FSDP2): each rank's optimizer attaches its own session
to the node's one dosd, tagged with its rank/local_rank/world_size (arguments,
else torch.distributed when initialised, else $RANK/$LOCAL_RANK/$WORLD_SIZE).
DDP: build the optimizer after wrapping the model; DDP copies the reduced
gradients into p.grad in place (keep gradient_as_bucket_view=False, the
default). FSDP2 (`fully_shard`): parameters are DTensors; each rank registers
its local shard (`to_local()`). On CUDA the shard is registered in place and
the sharded gradient is copied into a registered buffer at `step()`; on the
CPU both go through shared memory and the new weights are copied back into
the shard after the step.

AMP: `GradScaler` works. The class sets `_step_supports_amp_scaling`, so
`scaler.step(opt)` hands the loss scale to the daemon, which divides the
gradients by it while it reads them and skips the whole step if any is not
finite (nothing is unscaled in place on the trainer's side; 16-bit fp16
gradients are fine). If `scaler.unscale_(opt)` was called first (for
clipping), the gradients are already unscaled and the scaler's own inf check
decides. `found_inf_per_device` is filled for `scaler.update()`. Without a
scaler, `step(grad_scale=S, clip_coef=c)` does the same by hand.

A parameter whose storage moved (its `.data` replaced by a tensor of the same
dtype, shape and device) is re-registered with a warning at the next `step()`:
a new session is attached, the fp32 state (master, exp_avg, exp_avg_sq, step)
carried over, and the master taken from the new tensor where its values
differ from the old weights.

overlap=True (torch >= 2.1): post-accumulate-grad hooks mark each registered
tensor ready when its gradient is final; when the last one is, the step is
begun right away (during the tail of backward) with the current
hyperparameters and `step()` only waits. Use it only when nothing global must
be applied between backward and step (no clipping, no GradScaler, one
backward per step; set `opt.overlap_armed = False` around gradient
accumulation micro-steps). The ready order and times of the last step are in
`opt.ready_log`; bench/e2e/README.md describes what the daemon would need to
start per subgroup (a ready bitmap in the control block).

Parameters with requires_grad=False are not registered and never updated.
Threads: like torch optimizers, use one optimizer from one thread at a time.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
import warnings
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
    # local: the tensor the model computes with (p.data, or a DTensor's local
    # shard); copy_out: the registered param is a separate buffer whose new
    # values are copied into `local` after each step (DTensor on the CPU);
    # copy_grad: the gradient is copied into grad_shm at step() (DTensor).
    __slots__ = ("param", "name", "index", "group", "param_shm", "grad_shm", "local",
                 "copy_out", "copy_grad", "hook")

    def __init__(self, param, name, index, group):
        self.param = param
        self.name = name
        self.index = index  # registration order, the daemon's tensor index
        self.group = group  # daemon group index
        self.param_shm = None
        self.grad_shm = None
        self.local = None
        self.copy_out = False
        self.copy_grad = False
        self.hook = None


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _local(t):
    """A DTensor's local shard (sharing its storage), else the tensor's data."""
    if t is None:
        return None
    if _is_dtensor(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()
    return t.data if isinstance(t, torch.nn.Parameter) else t


def _dist_info():
    """(rank, local_rank, world_size) from torch.distributed when it is
    initialised, else from the torchrun environment; -1 where unknown."""
    rank = local_rank = world = -1
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - exotic builds
        pass

    def env(var):
        v = os.environ.get(var, "")
        return int(v) if v.lstrip("-").isdigit() else -1
    if rank < 0:
        rank = env("RANK")
    if world < 0:
        world = env("WORLD_SIZE")
    local_rank = env("LOCAL_RANK")
    return rank, local_rank, world


class _DosAdamBase(torch.optim.Optimizer):
    _decoupled = True  # AdamW; Adam (L2) overrides
    # GradScaler hands the loss scale to step() instead of unscaling in place.
    _step_supports_amp_scaling = True
    # torch 2.x's GradScaler sets `grad_scale` (a tensor, or None after
    # unscale_) and `found_inf` around step() and deletes them after; it
    # multiplies by a grad_scale it finds, so there is no class default.

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, socket: Optional[str] = None, subgroup_size: int = 0,
                 client_name: Optional[str] = None, maximize: bool = False,
                 rank: Optional[int] = None, local_rank: Optional[int] = None,
                 world_size: Optional[int] = None, overlap: bool = False,
                 model: Optional[torch.nn.Module] = None, async_step: Optional[bool] = None,
                 resume: Optional[Dict[str, Any]] = None):
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
        self._found_inf = False
        self._amp_found_inf = None
        self._last_step = None  # dict of the daemon's report on the last step
        self._hook_begun = False  # the overlap hooks began a step that step() has not claimed
        self._overlapped = False  # the step in flight was begun by the overlap hooks
        self._async = False       # step() returns once the step is queued
        self._stream_sync = False # the trainer's CUDA stream orders steps (no host waits)
        self._layer_waits = []    # forward pre-hook handles (model=)
        self._grad_hooks = []
        self._waited = set()      # entry indices whose new weights were waited for
        self._pending_zero = set()  # entry indices whose zero_grad is deferred
        self._num_subgroups = 0
        self._subgroup_size = subgroup_size
        self._attach_args = (socket, client_name, rank, local_rank, world_size)
        self._resume = resume
        self._inflight = False  # a step begun by the overlap hooks, not yet waited for
        self._ready = set()
        self.ready_log: List[Any] = []  # (tensor index, seconds since the first ready) last step
        self._ready_t0 = None
        self.overlap_armed = True
        self.overlap = bool(overlap)
        if self.overlap and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            warnings.warn(f"dos.torch: overlap=True needs torch >= 2.1 "
                          f"(register_post_accumulate_grad_hook); torch {torch.__version__} "
                          "has none, so steps start at step() as usual")
            self.overlap = False
        self._attach(*self._attach_args)
        try:
            self._register(subgroup_size)
        except BaseException:
            self.close()
            raise
        if self.overlap:
            self._install_hooks()
        self._async_args = (model, async_step)
        self._setup_async(model, async_step)

    # found_inf: the daemon's verdict on the last step (a bool). torch 2.x's
    # GradScaler sets and deletes an attribute of the same name around
    # step() (its inf-check tensor); the property keeps the two apart.
    @property
    def found_inf(self) -> bool:
        self._finish_inflight()  # an asynchronous step's verdict is known once it is done
        return self._found_inf

    @found_inf.setter
    def found_inf(self, value) -> None:
        if isinstance(value, torch.Tensor):
            self._amp_found_inf = value
        else:
            self._found_inf = bool(value)

    @found_inf.deleter
    def found_inf(self) -> None:
        self._amp_found_inf = None

    @property
    def last_step(self) -> Optional[Dict[str, Any]]:
        """The daemon's report on the last step (waits for a step in flight)."""
        self._finish_inflight()
        return self._last_step

    @last_step.setter
    def last_step(self, value) -> None:
        self._last_step = value

    @property
    def session_id(self) -> int:
        """This optimizer's dosd session (with session_token: what a restarted
        trainer passes as `resume=` to continue from the daemon's state)."""
        self._check_open("session_id")
        return int(_native.lib.dos_session_id(self._session))

    @property
    def session_token(self) -> str:
        self._check_open("session_token")
        return _native.lib.dos_session_token(self._session).decode()

    def session_info(self) -> Dict[str, Any]:
        """{'session_id', 'token'}: save it (privately: the token is the
        session's credential) so that a restarted process can build its
        optimizer with `resume=info` after a crash; dosd keeps a dead
        trainer's state for its --session_lease."""
        return {"session_id": self.session_id, "token": self.session_token}

    @property
    def resumed(self) -> bool:
        """True when this optimizer continued a dead trainer's session."""
        return self._session is not None and bool(_native.lib.dos_session_resumed(self._session))

    # ---- setup ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not getattr(self, "_registering", True):
            raise NotImplementedError(
                "dos.torch: param groups cannot be added after construction (dosd registers a "
                "session's tensors once); pass every group to the constructor")
        super().add_param_group(param_group)

    def _attach(self, socket, client_name, rank=None, local_rank=None, world_size=None):
        opts = _native.AttachOptions()
        _native.lib.dos_attach_options_init(ctypes.byref(opts))
        if socket is not None:
            opts.socket_path = os.fspath(socket).encode()
        opts.client_name = (client_name or os.path.basename(sys.argv[0] or "python")).encode()
        d_rank, d_local, d_world = _dist_info()
        for field, given, found in (("rank", rank, d_rank), ("local_rank", local_rank, d_local),
                                    ("world_size", world_size, d_world)):
            value = given if given is not None else found
            if value is not None and int(value) >= 0:
                setattr(opts, field, int(value))
        self.rank = int(opts.rank)
        self.local_rank = int(opts.local_rank)
        self.world_size = int(opts.world_size)
        handle = ctypes.c_void_p()
        resume = getattr(self, "_resume", None)
        if resume is not None:
            try:
                sid, token = int(resume["session_id"]), str(resume["token"])
            except (KeyError, TypeError, ValueError) as exc:
                raise DosError(_INVALID_ARGUMENT,
                               f"resume: expected {{'session_id': int, 'token': str}} as returned "
                               f"by opt.session_info(), got {resume!r}") from exc
            _native.call("dos_resume", ctypes.byref(opts), ctypes.c_uint64(sid), token.encode(),
                         ctypes.byref(handle))
            # A later re-registration (moved storage) attaches afresh.
            self._resume = None
        else:
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
                local = _local(p)
                grad = _local(p.grad)
                if p.dtype not in _DTYPES:
                    raise DosError(_INVALID_ARGUMENT,
                                   f"register: {label} has dtype {p.dtype}; dosd supports "
                                   "torch.float32, torch.bfloat16 and torch.float16 parameters")
                if local.device.type not in ("cpu", "cuda"):
                    raise DosError(_UNIMPLEMENTED,
                                   f"register: {label} is on {local.device}; dosd supports CPU "
                                   "(shared-memory) and CUDA parameters")
                if p.is_sparse:
                    raise DosError(_INVALID_ARGUMENT, f"register: {label} is sparse")
                if grad is not None and (grad.dtype != local.dtype or grad.shape != local.shape):
                    raise DosError(_INVALID_ARGUMENT,
                                   f"register: {label} is {p.dtype} {tuple(local.shape)} but its "
                                   f"grad is {grad.dtype} {tuple(grad.shape)}; gradients "
                                   "must have the parameter's dtype and shape")
                if local.numel() == 0:
                    continue  # e.g. an FSDP2 shard that is empty on this rank
                if dgroup is None:
                    dgroup = len(group_map)
                    group_map.append(gi)
                e = _Entry(p, label, len(entries), dgroup)
                e.local = local
                e.copy_grad = _is_dtensor(p)
                entries.append(e)
        self._group_map = group_map
        if not entries:
            self._entries = []
            return
        devices = {e.local.device for e in entries}
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
            nbytes = e.local.numel() * e.local.element_size()
            offsets.append((total, _align(total + nbytes)))
            total = _align(total + nbytes) + _align(nbytes)
        base = ctypes.c_void_p()
        _native.call("dos_buffer_alloc", self._session, ctypes.c_uint64(total), ctypes.byref(base))
        self._arena = (ctypes.c_ubyte * total).from_address(base.value)

        tensors = (_native.Tensor * len(entries))()
        name_bufs = []
        with torch.no_grad():
            for e, (poff, goff), t in zip(entries, offsets, tensors):
                local = e.local
                n = local.numel()
                e.param_shm = torch.frombuffer(self._arena, dtype=local.dtype, count=n,
                                               offset=poff).view(local.shape)
                e.grad_shm = torch.frombuffer(self._arena, dtype=local.dtype, count=n,
                                              offset=goff).view(local.shape)
                e.param_shm.copy_(local)
                grad = _local(e.param.grad)
                if grad is not None:
                    e.grad_shm.copy_(grad)
                # A DTensor's shard cannot be rebound: copy in and out instead.
                e.copy_out = e.copy_grad
                name = e.name.encode()
                name_bufs.append(name)
                t.name = name
                t.param_dtype = t.grad_dtype = _DTYPES[local.dtype]
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
            if e.copy_out:
                continue
            e.param.data = e.param_shm
            e.param.grad = e.grad_shm
            e.local = e.param_shm
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
                local = e.local
                if not local.is_contiguous():
                    raise DosError(_INVALID_ARGUMENT,
                                   f"register: {e.name} is not contiguous; dosd updates "
                                   "parameters as flat arrays (make it contiguous before "
                                   "building the optimizer)")
                if e.copy_grad:
                    # DTensor (FSDP2): FSDP assigns each step's reduced shard to
                    # p.grad; it is copied into this registered buffer at step().
                    e.grad_shm = torch.zeros_like(local, memory_format=torch.contiguous_format)
                else:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    elif not p.grad.is_contiguous() or p.grad.device != p.device:
                        p.grad = p.grad.to(device=p.device).contiguous()
                    e.grad_shm = p.grad
                e.param_shm = local
                name = e.name.encode()
                name_bufs.append(name)
                t.name = name
                t.param_dtype = t.grad_dtype = _DTYPES[local.dtype]
                t.param = local.data_ptr()
                t.grad = e.grad_shm.data_ptr()
                t.numel = local.numel()
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
        registered parameters: their gradients must stay in shared memory).
        With a step in flight: on a stream-ordered GPU session the zeroing is
        queued behind the step's completion on the current stream; with
        per-layer waits (model=) it is deferred to each layer's wait, so that
        the daemon still reads the gradients of layers it has not reached."""
        if self._inflight and self._layer_waits:
            self._pending_zero.update(e.index for e in self._entries if not e.copy_grad)
            entries = [e for e in self._entries if e.copy_grad]
        else:
            if not (self._inflight and self._stream_sync and not self._hook_begun):
                self._finish_inflight()
            entries = self._entries
        registered = {id(e.param) for e in self._entries if not e.copy_grad}
        with torch.no_grad():
            for e in entries:
                if not e.copy_grad:  # DTensor: the gradient is FSDP's, handled below
                    self._zero_entry(e)
            for group in self.param_groups:
                for p in group["params"]:
                    if id(p) in registered or p.grad is None:
                        continue
                    if set_to_none is None or set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()
        self._ready.clear()

    @staticmethod
    def _zero_entry(e: _Entry) -> None:
        """Zeroes e's registered gradient in place and binds it as p.grad."""
        e.grad_shm.zero_()
        if e.param.grad is not e.grad_shm:
            e.param.grad = e.grad_shm

    def _zero_pending(self, entries) -> None:
        """Applies a deferred zero_grad to `entries` (their new weights were
        waited for, so the daemon is done with their gradients)."""
        with torch.no_grad():
            for e in entries:
                if e.index in self._pending_zero:
                    self._pending_zero.discard(e.index)
                    self._zero_entry(e)

    def _moved(self, e: _Entry) -> bool:
        """True if e's parameter now lives elsewhere with the same dtype,
        shape and device (re-registrable); raises if it changed kind."""
        where = ("the CUDA memory registered with dosd" if self._device is not None
                 else "DOS shared memory")
        local = _local(e.param)
        if local.data_ptr() == e.local.data_ptr() and local.dtype == e.local.dtype:
            return False
        if (local.dtype != e.local.dtype or local.shape != e.local.shape
                or local.device != e.local.device):
            raise DosError(
                _FAILED_PRECONDITION,
                f"step: {e.name} no longer lives in {where} (its .data was replaced, "
                f"now {local.dtype} {tuple(local.shape)} on {local.device}); do not move or "
                "re-create parameters after building the optimizer (copy into them in place)")
        return True

    def _bind_grads(self):
        moved = [e for e in self._entries if self._moved(e)]
        if moved:
            self._reregister(moved)
        with torch.no_grad():
            for e in self._entries:
                p = e.param
                g = p.grad
                if g is None:
                    raise DosError(
                        _FAILED_PRECONDITION,
                        f"step: {e.name} has no gradient (grad is None); DOS updates every "
                        "registered parameter each step: make it take part in the loss, freeze "
                        "it (requires_grad=False) before building the optimizer, or use "
                        "opt.zero_grad() instead of setting grads to None")
                g = _local(g)
                if g.data_ptr() == e.grad_shm.data_ptr() and g.dtype == e.local.dtype:
                    continue
                if g.dtype != e.local.dtype or g.shape != e.local.shape:
                    raise DosError(
                        _INVALID_ARGUMENT,
                        f"step: {e.name} is {p.dtype} {tuple(e.local.shape)} but its grad is "
                        f"{g.dtype} {tuple(g.shape)}; gradients must have the parameter's "
                        "dtype and shape")
                if g.is_sparse:
                    raise DosError(_INVALID_ARGUMENT, f"step: {e.name} has a sparse gradient")
                e.grad_shm.copy_(g)
                if not e.copy_grad:
                    p.grad = e.grad_shm

    def _reregister(self, moved):
        """A parameter's storage moved: new session, same fp32 state."""
        names = ", ".join(e.name for e in moved[:4]) + (" ..." if len(moved) > 4 else "")
        warnings.warn(f"dos.torch: {len(moved)} parameter(s) moved to new storage ({names}); "
                      "re-registering with dosd (the fp32 state is carried over). Avoid "
                      "replacing .data after building the optimizer: this costs a full copy "
                      "of the state", RuntimeWarning, stacklevel=4)
        self._sync_device()
        moved_ids = {id(e.param) for e in moved}
        saved = {}
        for e in self._entries:
            buf, step = self._read(e)
            master = buf[0]
            if id(e.param) in moved_ids:
                new = _local(e.param).detach().to(device="cpu", dtype=torch.float32).reshape(-1)
                old = master.to(e.local.dtype).float()
                if not torch.equal(new, old):
                    master = new.clone()  # the user wrote new values: they win
            saved[id(e.param)] = {"master_param": master, "exp_avg": buf[1],
                                  "exp_avg_sq": buf[2], "step": step}
        self.close()  # copies what lives in the old arena out, detaches
        self._entries = []
        self._attach(*self._attach_args)
        self._register(self._subgroup_size)
        for e in self._entries:
            self._write(e, saved.get(id(e.param)))
        if self.overlap:
            self._install_hooks()
        self._setup_async(*self._async_args)

    def _copy_out(self):
        if any(e.copy_out for e in self._entries):
            with torch.no_grad():
                for e in self._entries:
                    if e.copy_out:
                        e.local.copy_(e.param_shm)

    def _amp_args(self, grad_scaler):
        """(grad_scale, skip) from a GradScaler driving this step: torch 1.x
        passes itself as `grad_scaler`; torch 2.x sets self.grad_scale and
        self.found_inf (after its own inf check) instead."""
        if grad_scaler is not None:  # torch 1.x protocol
            state = grad_scaler._per_optimizer_states[id(self)]
            stage = getattr(state.get("stage"), "name", "READY")
            found = state.get("found_inf_per_device") or {}
            if stage == "UNSCALED":  # the user unscaled (and checked) already
                return 1.0, any(float(v) != 0 for v in found.values())
            return float(grad_scaler._get_scale_async()), False
        skip = False
        if self._amp_found_inf is not None:
            skip = float(self._amp_found_inf) != 0
        amp = getattr(self, "grad_scale", None)
        scale = 1.0 if amp is None else float(amp)
        return scale, skip

    def _record_amp(self, grad_scaler):
        """Fills GradScaler's found_inf_per_device from the daemon's verdict
        (torch 1.x protocol, where the scaler did not check itself)."""
        if grad_scaler is None:
            return
        state = grad_scaler._per_optimizer_states[id(self)]
        if state.get("found_inf_per_device"):
            return
        scale = grad_scaler._get_scale_async()
        state["found_inf_per_device"][scale.device] = torch.full(
            (1,), 1.0 if self._found_inf else 0.0, dtype=torch.float32, device=scale.device)

    def _args(self, grad_scale, clip_coef, gradients_checked=False):
        groups = self._hparams()
        args = _native.StepArgs()
        _native.lib.dos_step_args_init(ctypes.byref(args))
        args.groups = groups
        args.num_groups = len(groups)
        args.grad_scale = float(grad_scale)
        args.clip_coef = float(clip_coef)
        args.gradients_checked = 1 if gradients_checked else 0
        return args, groups

    def _wait(self):
        res = _native.StepResult()
        try:
            _native.call("dos_step_wait", self._session, ctypes.c_int64(-1), ctypes.byref(res))
        finally:
            self._inflight = False
        self._found_inf = bool(res.found_inf)
        self._last_step = {"found_inf": self._found_inf, "step": int(res.step),
                           "wall_us": float(res.wall_us), "update_us": float(res.update_us),
                           "overlapped": self._overlapped}
        self._hook_begun = False
        self._overlapped = False
        self._copy_out()
        if self._pending_zero:  # nothing reads the gradients any more
            self._zero_pending(self._entries)

    def _finish_inflight(self):
        """Collects the step in flight (waits on the host for its result and
        raises its error, if any)."""
        if getattr(self, "_inflight", False):
            self._wait()

    def _stream(self):
        """The current CUDA stream as a cudaStream_t (GPU mode), else None."""
        if self._device is None:
            return None
        return ctypes.c_void_p(torch.cuda.current_stream(self._device).cuda_stream)

    def _begin(self, args):
        """Begins a step: stream-ordered on a GPU session with stream sync
        (the daemon waits for this stream's work on the GPU), else after
        synchronising the device."""
        if self._stream_sync:
            _native.call("dos_step_begin_on_stream", self._session, ctypes.byref(args),
                         self._stream())
        else:
            self._sync_device()
            _native.call("dos_step_begin", self._session, ctypes.byref(args))
        self._inflight = True
        self._waited = set()

    def _queue_wait_all(self):
        """Stream-ordered session without per-layer waits: everything queued
        on the current stream from now on waits for the whole step."""
        if self._num_subgroups:
            _native.call("dos_wait_subgroups", self._session, ctypes.c_uint32(0),
                         ctypes.c_uint32(self._num_subgroups - 1), self._stream(),
                         ctypes.c_int64(-1))

    # ---- asynchronous steps and per-layer waits ----

    def _setup_async(self, model, async_step):
        if not self._entries:
            return
        dtensor = any(e.copy_grad or e.copy_out for e in self._entries)
        if self._device is not None and not dtensor:
            self._stream_sync = bool(_native.lib.dos_stream_sync_supported(self._session))
        first, last = ctypes.c_uint32(), ctypes.c_uint32()
        self._ranges = []
        for e in self._entries:
            _native.call("dos_tensor_subgroups", self._session, ctypes.c_uint32(e.index),
                         ctypes.byref(first), ctypes.byref(last))
            self._ranges.append((int(first.value), int(last.value)))
        self._num_subgroups = max(r[1] for r in self._ranges) + 1
        possible = (self._stream_sync or model is not None) and not dtensor
        if async_step is None:
            async_step = possible
        elif async_step and not possible:
            why = ("FSDP2/DTensor parameters are copied at step()" if dtensor else
                   "without model= nothing would order the next forward after the step on "
                   "this session (shared-memory tensors, or no CUDA stream memory operations)")
            raise DosError(_INVALID_ARGUMENT, f"async_step=True is not possible here: {why}")
        self._async = bool(async_step)
        if model is not None and self._async:
            self._install_layer_waits(model)

    def _install_layer_waits(self, model):
        """Forward pre-hooks: each module with registered parameters of its
        own waits for just their subgroups before it runs, so the next forward
        starts while later layers are still being updated. Gradients are
        guarded too: a parameter's pre-accumulation hook waits for its
        subgroups (and applies a deferred zero_grad) if no forward did."""
        by_param = {id(e.param): e for e in self._entries}
        for module in model.modules():
            ents = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
            if not ents:
                continue
            first = min(self._ranges[e.index][0] for e in ents)
            last = max(self._ranges[e.index][1] for e in ents)

            def pre_hook(_module, _inputs, ents=ents, first=first, last=last):
                self._wait_layer(ents, first, last)
            self._layer_waits.append(module.register_forward_pre_hook(pre_hook))
        for e in self._entries:
            def grad_hook(_grad, e=e):
                r = self._ranges[e.index]
                self._wait_layer([e], r[0], r[1])
            self._grad_hooks.append(e.param.register_hook(grad_hook))

    def _wait_layer(self, ents, first, last):
        if self._session is None:
            return
        if self._inflight and not all(e.index in self._waited for e in ents):
            _native.call("dos_wait_subgroups", self._session, ctypes.c_uint32(first),
                         ctypes.c_uint32(last), self._stream() if self._stream_sync else None,
                         ctypes.c_int64(-1))
            self._waited.update(e.index for e in ents)
        if self._pending_zero:  # zero_grad() came after this layer's wait, or had no forward
            self._zero_pending(ents)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, clip_coef: float = 1.0, **kwargs):
        """One Adam(W) step in the daemon. `grad_scale` divides the gradients
        (an AMP loss scale), `clip_coef` then multiplies them. Sets
        `self.found_inf` (non-finite gradients: nothing was applied).
        Driven by a GradScaler (`scaler.step(opt)`), the scaler's scale is
        used as grad_scale."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(kwargs)}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open("step")
        if not self._entries:
            return loss
        if self._inflight and not self._hook_begun:
            self._finish_inflight()  # the previous asynchronous step
        if self._inflight:  # begun by the overlap hooks at the end of backward
            self._hook_begun = False  # claimed by this step() call
            if grad_scale != 1.0 or clip_coef != 1.0 or grad_scaler is not None \
                    or getattr(self, "grad_scale", None) is not None:
                self._wait()
                raise DosError(_FAILED_PRECONDITION,
                               "step: with overlap=True the step began when the last gradient "
                               "was final, so a grad scale or clip coefficient given now comes "
                               "too late (that step was applied without it); build the optimizer "
                               "with overlap=False when clipping or using a GradScaler")
        else:
            amp_scale, skip = self._amp_args(grad_scaler)
            if skip:  # the scaler found inf/nan: torch optimizers skip the step
                self._found_inf = True
                self._last_step = {"found_inf": True, "step": self._last_step["step"]
                                   if self._last_step else 0, "wall_us": 0.0, "update_us": 0.0,
                                   "overlapped": False}
                return loss
            self._bind_grads()
            args, _groups = self._args(float(grad_scale) * amp_scale, clip_coef)
            self._begin(args)
        self._ready.clear()
        if self._async and grad_scaler is None:
            # Queued: the result is collected at the next step() (or by
            # found_inf, last_step, state access); the next forward waits per
            # layer (model=) or behind the whole step on the stream.
            if not self._layer_waits:
                self._queue_wait_all()
            return loss
        self._wait()
        self._record_amp(grad_scaler)
        return loss

    # ---- overlap ----

    def _install_hooks(self):
        for e in self._entries:
            if e.hook is not None:
                e.hook.remove()
            e.hook = e.param.register_post_accumulate_grad_hook(self._make_hook(e))

    def _make_hook(self, e):
        def hook(_param):
            self._on_ready(e)
        return hook

    def _on_ready(self, e):
        """Post-accumulate-grad hook: e's gradient is final for this
        backward. When every registered tensor is, begin the step."""
        if not self.overlap_armed or self._hook_begun or self._session is None:
            return
        if self._inflight:
            self._finish_inflight()  # the previous asynchronous step (already done)
        now = time.perf_counter()
        if not self._ready:
            self._ready_t0 = now
            self.ready_log = []
        if e.index in self._ready:
            return
        self._ready.add(e.index)
        self.ready_log.append((e.index, now - self._ready_t0))
        # What the daemon would take per subgroup: here only the last one
        # matters, as the control block has one doorbell per step.
        if len(self._ready) == len(self._entries):
            with torch.no_grad():
                self._bind_grads()
                args, _groups = self._args(1.0, 1.0)
                self._begin(args)
            self._hook_begun = True
            self._overlapped = True
            self._ready = set()

    def set_policy(self, policy: str) -> None:
        """Scheduling policy of this session: "cpu", "static:<f>",
        "interleave:<k>" or "auto"."""
        self._check_open("set_policy")
        _native.call("dos_set_policy", self._session, policy.encode())

    # ---- state ----

    def _read(self, e: _Entry):
        self._finish_inflight()
        n = e.local.numel()
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

    def _write(self, e: _Entry, s: Optional[Dict[str, Any]]):
        p = _local(e.param)
        n = p.numel()

        def fp32(t, what):
            t = _local(torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t).detach()
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
        self._finish_inflight()
        _native.call("dos_state_write", self._session, ctypes.c_uint32(e.index),
                     master.data_ptr(), m.data_ptr(), v.data_ptr(), ctypes.c_int64(step))

    # ---- teardown ----

    def close(self) -> None:
        """Moves parameters and gradients back to ordinary memory and detaches
        (the daemon frees this session's state). Idempotent."""
        session = getattr(self, "_session", None)
        if session is None:
            return
        if getattr(self, "_inflight", False):
            try:
                self._wait()
            except Exception:
                pass
        for h in getattr(self, "_layer_waits", []) + getattr(self, "_grad_hooks", []):
            h.remove()
        self._layer_waits, self._grad_hooks = [], []
        with torch.no_grad():
            for e in getattr(self, "_entries", []):
                p = e.param
                if e.hook is not None:
                    e.hook.remove()
                    e.hook = None
                if self._device is not None or e.copy_out:  # the memory is the model's own
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
