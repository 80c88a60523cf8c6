"""Registration: attaching a dosd session and registering the parameters,
in CPU mode (one shared-memory arena holding every parameter and gradient)
or GPU mode (CUDA memory registered in place), and re-registration when a
parameter's storage moved.

A `Registration` is one part of dos.torch's optimizer: it owns the session
handle, the entries (one a registered tensor), the CPU arena, the device (GPU
mode), the map of dosd's groups to torch's param groups and each tensor's
subgroup range. A re-registration (moved storage, add_param_group) makes a
new one; `close()` gives the memory back to the model and detaches.
Thread-safety: none (one optimizer is used from one thread at a time).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import List, Tuple

import torch

from dos import _native
from dos._errors import DosError, call
from dos._native import Status
from dos._progress import with_progress
from dos._entry import Entry, is_dtensor, local_of
from dos._session import SessionHandle, default_client_name

__all__ = ["Entry", "Registration", "local_of", "is_dtensor", "dist_info", "DTYPES"]

DTYPES = {
    torch.float32: _native.DType.F32,
    torch.bfloat16: _native.DType.BF16,
    torch.float16: _native.DType.F16,
}
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _state_what(entries, compact=False) -> str:
    """'1.2 GB of optimizer state' for the progress log (12 bytes a parameter,
    8 with compact state)."""
    n = sum(e.local.numel() for e in entries)
    return f"{n * (8 if compact else 12) / 1e9:.1f} GB of optimizer state"


def dist_info():
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


def _attach_options(socket, client_name, rank, local_rank, world_size):
    opts = _native.AttachOptions()
    _native.lib.dos_attach_options_init(ctypes.byref(opts))
    if socket is not None:
        opts.socket_path = os.fspath(socket).encode()
    opts.client_name = (client_name or default_client_name()).encode()
    d_rank, d_local, d_world = dist_info()
    for field, given, found in (("rank", rank, d_rank), ("local_rank", local_rank, d_local),
                                ("world_size", world_size, d_world)):
        value = given if given is not None else found
        if value is not None and int(value) >= 0:
            setattr(opts, field, int(value))
    return opts


def _attach(opts, resume) -> SessionHandle:
    handle = ctypes.c_void_p()
    if resume is not None:
        try:
            sid, token = int(resume["session_id"]), str(resume["token"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DosError(Status.INVALID_ARGUMENT,
                           f"resume: expected {{'session_id': int, 'token': str}} as returned "
                           f"by opt.session_info(), got {resume!r}") from exc
        call("dos_resume", ctypes.byref(opts), ctypes.c_uint64(sid), token.encode(),
             ctypes.byref(handle))
    else:
        call("dos_attach", ctypes.byref(opts), ctypes.byref(handle))
    return SessionHandle(handle)


def hparams(param_groups, group_map, decoupled: bool):
    """dos_hparams for each of dosd's groups, from torch's param groups."""
    arr = (_native.Hparams * len(group_map))()
    for dg, gi in enumerate(group_map):
        g = param_groups[gi]
        for flag in ("maximize", "amsgrad", "differentiable"):
            if g.get(flag, False):
                raise NotImplementedError(
                    f"dos.torch: param group {gi} has {flag}=True, which dosd does not "
                    "support")
        h = arr[dg]
        h.lr = float(g["lr"])
        h.beta1 = float(g["betas"][0])
        h.beta2 = float(g["betas"][1])
        h.eps = float(g["eps"])
        h.weight_decay = float(g["weight_decay"])
        h.decoupled_weight_decay = 1 if decoupled else 0
    return arr


def _entry_of(p, gi, index, dgroup):
    """An Entry for trainable parameter `p` of torch group `gi` (checked), or
    None for an empty one (an FSDP2 shard that is empty on this rank)."""
    label = f"param {index} (group {gi}, shape {tuple(p.shape)})"
    local = local_of(p)
    grad = local_of(p.grad)
    if p.dtype not in DTYPES:
        raise DosError(Status.INVALID_ARGUMENT,
                       f"register: {label} has dtype {p.dtype}; dosd supports float32, bfloat16 "
                       "and float16 parameters: convert the model first (model.float())")
    if local.device.type not in ("cpu", "cuda"):
        raise DosError(Status.UNIMPLEMENTED,
                       f"register: {label} is on {local.device}; dosd supports CPU "
                       "(shared-memory) and CUDA parameters")
    if p.is_sparse:
        raise DosError(Status.INVALID_ARGUMENT, f"register: {label} is sparse")
    if grad is not None and (grad.dtype != local.dtype or grad.shape != local.shape):
        raise DosError(Status.INVALID_ARGUMENT,
                       f"register: {label} is {p.dtype} {tuple(local.shape)} but its "
                       f"grad is {grad.dtype} {tuple(grad.shape)}; gradients "
                       "must have the parameter's dtype and shape")
    if local.numel() == 0:
        return None
    e = Entry(p, label, index, dgroup)
    e.local = local
    e.copy_grad = is_dtensor(p)
    return e


def _collect(param_groups):
    """(entries, group_map): the trainable parameters, and for each of dosd's
    groups (torch's groups that have any) its torch group index."""
    entries = []
    group_map = []
    for gi, group in enumerate(param_groups):
        dgroup = None
        for p in group["params"]:
            if not p.requires_grad:
                continue
            e = _entry_of(p, gi, len(entries), len(group_map) if dgroup is None else dgroup)
            if e is None:
                continue
            if dgroup is None:
                dgroup = len(group_map)
                group_map.append(gi)
            entries.append(e)
    return entries, group_map


class Registration:
    """One dosd session and the parameters registered with it."""

    def __init__(self, socket=None, client_name=None, rank=None, local_rank=None,
                 world_size=None, resume=None):
        """Attaches (or resumes `resume`, a session_info() dict) a session."""
        opts = _attach_options(socket, client_name, rank, local_rank, world_size)
        self.rank = int(opts.rank)
        self.local_rank = int(opts.local_rank)
        self.world_size = int(opts.world_size)
        self.handle: SessionHandle = _attach(opts, resume)
        self.entries: List[Entry] = []
        self.arena = None
        self.device = None  # torch.device of the parameters in GPU mode, else None
        self.group_map: List[int] = []  # dosd group -> torch group index
        self.ranges: List[Tuple[int, int]] = []  # entry index -> (first, last) subgroup
        self.num_subgroups = 0
        self._decoupled = True

    @property
    def ptr(self):
        """The dos_session* (ctypes.c_void_p), or None once closed."""
        h = self.handle
        return None if h is None or h.closed else h.ptr

    @property
    def dtensor(self) -> bool:
        """Some tensors are copied at step() (FSDP2 shards)."""
        return any(e.copy_grad or e.copy_out for e in self.entries)

    def stream_supported(self) -> bool:
        """The session can order steps on a CUDA stream (GPU mode)."""
        return self.device is not None and bool(_native.lib.dos_stream_sync_supported(self.ptr))

    def stream(self):
        """The current CUDA stream as a cudaStream_t (GPU mode), else None."""
        if self.device is None:
            return None
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def sync_device(self):
        """Makes the trainer's pending work on the device visible to the
        daemon (and the daemon's state writes to later trainer work)."""
        if self.device is not None:
            torch.cuda.current_stream(self.device).synchronize()

    def hparams(self, param_groups):
        return hparams(param_groups, self.group_map, self._decoupled)

    def register(self, param_groups, subgroup_size, decoupled=True, compact=False):
        """Registers the trainable parameters of `param_groups`: in place on
        CUDA, else through one shared-memory arena the model is rebound to."""
        self._decoupled = decoupled
        entries, self.group_map = _collect(param_groups)
        if not entries:
            self.entries = []
            return
        devices = {e.local.device for e in entries}
        if len(devices) > 1:
            where = sorted(map(str, devices))
            raise DosError(Status.INVALID_ARGUMENT,
                           f"register: parameters are on several devices ({where})"
                           "; one optimizer (one dosd session) takes parameters of one device: "
                           "build one optimizer per device")
        device = devices.pop()
        send = lambda: self._send_register(entries, param_groups, subgroup_size, compact)
        try:
            if device.type == "cuda":
                self._register_cuda(entries, device, send)
            else:
                self._register_cpu(entries, send)
        except BaseException:
            self._give_up(entries)
            raise
        for e in entries:
            e.see()
            if e.grad_none and not e.copy_grad:
                # No gradient yet (torch's None): its buffer is zero and
                # untouched until backward or the trainer writes it.
                e.zero_version = e.grad_shm._version
        self.entries = entries
        self._read_ranges()

    def _give_up(self, entries) -> None:
        """A refused registration: the session is detached now, not when the
        exception's frames go (a refused resume then gives the state back to
        dosd for the next try at once). The model was left as it was."""
        for e in entries:
            if e.grad_none and e.grad_shm is not None and e.param.grad is e.grad_shm:
                e.param.grad = None  # CUDA: the zeros it was given for a None gradient
            e.param_shm = e.grad_shm = e.grad_home = None  # the arena's views, if any
        handle, self.handle, self.arena = self.handle, None, None
        handle.closed = True
        if sys.getrefcount(handle) <= 2:
            handle.detach()

    def _register_cpu(self, entries, send):
        # One arena: param then grad for each tensor, each 64-byte aligned.
        offsets = []
        total = 0
        for e in entries:
            nbytes = e.local.numel() * e.local.element_size()
            offsets.append((total, _align(total + nbytes)))
            total = _align(total + nbytes) + _align(nbytes)
        base = ctypes.c_void_p()
        call("dos_buffer_alloc", self.ptr, ctypes.c_uint64(total), ctypes.byref(base))
        self.arena = (ctypes.c_ubyte * total).from_address(base.value)
        # Every tensor over the arena keeps the session, hence the mapping, alive.
        self.arena.owner = self.handle
        with torch.no_grad():
            for e, (poff, goff) in zip(entries, offsets):
                local = e.local
                n = local.numel()
                e.param_shm = torch.frombuffer(self.arena, dtype=local.dtype, count=n,
                                               offset=poff).view(local.shape)
                e.grad_home = torch.frombuffer(self.arena, dtype=local.dtype, count=n,
                                               offset=goff).view(local.shape)
                e.grad_shm = e.grad_home.detach()
                e.param_shm.copy_(local)
                grad = local_of(e.param.grad)
                if grad is not None:
                    e.grad_shm.copy_(grad)
                # A DTensor's shard cannot be rebound: copy in and out instead.
                e.copy_out = e.copy_grad
        send()
        # Only now rebind the model: on failure above it is left untouched.
        for e in entries:
            if e.copy_out:
                continue
            e.param.data = e.param_shm
            e.param.grad = e.grad_shm
            e.local = e.param_shm

    def _register_cuda(self, entries, device, send):
        """GPU mode: registers each parameter and its gradient where they are."""
        if not _native.cuda_supported():
            raise DosError(Status.UNIMPLEMENTED,
                           f"register: the parameters are on {device} but the loaded "
                           "libdos_client was built without CUDA; rebuild it with "
                           "-DDOS_WITH_CUDA=ON (or set DOS_CLIENT_LIB to a CUDA build)")
        with torch.no_grad():
            for e in entries:
                _bind_cuda(e)
            # The daemon reads the initial weights on its own streams.
            torch.cuda.synchronize(device)
        send()
        self.device = device

    def _send_register(self, entries, param_groups, subgroup_size, compact):
        """dos_register for `entries`, whose param_shm and grad_shm are the
        memory dosd is to use, with each group's hyperparameters and the
        state format (compact or not); logs progress while dosd works."""
        tensors = (_native.Tensor * len(entries))()
        names = [e.name.encode() for e in entries]  # alive until dos_register returns
        for e, t, name in zip(entries, tensors, names):
            t.name = name
            t.param_dtype = t.grad_dtype = DTYPES[e.local.dtype]
            t.param = e.param_shm.data_ptr()
            t.grad = e.grad_shm.data_ptr()
            t.numel = e.local.numel()
            t.group = e.group
        groups = self.hparams(param_groups)
        opts = _native.RegisterOptions(subgroup_size=int(subgroup_size))
        call("dos_set_state_format", self.ptr, 1 if compact else 0)
        with_progress(self.ptr, _state_what(entries, compact),
                      lambda: call("dos_register", self.ptr, tensors, len(entries), groups,
                                   len(groups), ctypes.byref(opts)))

    def _read_ranges(self):
        first, last = ctypes.c_uint32(), ctypes.c_uint32()
        self.ranges = []
        for e in self.entries:
            call("dos_tensor_subgroups", self.ptr, ctypes.c_uint32(e.index),
                 ctypes.byref(first), ctypes.byref(last))
            self.ranges.append((int(first.value), int(last.value)))
        self.num_subgroups = max(r[1] for r in self.ranges) + 1

    def moved(self, e: Entry) -> bool:
        """True if e's parameter now lives elsewhere (its .data replaced:
        model.to(dtype), model.cuda(), a new tensor) with the same shape:
        re-registrable; raises if its shape changed."""
        where = ("the CUDA memory registered with dosd" if self.device is not None
                 else "DOS shared memory")
        local = local_of(e.param)
        if local.data_ptr() == e.local.data_ptr() and local.dtype == e.local.dtype:
            return False
        if local.shape != e.local.shape:
            raise DosError(
                Status.FAILED_PRECONDITION,
                f"step: {e.name} no longer lives in {where} (its .data was replaced, "
                f"now {local.dtype} {tuple(local.shape)} on {local.device}); a parameter "
                "cannot change shape after building the optimizer: build a new one")
        return True

    def copy_out(self):
        """DTensor shards on the CPU: the new weights into the model's shard."""
        if any(e.copy_out for e in self.entries):
            with torch.no_grad():
                for e in self.entries:
                    if e.copy_out:
                        e.local.copy_(e.param_shm)

    def close(self) -> None:
        """Moves parameters and gradients back to ordinary memory and drops
        the session: detached now unless tensors over the arena are still
        alive (they keep the handle, which detaches when they go). Every view
        of the optimizer sees the handle closed."""
        handle = self.handle
        if handle is None or handle.closed:
            return
        with torch.no_grad():
            for e in self.entries:
                _unbind(e, self.device is not None)
        handle.closed = True
        self.handle = None
        self.arena = None
        # 2 = `handle` + the argument: nothing over the arena is left.
        if sys.getrefcount(handle) <= 2:
            handle.detach()


def _bind_cuda(e: Entry) -> None:
    p = e.param
    local = e.local
    if not local.is_contiguous():
        raise DosError(Status.INVALID_ARGUMENT,
                       f"register: {e.name} is not contiguous; dosd updates "
                       "parameters as flat arrays (make it contiguous before "
                       "building the optimizer)")
    if e.copy_grad:
        # DTensor (FSDP2): FSDP assigns each step's reduced shard to
        # p.grad; it is copied into this registered buffer at step().
        e.grad_shm = e.grad_home = torch.zeros_like(local, memory_format=torch.contiguous_format)
    else:
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif not p.grad.is_contiguous() or p.grad.device != p.device:
            p.grad = p.grad.to(device=p.device).contiguous()
        e.grad_shm, e.grad_home = p.grad, p.grad.detach()
    e.param_shm = local


def _unbind(e: Entry, gpu: bool) -> None:
    """Gives e's parameter and gradient ordinary memory again (clones of the
    arena's), unless the memory is the model's own (GPU, DTensor copies)."""
    p = e.param
    if e.untouched():
        p.grad = None  # no gradient as torch sees it: None again
    if gpu or e.copy_out:
        e.param_shm = e.grad_shm = e.grad_home = None
        return
    if p.data_ptr() == e.param_shm.data_ptr():
        p.data = e.param_shm.clone()
    g = p.grad  # a sparse one (no data pointer) is never the arena's
    if g is not None and not g.is_sparse and g.data_ptr() == e.grad_shm.data_ptr():
        p.grad = e.grad_shm.to(device=p.device, dtype=p.dtype, copy=True)  # p may have moved
    e.param_shm = e.grad_shm = e.grad_home = e.local = None
