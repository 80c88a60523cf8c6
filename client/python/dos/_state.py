"""Optimizer state I/O: state_dict() and load_state_dict() in
torch.optim.AdamW's format, without a copy of the state in the trainer.

Lazy state, as torch's: a parameter has state once a step has updated it;
before that state_dict()["state"] and opt.state hold nothing for it, so
frameworks that round-trip the optimizer before training (accelerate's
prepare, Lightning's setup) move no state.

state_dict() returns CPU tensors over dosd's own memory (dos/_views.py):
nothing is copied, whatever device the parameters are on, and torch.save
streams the state from dosd's pages to the file. Small tensors (under 64 Ki
elements, not page-aligned in dosd) are copies. With compact_state=True the
moments are bf16 tensors (what dosd holds), the masters fp32. FSDP2 (DTensor)
parameters get DTensor state with the parameter's mesh and placements over
CPU local shards, so torch.distributed.checkpoint saves each rank's shard.

load_state_dict() takes CPU tensors as they are (fp32 and contiguous: no
copy; a file loaded with torch.load(mmap=True) is read page by page) and
converts anything else (other dtypes or devices, DTensors) in pieces of
_CHUNK elements, so loading also needs no more than a bounded buffer.
Parameters without state in the loaded dict and none in dosd are left alone,
and a state dict this optimizer just returned loads without moving a byte.

param_groups carry the keys torch.optim.AdamW (or Adam) of the running torch
has (foreach, fused, capturable, differentiable, ...), so a DOS state dict
loads into torch's optimizer without resetting them, and keys loaded from a
torch state dict are kept and saved again.

`StateIO` is one part of dos.torch's optimizer: it reads and writes the
state of one registration's tensors through its session, after `finish()`
(the optimizer's: collects the step in flight). `opt.state` is dos/_opt_state.py's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import operator
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional

import torch

from dos._errors import DosError, call
from dos._native import Status
from dos import _adapters, _carry, _views
from dos._grads import no_gradient
from dos._register import Entry, Registration, is_dtensor, local_of

__all__ = ["torch_defaults", "group_defaults", "StateIO"]

# Elements per piece when a loaded tensor must be converted (dtype, device).
_CHUNK = 1 << 22


def torch_defaults(cls) -> Dict[str, Any]:
    """The defaults of torch's own optimizer `cls` in the running torch
    version (its param_groups' keys), from a throwaway instance."""
    if cls not in _TORCH_DEFAULTS:
        try:
            _TORCH_DEFAULTS[cls] = dict(cls([torch.zeros(1, requires_grad=True)]).defaults)
        except Exception:  # pragma: no cover - a torch that cannot build it
            _TORCH_DEFAULTS[cls] = {}
    return dict(_TORCH_DEFAULTS[cls])


_TORCH_DEFAULTS: Dict[Any, Dict[str, Any]] = {}


def check_args(lr, betas, eps, weight_decay, amsgrad, maximize, differentiable):
    """Refuses what dosd cannot run (NotImplementedError) and torch's own
    invalid values (ValueError, torch's messages)."""
    if amsgrad:
        raise NotImplementedError("dos.torch: amsgrad=True is not supported by dosd")
    if maximize:
        raise NotImplementedError(
            "dos.torch: maximize=True is not supported by dosd; minimise the negated loss "
            "instead (the same updates)")
    if differentiable:
        raise NotImplementedError("dos.torch: differentiable=True is not supported (dosd "
                                  "updates the weights outside autograd)")
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


def once_each(param_group: Dict[str, Any]) -> Dict[str, Any]:
    """`param_group` with its params as a list, each at most once: dosd keeps
    one state per parameter (torch.optim warns about a repeat and applies two
    updates to it)."""
    params = param_group["params"]
    if not isinstance(params, (torch.Tensor, set)):  # as torch's add_param_group lists them
        params = list(params)
        if len({id(p) for p in params}) != len(params):
            raise ValueError("dos.torch: a parameter group lists the same parameter more than "
                             "once; pass each parameter once")
        param_group = dict(param_group, params=params)
    return param_group


def group_defaults(decoupled, lr, betas, eps, weight_decay, foreach, fused, capturable):
    """A param group's defaults: the hyperparameters, and torch's own
    AdamW's (Adam's: not `decoupled`) keys (foreach, fused, capturable, ...)
    too, so that state dicts move between the two without losing them."""
    defaults = torch_defaults(torch.optim.AdamW if decoupled else torch.optim.Adam)
    defaults.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                    maximize=False)
    # torch's implementation choices: kept as given (they travel with state
    # dicts), without effect on dosd's kernels.
    for key, value in (("foreach", foreach), ("fused", fused)):
        if value is not None or key in defaults:
            defaults[key] = value
    if capturable or "capturable" in defaults:
        defaults["capturable"] = capturable
    if "differentiable" in defaults:
        defaults["differentiable"] = False
    return defaults


def _state_tensor(e: Entry, local: torch.Tensor):
    """`local` (this rank's state, CPU) as the caller sees it: a DTensor with
    the parameter's mesh and placements for FSDP2 parameters, else as is."""
    if not is_dtensor(e.param):
        return local
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
        from torch.distributed._tensor.placement_types import DTensorSpec, TensorMeta
    p = e.param
    meta = TensorMeta(p.shape, p.stride(), local.dtype)
    base = getattr(p, "_spec", None)
    if dataclasses.is_dataclass(base):  # the parameter's own spec: every field kept
        spec = dataclasses.replace(base, tensor_meta=meta)
    else:
        spec = DTensorSpec(p.device_mesh, tuple(p.placements), tensor_meta=meta)
    # Built directly (as FSDP2's CPU offload does): DTensor.from_local would
    # move the local shard to the mesh's device.
    return DTensor(local, spec, requires_grad=False)


class StateIO:
    def __init__(self, reg: Registration, finish: Callable[[], None], compact: bool,
                 loaded: Callable[[], None] = lambda: None):
        self._reg = reg
        self._finish = finish
        self._compact = compact
        self._loaded = loaded  # after a load moved dosd's step counts (delay=1's warm-up)

    @property
    def _session(self):
        return self._reg.ptr

    def _settled(self) -> None:
        """The step in flight collected and the device's work done: what is
        read or written now is whole steps."""
        self._finish()
        self._reg.sync_device()

    def read(self, e: Entry):
        """e's state as (CPU fp32 [3, n] buffer, step); used when re-registering."""
        self._finish()
        return _views.read(self._session, e.index, e.local.numel())

    def states(self, all_params: bool):
        """{param: torch's per-parameter state} of the parameters a step has
        updated (every parameter's with `all_params`), for state_dict()."""
        _adapters.install()  # a framework imported after the optimizer was built
        self._settled()
        state = defaultdict(dict)
        moment_bytes = _views.fetch(self._session)
        for e in self._reg.entries:
            step = _views.step_of(self._session, e.index)
            if step > 0 or all_params:
                state[e.param] = self._tensor_state(e, step, moment_bytes)
        return state

    def state_of(self, e: Entry) -> Dict[str, Any]:
        """e's state in torch's per-parameter format now ({} before its
        first step, as torch's)."""
        self._settled()
        moment_bytes = _views.fetch(self._session)
        step = _views.step_of(self._session, e.index)
        return self._tensor_state(e, step, moment_bytes) if step > 0 else {}

    def _tensor_state(self, e: Entry, step: int, moment_bytes: int) -> Dict[str, Any]:
        """e's state from the views fetched last: views of dosd's memory
        where the tensor is page-aligned there, else copies."""
        shape = e.local.shape  # a DTensor's local shard: this rank's state
        moment = torch.bfloat16 if (moment_bytes or self._moment_bytes()) == 2 else torch.float32
        fp16 = e.param.dtype != torch.float32
        parts = [_views.view(self._session, e.index, w, dt, shape) if want else None
                 for w, dt, want in ((0, torch.float32, fp16), (1, moment, True),
                                     (2, moment, True))]
        if any(t is None for t, want in zip(parts, (fp16, True, True)) if want):
            parts = self._copied_state(e, fp16, moment)
        master, m, v = parts
        count = _views.hand_out(torch.tensor(float(step)), self._session, e.index, "step")
        s = {"step": count, "exp_avg": _state_tensor(e, m), "exp_avg_sq": _state_tensor(e, v)}
        if master is not None:
            s["master_param"] = _state_tensor(e, master)
        return s

    def _moment_bytes(self) -> int:
        return 2 if self._compact else 4

    def _copied_state(self, e: Entry, fp16: bool, moment: torch.dtype):
        """[master or None, exp_avg, exp_avg_sq] of e read into new tensors
        (small tensors only: see dos/_views.py)."""
        shape = e.local.shape
        buf, _ = _views.read(self._session, e.index, e.local.numel(), master=fp16)
        # Each its own tensor (a view of buf would save all three arrays).
        arrays = (buf[0].clone() if fp16 else None, buf[1].to(moment, copy=True),
                  buf[2].to(moment, copy=True))
        return [None if t is None else _views.hand_out(t.view(shape), self._session, e.index, w)
                for w, t in enumerate(arrays)]

    def load(self, state_dict: Dict[str, Any], groups: List[Dict[str, Any]]) -> None:
        """Accepts this class's or torch.optim.Adam/AdamW's state dicts (CPU,
        GPU or DTensor state) for the param groups `groups` and pushes the
        state to the daemon, then takes the saved groups' settings. The
        master weight is 'master_param' where present, else the parameter
        itself."""
        saved_groups = state_dict["param_groups"]
        _check_groups(groups, saved_groups)
        id_map = {}
        for g, sg in zip(groups, saved_groups):
            for old, p in zip(sg["params"], g["params"]):
                id_map[old] = p
        # The daemon rewrites the weights from the loaded masters: let the
        # trainer's pending work on them finish first.
        self._settled()
        with torch.no_grad():
            self._push(state_dict["state"], id_map)
        self._reg.copy_out()
        for g, sg in zip(groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        self._finish()
        self._loaded()

    def _push(self, saved_state, id_map) -> None:
        by_param = {id(e.param): e for e in self._reg.entries}
        loads = []
        for old, s in saved_state.items():
            p = id_map.get(old)
            e = None if p is None else by_param.get(id(p))  # None: frozen, no state in dosd
            if e is not None:  # _parts_of raises for a wrong size or a missing moment
                loads.append((e, s, _parts_of(e, s)))
        # Every tensor was checked before the first write: a refused state
        # dict leaves the state as it was, as torch's does.
        for e, s, parts in loads:
            self.write(e, s, parts)
        pushed = {id(e.param) for e, _, _ in loads}
        fresh = [e for e in self._reg.entries if id(e.param) not in pushed]
        if fresh:
            _views.fetch(self._session)
        for e in fresh:
            # torch would start this param afresh; one dosd has not
            # stepped yet is fresh already (accelerate's prepare loads
            # an empty state dict: nothing moves).
            if _views.step_of(self._session, e.index) > 0:
                self.write(e, None)

    def saved_state(self, moved=(), kept=(), why="a change of the parameters", adding=0) -> Dict:
        """Every registered tensor's state read from dosd, by id(param), held
        by a _carry.Carry (`why`, `adding`: its arguments); a moved or
        written (Entry.written) parameter's values become its master where
        they are not the master rounded to the old or the new dtype, unless
        it is in `kept` (a copy of old storage)."""
        moved_ids = {id(e.param) for e in moved} - set(kept)
        self._finish()
        _views.fetch(self._session)  # every tensor's step count, in one request
        fresh = {id(e.param) for e in self._reg.entries if self._fresh(e, id(e.param) in moved_ids)}
        carry = _carry.Carry(sum(12 * e.local.numel() for e in self._reg.entries
                                 if id(e.param) not in fresh), why, adding)
        saved = _carry.Saved(carry)
        for e in self._reg.entries:
            if id(e.param) in fresh:  # read nothing (81 GB at 7B)
                saved[id(e.param)] = {"fresh": True, "grad_none": no_gradient(e)}
                continue
            buf, step = self.read(e)
            master = buf[0]
            if id(e.param) in moved_ids or (e.written() and id(e.param) not in kept):
                merged = merged_master(master, local_of(e.param), e.local.dtype)
                if merged is not None:
                    master = merged  # the values the user wrote win
            saved[id(e.param)] = carry.keep(master, buf[1], buf[2], step=step,
                                            grad_none=no_gradient(e))
        return saved

    def _is_own_state(self, e: Entry, s: Dict[str, Any]) -> bool:
        """True if `s` is e's state as state_dict() returned it (views of
        dosd's memory, same step): loading it would change nothing. Also when
        it was kept across steps, untouched (its views show the later steps,
        as torch's live state tensors do; a small tensor's copies and the step
        count are those handed out): torch's load of it changes nothing."""
        arrays = [(1, "exp_avg"), (2, "exp_avg_sq")]
        if "master_param" in s:
            arrays.append((0, "master_param"))
        elif e.param.dtype != torch.float32:
            return False
        if not all(s.get(k) is not None and
                   (_views.is_view_of(local_of(s[k]), self._session, e.index, w) or
                    _views.handed(local_of(s[k]), self._session, e.index, w))
                   for w, k in arrays):
            return False
        if _views.handed(s.get("step"), self._session, e.index, "step"):
            return True
        _views.fetch(self._session)
        return int(float(s.get("step", -1))) == _views.step_of(self._session, e.index)

    def _fresh(self, e: Entry, moved: bool) -> bool:
        """e's state is what a new registration starts from: never stepped (zero
        moments), its master the parameter (a framework moving the model to its
        device after the optimizer was built), not a master kept through a new dtype."""
        return (_views.step_of(self._session, e.index) == 0
                and (not moved or local_of(e.param).dtype == e.local.dtype))

    def write(self, e: Entry, s: Optional[Dict[str, Any]], parts=None):
        """Pushes one tensor's state: `s` (torch's per-parameter state) or,
        for None, a fresh start from the parameter's current value; `parts`:
        _parts_of(e, s) where the caller has it already."""
        if s is not None and self._is_own_state(e, s):
            return  # the state dict this optimizer returned: dosd holds it already
        self._write_parts(e, parts or _parts_of(e, s))

    def take_weights(self, entries: List[Entry], delayed_pending: bool) -> None:
        """Each entry's parameter as it is now becomes its master weight in
        dosd, its moments and step count kept: after weights were written in
        place between steps, which the next step would overwrite. Element by
        element (merged_master): one the trainer did not write (the master
        rounded to the parameter's dtype) keeps its fp32 master. Writes the
        masters of written tensors only."""
        if delayed_pending:
            raise DosError(Status.FAILED_PRECONDITION,
                           "reload_weights: a delayed update (delay=1) is pending and would "
                           "install its weights over these at the next step; call "
                           "opt.synchronize() first, then write the weights and reload them")
        self._settled()
        _views.fetch(self._session)
        for e in entries:
            merged = merged_master(self._master(e), local_of(e.param))
            if merged is not None:  # else untouched: its master keeps its precision
                self._finish()
                call("dos_state_write", self._session, ctypes.c_uint32(e.index),
                     merged.data_ptr(), None, None,  # the moments stay dosd's
                     ctypes.c_int64(_views.step_of(self._session, e.index)))
            e.see()

    def _master(self, e: Entry) -> torch.Tensor:
        """e's fp32 master, flat: a view of dosd's memory (a copy of a small
        tensor's state, not page-aligned there), after _views.fetch()."""
        master = _views.view(self._session, e.index, 0, torch.float32, e.local.shape)
        if master is None:
            master = _views.read(self._session, e.index, e.local.numel())[0][0]
        return master.reshape(-1)

    def _write_parts(self, e: Entry, parts) -> None:
        """dosd takes `parts` and writes the parameter from the master: it
        holds the parameter as it is then (Entry.see)."""
        self._write_state(e, parts)
        e.see()

    def _write_state(self, e: Entry, parts) -> None:
        n = local_of(e.param).numel()
        master, m, v, step = parts
        self._finish()
        parts = [master, m, v]
        if all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                             and t.is_contiguous()) for t in parts):
            zeros = None if m is not None and v is not None else torch.zeros(n)
            ptrs = [t.data_ptr() if t is not None else zeros.data_ptr() for t in parts]
            call("dos_state_write", self._session, ctypes.c_uint32(e.index), *ptrs,
                 ctypes.c_int64(step))
            return
        # Pieces: each part converted to fp32 on the CPU into one bounded buffer.
        k = min(n, _CHUNK)
        staging = torch.empty(3, k, dtype=torch.float32)
        for off in range(0, n, k):
            c = min(k, n - off)
            for row, t in zip(staging, parts):
                if t is None:
                    row[:c].zero_()
                else:
                    row[:c].copy_(t[off:off + c])
            call("dos_state_write_range", self._session, ctypes.c_uint32(e.index),
                 ctypes.c_uint64(off), ctypes.c_uint64(c), staging[0].data_ptr(),
                 staging[1].data_ptr(), staging[2].data_ptr(), ctypes.c_int64(step))


def merged_master(master: torch.Tensor, param, old_dtype=None) -> Optional[torch.Tensor]:
    """`master` (flat fp32) with each element `param` no longer holds as the
    master rounded to its dtype (or to `old_dtype`, from which it was
    converted) replaced by the parameter's value, in a new CPU tensor; None
    where it holds every one: a written 16-bit parameter's untouched
    elements keep their fp32 masters. Tensor by tensor, on the CPU."""
    new = param.detach().to("cpu").reshape(-1)
    same = (master.to(new.dtype) == new) | (master.isnan() & new.isnan())  # NaN: unwritten
    if old_dtype is not None and old_dtype != new.dtype:
        same |= master.to(old_dtype).to(new.dtype) == new
    if bool(same.all()):
        return None
    return torch.where(same, master, new.to(torch.float32))


def _parts_of(e: Entry, s: Optional[Dict[str, Any]]):
    """(master, exp_avg, exp_avg_sq, step) of torch's per-parameter state `s`
    for entry `e`, flat (views where they can be); for None, a fresh start
    from the parameter. Raises, naming the tensor, for a wrong size, a
    missing or unreadable tensor or a bad step (the check before any write)."""
    p = local_of(e.param)
    n = p.numel()

    def flat(t, what):
        if t is None:
            raise DosError(Status.INVALID_ARGUMENT,
                           f"load_state_dict: the saved state of {e.name} has no '{what}'")
        t = local_of(torch.as_tensor(t) if not isinstance(t, torch.Tensor) else t).detach()
        if t.numel() != n:
            raise DosError(Status.INVALID_ARGUMENT,
                           f"load_state_dict: {e.name} has {n} elements but its saved "
                           f"'{what}' has {t.numel()}")
        if t is not p:
            _readable(e, t, what)
        return t.reshape(-1)

    if s is None:
        return flat(p, "param"), None, None, 0
    master = flat(s["master_param"] if "master_param" in s else p, "master_param")
    return (master, flat(s.get("exp_avg"), "exp_avg"), flat(s.get("exp_avg_sq"), "exp_avg_sq"),
            _step_count(e, s.get("step")))


def _readable(e: Entry, t: torch.Tensor, what: str) -> None:
    """Refuses a saved tensor dosd cannot take (meta, complex): one element read as a write."""
    try:
        if t.is_meta:
            raise NotImplementedError("a meta tensor has no data")
        if t.is_complex():  # a copy would drop the imaginary part, with only a warning
            raise TypeError(f"{t.dtype} values do not fit dosd's real state")
        torch.empty(min(t.numel(), 1)).copy_(t.reshape(-1)[:1])
    except (RuntimeError, NotImplementedError, TypeError) as err:
        raise DosError(Status.INVALID_ARGUMENT,
                       f"load_state_dict: the saved '{what}' of {e.name} ({t.device} tensor) "
                       f"cannot be read ({err}); load the state dict with dense tensors on the "
                       f"CPU or a GPU (torch.load(..., map_location='cpu'))") from None


_MAX_STEP = 1 << 53  # dosd's import limit (kMaxImportedStep, daemon/rpc/dos_service.cc)


def _step_count(e: Entry, raw) -> int:
    """The saved 'step' `raw` (a Python int or float, a numeric string, a
    one-element tensor) as an int in [0, 2**53] (dosd's), exactly: an int is not
    rounded through a float, and one out of range is refused, not wrapped."""
    try:
        value = raw.item() if isinstance(raw, torch.Tensor) else raw
        try:
            value = operator.index(value)  # ints (and numpy's) exactly
        except TypeError:
            value = float(value)
            value = int(value) if math.isfinite(value) and value == int(value) else None
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        value = None
    if value is None or value < 0:
        raise DosError(Status.INVALID_ARGUMENT,
                       f"load_state_dict: the saved state of {e.name} has 'step' "
                       f"{raw!r}; a step count (an integer >= 0) is needed")
    if value > _MAX_STEP:
        raise DosError(Status.INVALID_ARGUMENT,
                       f"load_state_dict: the saved state of {e.name} has 'step' {raw!r} "
                       f"(= {value}), more than dosd's largest step count 2**53; a step count "
                       f"(an integer in [0, 2**53]) is needed")
    return value


def _check_groups(groups, saved_groups) -> None:
    # torch's messages, with the counts: the state dict of another model or
    # of an optimizer built with other param groups.
    if len(groups) != len(saved_groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups "
                         f"({len(saved_groups)}, the optimizer has {len(groups)})")
    for i, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"loaded state dict contains a parameter group that doesn't "
                             f"match the size of optimizer's group (group {i}: "
                             f"{len(sg['params'])} parameters saved, {len(g['params'])} here)")
        for flag in ("amsgrad", "maximize"):
            if sg.get(flag, False):
                raise NotImplementedError(
                    f"dos.torch: cannot load a {flag}=True state dict (dosd has no {flag})")
