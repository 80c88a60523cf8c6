"""torch.distributed.checkpoint (DCP) loading into this optimizer's state
dict without a second copy of the state in the trainer.

DCP loads in place: it copies the checkpoint into the tensors of the state
dict it is handed (`opt.state_dict(all_params=True)`, DCP's
get_optimizer_state_dict), which are read-only-shared views of dosd's memory
(dos/_views.py). Each page it writes becomes the trainer's own: 8 to 12
bytes a parameter, 81 GB at 7B beside dosd's copy, held until the dict is
dropped. So DCP's load is wrapped. Where this process (its host and cgroup)
has no room for those pages (dos/_carry.py's rule; DOS_SPILL), every view in
the dict is first moved (Tensor.set_, so that each dict holding the tensor
sees it) onto an unnamed file on a disk, mapped shared, reserved whole: the
pages DCP writes are then the page cache's, written back and dropped under
pressure, and load_state_dict() reads them into dosd a piece at a time. A
view the load did not write (a partial load) is moved back onto dosd's
memory, and so is every view when the load fails: the dict shows the state
as it was. With no disk that has room, the load is refused before anything
is read. The file goes when the dict's tensors do.

Stateful values of the dict (torch's AppState pattern, an optimizer passed
as is) are asked for their state dicts first, in DCP's order, and those are
handed to DCP: their views are moved with the dict's. The ranks decide
together, one vote a load, so that a refusal or an error on one rank is
raised on all instead of leaving the others in DCP's collectives. "Written"
is told by marks at both ends of each moved tensor: DCP writes each tensor
it loads whole (a load covering part of one is not DCP's). DCP imported
after this module is wrapped at its import, on every rank alike.

DCP's async_save stages (copies) the whole state dict into host memory
before its writer thread saves it: the state again, at 7B 81 GB. A state
dict holding views of dosd's memory is saved by dcp.save on the calling
thread instead, whole (no later step can change it meanwhile), and a
finished future is returned; others go to async_save as before.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import mmap
import sys
import threading
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from typing import Any, List, Optional, Tuple

import torch

from dos import _carry, _views
from dos._errors import DosError
from dos._native import Status

__all__ = ["install"]

_WRAPPED = (("torch.distributed.checkpoint", "load"),
            ("torch.distributed.checkpoint", "load_state_dict"),
            ("torch.distributed.checkpoint.state_dict_loader", "load"),
            ("torch.distributed.checkpoint.state_dict_loader", "load_state_dict"),
            ("torch.distributed.checkpoint", "async_save"),
            ("torch.distributed.checkpoint.state_dict_saver", "async_save"))
# What a moved tensor's first and last elements hold until the load writes
# them: a NaN no checkpoint holds in practice (torch's is 0x7FC00000), by
# element size.
_MARK = {4: (torch.int32, 0x7FA5C3E1), 2: (torch.int16, 0x7FA5)}
_PAGE = 4096


def install() -> None:
    """Wraps DCP's load functions where DCP is imported (never imports it:
    Debian's torch 1.13 cannot), and otherwise has them wrapped when it is:
    every rank wraps the same functions whichever rank called what (a
    wrapped rank votes in a collective an unwrapped one would not join).
    Called when an optimizer is built and at each state_dict()."""
    if _HOOKED not in sys.modules:
        _hook()
    for module, name in _WRAPPED:
        mod = sys.modules.get(module)
        f = getattr(mod, name, None) if mod is not None else None
        if f is not None and not getattr(f, "_dos_wrapped", False):
            setattr(mod, name, (_wrap_async_save(f, mod) if name == "async_save" else
                                _wrap(f, stateful=name == "load")))


_HOOKED = "torch.distributed.checkpoint"


class _Finder(importlib.abc.MetaPathFinder):
    """Finds _HOOKED with the other finders and runs install() once it is executed."""
    _dos_finder = True  # a reloaded dos._dcp's finder is another class: the mark tells them
    _busy = threading.local()

    def find_spec(self, name, path, target=None):
        if name != _HOOKED or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if getattr(finder, "_dos_finder", False) or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.on = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        try:
            install()
        except Exception:  # noqa: BLE001 - DCP's own import must not fail for dos
            pass           # the next state_dict() wraps it

    def __getattr__(self, name):  # the real loader's other methods (get_resource_reader, ...)
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


_hook_lock = threading.Lock()


def _hook() -> None:
    with _hook_lock:
        if not any(getattr(f, "_dos_finder", False) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def _wrap(original, stateful: bool):
    """DCP's load (`stateful`: it calls the dict's Stateful values; the
    deprecated load_state_dict does not)."""
    group_of = _group_reader(original)

    @functools.wraps(original)
    def load(state_dict, *args, **kwargs):
        if not isinstance(state_dict, MutableMapping):
            return original(state_dict, *args, **kwargs)
        moved = _Moved(group_of(state_dict, args, kwargs))
        # The Stateful values' state dicts, asked for here in DCP's order
        # (sorted keys) and handed to DCP as they were: every rank then
        # decides once per load, whatever values it holds.
        proxies, found, err = {}, [], None
        try:
            proxies = {k: _Stateful(state_dict[k], moved) for k in sorted(state_dict, key=str)
                       if stateful and _is_stateful(state_dict[k])}
            found = _views.tensors_over_dosd([state_dict] + [p.sd for p in proxies.values()])
        except Exception as e:  # noqa: BLE001 - voted on (below), then raised
            err = e
        try:
            moved.add(found, err)
            state_dict.update(proxies)
            result = original(state_dict, *args, **kwargs)
        except BaseException:
            moved.undo()
            raise
        finally:
            state_dict.update({k: p.inner for k, p in proxies.items()})
        moved.undo(unwritten_only=True)
        return result
    load._dos_wrapped = True
    return load


def _group_reader(original):
    """f(state_dict, args, kwargs) -> the call's process group: False for
    none (no_dist), None for the default; positional arguments included (the
    deprecated load_state_dict takes them so)."""
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        sig = None

    def group_of(state_dict, args, kwargs):
        try:
            bound = sig.bind_partial(state_dict, *args, **kwargs).arguments if sig else kwargs
        except TypeError:
            bound = kwargs
        return False if bound.get("no_dist") else bound.get("process_group")
    return group_of


def _vote(value: int, group) -> int:
    """The largest `value` of the call's process group's ranks (every rank
    calls it once a call: DCP is SPMD), so that the ranks decide together:
    one rank refusing alone would leave the others waiting in DCP's
    collectives. Every rank of the group must run a dos.torch optimizer (a
    rank that never built one does not vote)."""
    try:
        import torch.distributed as dist
        if group is False or not (dist.is_available() and dist.is_initialized()):
            return value
        t = torch.tensor([value], device=_device_for(dist, group))
    except (ImportError, RuntimeError, ValueError, AssertionError):
        return value
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _device_for(dist, group) -> torch.device:
    """The device DCP's own collectives use on `group` (its object
    collectives' choice), else one the backend's name suggests."""
    c10d = getattr(dist, "distributed_c10d", None)
    pick = getattr(c10d, "_get_object_coll_device", None)
    if pick is not None:
        try:
            return torch.device(pick(group))
        except (RuntimeError, ValueError, TypeError, AttributeError):
            pass
    backend = str(dist.get_backend(group))
    if "nccl" not in backend or "cpu:" in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class _Saved(Future):
    """async_save's answer for a dict saved in place: a finished Future (the
    Metadata), that also reads as an AsyncSaveResponse (its staging and its
    upload, both done), whichever the caller's torch and stager expect."""

    def __init__(self):
        super().__init__()
        self.staging_completion = Future()
        self.staging_completion.set_result(None)
        self.upload_completion = self


def _wrap_async_save(original, module):
    group_of = _group_reader(original)

    @functools.wraps(original)
    def async_save(state_dict, *args, **kwargs):
        if not isinstance(state_dict, Mapping):
            return original(state_dict, *args, **kwargs)
        # What async_save does first (_stateful_to_state_dict), done once here.
        plain, has, err = None, False, None
        try:
            plain = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state_dict.items()}
            has = bool(_views.tensors_over_dosd(plain))
        except Exception as e:  # noqa: BLE001 - voted on, then raised
            err = e
        vote = _vote(2 if err is not None else int(has), group_of(state_dict, args, kwargs))
        if vote == 2:
            raise err if err is not None else _other_rank()
        if not vote:
            return original(plain, *args, **kwargs)
        save = getattr(module, "save", None) or sys.modules[
            "torch.distributed.checkpoint"].save
        keep = {k: v for k, v in kwargs.items() if k in _SAVE_ARGS}
        done = _Saved()
        try:
            done.set_result(save(plain, *args, **keep))
        except Exception as err:  # as async_save's future would carry it
            done.set_exception(err)
        return done
    async_save._dos_wrapped = True
    return async_save


# async_save's arguments dcp.save also takes (not the executor's nor the stager's).
_SAVE_ARGS = ("checkpoint_id", "storage_writer", "planner", "process_group", "no_dist",
              "use_collectives")


def _is_stateful(v) -> bool:
    return (not isinstance(v, (torch.Tensor, Mapping, list, tuple))
            and callable(getattr(v, "state_dict", None))
            and callable(getattr(v, "load_state_dict", None)))


class _Stateful:
    """A Stateful value of the dict for the call: hands DCP the state dict
    asked for before the load (its views moved with the rest)."""

    def __init__(self, inner, moved: "_Moved"):
        self.inner, self.sd, self.moved = inner, inner.state_dict(), moved

    def state_dict(self):
        return self.sd

    def load_state_dict(self, state_dict) -> Any:
        # The views the load did not write go back before the value takes the
        # dict; the written keep theirs, for a failure later to move them back.
        self.moved.undo(unwritten_only=True, forget=False)
        return self.inner.load_state_dict(state_dict)


class _Moved:
    """The views one load moved onto a file: (tensor, its view, its file's tensor)."""

    def __init__(self, group):
        self._group = group
        self._moved: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, tensors: List[torch.Tensor], err: Optional[BaseException] = None) -> None:
        """Moves `tensors` (every view of the load) onto one file unless
        memory has room for them. The ranks decide together: each votes once,
        a refusal or an error on any rank (`err`: one the caller met first) is
        raised on all."""
        tensors = [t for t in tensors if t.numel() and t.element_size() in _MARK]
        sizes = [(t.numel() * t.element_size() + _PAGE - 1) // _PAGE * _PAGE for t in tensors]
        nbytes = sum(sizes)
        mm = None
        try:
            if err is None and tensors and not _carry.in_memory(nbytes, nbytes + _carry._MARGIN):
                f, _, tried = _carry.reserve(nbytes)
                if f is None:
                    raise DosError(Status.RESOURCE_EXHAUSTED, _refusal(nbytes, tried))
                with f:  # the mapping keeps the file (its blocks) until its tensors go
                    mm = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception as e:  # noqa: BLE001 - voted on, then raised
            err = e
        if _vote(int(err is not None), self._group):
            if mm is not None:
                mm.close()  # nothing over it yet: the file's blocks go now, not with a traceback
            raise err if err is not None else _other_rank()
        if mm is None:
            return
        at = 0
        with torch.no_grad():
            for t, size in zip(tensors, sizes):
                target = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=at)
                at += size
                _mark(target)
                self._moved.append((t, t.detach(), target))
                t.set_(target.view(t.shape))

    def undo(self, unwritten_only: bool = False, forget: bool = True) -> None:
        """Moves the views back onto dosd's memory: all, or those the load
        did not write; `forget`: the written ones' views are let go (else
        kept, for a failure later in the load to move them back too)."""
        keep = []
        with torch.no_grad():
            for t, view, target in self._moved:
                if unwritten_only and not _marked(target):
                    keep.append((t, None if forget else view, target))  # loaded
                    continue
                if view is not None and t.data_ptr() == target.data_ptr():
                    t.set_(view)
        self._moved = keep if unwritten_only else []


def _other_rank() -> DosError:
    return DosError(Status.RESOURCE_EXHAUSTED, (
        "dos.torch: another rank failed at the start of torch.distributed.checkpoint's call "
        "(no memory nor disk for its state dict's views, or an error: its own message says "
        "which); nothing was loaded or saved"))


def _mark(target: torch.Tensor) -> None:
    """Writes the mark into the first and last elements of a moved tensor."""
    kind, bits = _MARK[target.element_size()]
    target.view(kind)[::max(1, target.numel() - 1)].fill_(bits)


def _marked(target: torch.Tensor) -> bool:
    """True while both marks are there: the load did not write it (a loaded
    tensor would need exactly these two NaNs at both ends)."""
    kind, bits = _MARK[target.element_size()]
    return bool((target.view(kind)[::max(1, target.numel() - 1)] == bits).all())


def _refusal(nbytes: int, tried: str) -> str:
    gb = _carry._gb
    return (f"dos.torch: torch.distributed.checkpoint's load writes {gb(nbytes)} of "
            "optimizer state into the state dict's tensors, views of dosd's memory whose "
            "written pages become this process's own (a second copy beside dosd's); this "
            f"process has {gb(_carry.available_memory())} of memory available "
            f"({gb(nbytes + _carry._MARGIN)} needed) and no disk with room to take "
            f"the pages instead: {tried}. Set DOS_SPILL_DIR to a directory on a disk with "
            f"{gb(nbytes + _carry._DISK_MARGIN)} free (or DOS_SPILL=never to load "
            "into memory anyway). Nothing was loaded")
