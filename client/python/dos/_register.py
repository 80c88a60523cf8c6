"""Registration: attaching a dosd session and registering the parameters,
in CPU mode (one shared-memory arena holding every parameter and gradient)
or GPU mode (CUDA memory registered in place), and re-registration when a
parameter's storage moved.

`_RegisterMixin` is one part of dos.torch's optimizer class. It owns
`_session`, `_entries`, `_arena`, `_device`, `_group_map`, `rank`,
`local_rank` and `world_size`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

import torch

from dos import _native
from dos._errors import DosError, call
from dos._native import Status
from dos._progress import with_progress

__all__ = ["Entry", "local_of", "is_dtensor", "dist_info", "DTYPES"]

DTYPES = {
    torch.float32: _native.DType.F32,
    torch.bfloat16: _native.DType.BF16,
    torch.float16: _native.DType.F16,
}
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Entry:
    """One registered parameter: its shared-memory param and grad views."""

    # param_shm / grad_shm: the registered memory (shared memory in CPU mode,
    # the parameter's own CUDA storage and its gradient in GPU mode).
    # local: the tensor the model computes with (p.data, or a DTensor's local
    # shard); copy_out: the registered param is a separate buffer whose new
    # values are copied into `local` after each step (DTensor on the CPU);
    # copy_grad: the gradient is copied into grad_shm at step() (DTensor).
    # grad_none: the parameter counts as having no gradient (torch's grad
    # would be None): set by zero_grad(set_to_none=True), cleared when
    # backward reaches it; step() skips it unless something else wrote its
    # gradient since (zero_version: grad_shm's version counter when zeroed;
    # DDP writes the averaged gradient of a parameter this rank did not use).
    __slots__ = ("param", "name", "index", "group", "param_shm", "grad_shm", "local",
                 "copy_out", "copy_grad", "hook", "grad_none", "zero_version")

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
        self.grad_none = param.grad is None
        self.zero_version = -1


def _state_what(entries, compact=False) -> str:
    """'1.2 GB of optimizer state' for the progress log (12 bytes a parameter,
    8 with compact state)."""
    n = sum(e.local.numel() for e in entries)
    return f"{n * (8 if compact else 12) / 1e9:.1f} GB of optimizer state"


def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local_of(t):
    """A DTensor's local shard (sharing its storage), else the tensor's data."""
    if t is None:
        return None
    if is_dtensor(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()
    return t.data if isinstance(t, torch.nn.Parameter) else t


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


class _RegisterMixin:
    def _attach(self, socket, client_name, rank=None, local_rank=None, world_size=None):
        opts = _native.AttachOptions()
        _native.lib.dos_attach_options_init(ctypes.byref(opts))
        if socket is not None:
            opts.socket_path = os.fspath(socket).encode()
        opts.client_name = (client_name or os.path.basename(sys.argv[0] or "python")).encode()
        d_rank, d_local, d_world = dist_info()
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
                raise DosError(Status.INVALID_ARGUMENT,
                               f"resume: expected {{'session_id': int, 'token': str}} as returned "
                               f"by opt.session_info(), got {resume!r}") from exc
            call("dos_resume", ctypes.byref(opts), ctypes.c_uint64(sid), token.encode(),
                         ctypes.byref(handle))
            # A later re-registration (moved storage) attaches afresh.
            self._resume = None
        else:
            call("dos_attach", ctypes.byref(opts), ctypes.byref(handle))
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
                local = local_of(p)
                grad = local_of(p.grad)
                if p.dtype not in DTYPES:
                    raise DosError(Status.INVALID_ARGUMENT,
                                   f"register: {label} has dtype {p.dtype}; dosd supports "
                                   "torch.float32, torch.bfloat16 and torch.float16 parameters")
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
                    continue  # e.g. an FSDP2 shard that is empty on this rank
                if dgroup is None:
                    dgroup = len(group_map)
                    group_map.append(gi)
                e = Entry(p, label, len(entries), dgroup)
                e.local = local
                e.copy_grad = is_dtensor(p)
                entries.append(e)
        self._group_map = group_map
        if not entries:
            self._entries = []
            return
        devices = {e.local.device for e in entries}
        if len(devices) > 1:
            where = sorted(map(str, devices))
            raise DosError(Status.INVALID_ARGUMENT,
                           f"register: parameters are on several devices ({where})"
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
        call("dos_buffer_alloc", self._session, ctypes.c_uint64(total), ctypes.byref(base))
        self._arena = (ctypes.c_ubyte * total).from_address(base.value)
        # Every tensor over the arena keeps the session, hence the mapping, alive.
        self._arena.owner = self._handle

        with torch.no_grad():
            for e, (poff, goff) in zip(entries, offsets):
                local = e.local
                n = local.numel()
                e.param_shm = torch.frombuffer(self._arena, dtype=local.dtype, count=n,
                                               offset=poff).view(local.shape)
                e.grad_shm = torch.frombuffer(self._arena, dtype=local.dtype, count=n,
                                              offset=goff).view(local.shape)
                e.param_shm.copy_(local)
                grad = local_of(e.param.grad)
                if grad is not None:
                    e.grad_shm.copy_(grad)
                # A DTensor's shard cannot be rebound: copy in and out instead.
                e.copy_out = e.copy_grad
        self._send_register(entries, subgroup_size)
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
            raise DosError(Status.UNIMPLEMENTED,
                           f"register: the parameters are on {device} but the loaded "
                           "libdos_client was built without CUDA; rebuild it with "
                           "-DDOS_WITH_CUDA=ON (or set DOS_CLIENT_LIB to a CUDA build)")
        with torch.no_grad():
            for e in entries:
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
                    e.grad_shm = torch.zeros_like(local, memory_format=torch.contiguous_format)
                else:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    elif not p.grad.is_contiguous() or p.grad.device != p.device:
                        p.grad = p.grad.to(device=p.device).contiguous()
                    e.grad_shm = p.grad
                e.param_shm = local
            # The daemon reads the initial weights on its own streams.
            torch.cuda.synchronize(device)
        self._send_register(entries, subgroup_size)
        self._device = device
        self._entries = entries

    def _send_register(self, entries, subgroup_size):
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
        groups = self._hparams()
        opts = _native.RegisterOptions(subgroup_size=int(subgroup_size))
        compact = bool(getattr(self, "_compact_state", False))
        call("dos_set_state_format", self._session, 1 if compact else 0)
        with_progress(self._session, _state_what(entries, compact),
                      lambda: call("dos_register", self._session, tensors, len(entries), groups,
                                   len(groups), ctypes.byref(opts)))

    def _hparams(self):
        arr = (_native.Hparams * len(self._group_map))()
        for dg, gi in enumerate(self._group_map):
            g = self.param_groups[gi]
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
            h.decoupled_weight_decay = 1 if self._decoupled else 0
        return arr

    def _moved(self, e: Entry) -> bool:
        """True if e's parameter now lives elsewhere (its .data replaced:
        model.to(dtype), model.cuda(), a new tensor) with the same shape:
        re-registrable; raises if its shape changed."""
        where = ("the CUDA memory registered with dosd" if self._device is not None
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

    def _reregister(self, moved):
        """A parameter's storage moved: new session, same fp32 state."""
        names = ", ".join(e.name for e in moved[:4]) + (" ..." if len(moved) > 4 else "")
        warnings.warn(f"dos.torch: {len(moved)} parameter(s) moved to new storage ({names}); "
                      "re-registering with dosd (the fp32 state is carried over). Avoid "
                      "replacing .data after building the optimizer: this costs a full copy "
                      "of the state", RuntimeWarning, stacklevel=4)
        self._sync_device()
        self._rebuild(self._saved_state(moved))

    def _saved_state(self, moved=()):
        """Every registered tensor's state read from dosd, by id(param); a
        moved parameter's new values become its master unless they are the
        old master rounded to the old or the new dtype (a plain conversion
        keeps the fp32 master)."""
        moved_ids = {id(e.param) for e in moved}
        saved = {}
        for e in self._entries:
            buf, step = self._read(e)
            master = buf[0]
            if id(e.param) in moved_ids:
                local = local_of(e.param).detach()
                new = local.to(device="cpu", dtype=torch.float32).reshape(-1)
                if not any(torch.equal(new, master.to(dt).float())
                           for dt in {e.local.dtype, local.dtype}):
                    master = new.clone()  # the user wrote new values: they win
            saved[id(e.param)] = {"master_param": master, "exp_avg": buf[1],
                                  "exp_avg_sq": buf[2], "step": step,
                                  "grad_none": self._no_gradient(e)}
        return saved

    def _rebuild(self, saved):
        """A new session for the current param_groups, with the state
        `saved` (from _saved_state) written back; parameters not in it start
        afresh."""
        self.close()  # copies what lives in the old arena out, detaches
        self._entries = []
        self._attach(*self._attach_args)
        self._register(self._subgroup_size)
        for e in self._entries:
            s = saved.get(id(e.param))
            self._write(e, s)
            if s is not None and s["grad_none"] and not e.copy_grad:
                # No gradient this step (before the rebuild): a zeroed,
                # untouched buffer says so to _bind_grads.
                self._zero_entry(e)
                e.grad_none = True
        self._install_seen_hooks()
        if self.overlap:
            self._install_hooks()
        model_ref, async_step = self._async_args
        self._setup_async(None if model_ref is None else model_ref(), async_step)

