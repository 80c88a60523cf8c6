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
as is) are wrapped for the call, so that the state dict they produce inside
the load is treated the same.

DCP's async_save stages (copies) the whole state dict into host memory
before its writer thread saves it: the state again, at 7B 81 GB. A state
dict holding views of dosd's memory is saved by dcp.save on the calling
thread instead, whole (no later step can change it meanwhile), and a
finished future is returned; others go to async_save as before.
"""

from __future__ import annotations

import bisect
import functools
import mmap
import sys
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from typing import Any, List, Tuple

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
# What a moved tensor's first element holds until the load writes it: a NaN
# no checkpoint holds in practice (torch's NaN is 0x7FC00000), by element size.
_MARK = {4: (torch.int32, 0x7FA5C3E1), 2: (torch.int16, 0x7FA5)}
_PAGE = 4096


def install() -> None:
    """Wraps DCP's load functions, where DCP is imported (never imports it:
    Debian's torch 1.13 cannot). Called when an optimizer is built and at each
    state_dict(): DCP imported later than both is not wrapped for its first
    load of a Stateful value (docs/frameworks.md)."""
    for module, name in _WRAPPED:
        mod = sys.modules.get(module)
        f = getattr(mod, name, None) if mod is not None else None
        if f is not None and not getattr(f, "_dos_wrapped", False):
            setattr(mod, name, (_wrap_async_save(f, mod) if name == "async_save" else
                                _wrap(f, stateful=name == "load")))


def _wrap(original, stateful: bool):
    """DCP's load (`stateful`: it calls the dict's Stateful values; the
    deprecated load_state_dict does not)."""
    @functools.wraps(original)
    def load(state_dict, *args, **kwargs):
        if not isinstance(state_dict, MutableMapping):
            return original(state_dict, *args, **kwargs)
        moved = _Moved(_group(kwargs))  # (no views alive yet: a Stateful value may make them)
        proxies = {k: _Stateful(v, moved) for k, v in state_dict.items()
                   if stateful and _is_stateful(v)}
        try:
            moved.add(views_in(state_dict))
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


def _group(kwargs) -> Any:
    """The load's process group: False for none (no_dist), None for the default."""
    return False if kwargs.get("no_dist") else kwargs.get("process_group")


def _any_rank(flag: bool, group) -> bool:
    """`flag` on any rank of the load's process group (every rank calls it,
    in the same order: DCP is SPMD), so that the ranks decide together: one
    rank refusing alone would leave the others waiting in DCP's collectives."""
    try:
        import torch.distributed as dist
        if group is False or not (dist.is_available() and dist.is_initialized()):
            return flag
        backend = str(dist.get_backend(group))
    except (ImportError, RuntimeError, ValueError):
        return flag
    on_gpu = "nccl" in backend and "cpu:" not in backend
    t = torch.tensor([int(flag)], device=torch.device("cuda", torch.cuda.current_device())
                     if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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
    @functools.wraps(original)
    def async_save(state_dict, *args, **kwargs):
        if not isinstance(state_dict, Mapping):
            return original(state_dict, *args, **kwargs)
        # What async_save does first (_stateful_to_state_dict), done once here.
        plain = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state_dict.items()}
        if not _any_rank(bool(views_in(plain)), _group(kwargs)):
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
    """A Stateful value of the dict for the call: the state dict it gives
    DCP has its views moved; the unwritten ones are moved back before it
    takes the loaded dict."""

    def __init__(self, inner, moved: "_Moved"):
        self.inner, self._moved = inner, moved

    def state_dict(self):
        sd = self.inner.state_dict()
        self._moved.add(views_in(sd))
        return sd

    def load_state_dict(self, state_dict) -> Any:
        self._moved.undo(unwritten_only=True, forget=False)  # all go back if this fails
        return self.inner.load_state_dict(state_dict)


def views_in(obj) -> List[torch.Tensor]:
    """The tensors over dosd's memory in the nested dicts, lists and tuples
    `obj` (a DTensor's local shard for a DTensor), each once."""
    spans = _views.ranges()
    if not spans:
        return []
    starts = [a for a, _ in spans]
    found, seen, todo = {}, set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            t = getattr(o, "_local_tensor", o)
            try:
                if t.device.type != "cpu" or t.layout != torch.strided or not t.numel():
                    continue
                p = t.data_ptr()
            except RuntimeError:  # no storage
                continue
            i = bisect.bisect_right(starts, p) - 1
            if i >= 0 and p < spans[i][1]:
                found[id(t)] = t
        elif isinstance(o, Mapping):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
    return list(found.values())


class _Moved:
    """The views one load moved onto files: (tensor, its view, its file's tensor)."""

    def __init__(self, group):
        self._group = group
        self._held = 0  # bytes of earlier batches left to write into memory
        self._moved: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, tensors: List[torch.Tensor]) -> None:
        """Moves `tensors` (a batch: the dict's, or a Stateful value's) onto
        one file unless memory has room for them beside the earlier batches;
        refuses on every rank when any rank has neither."""
        tensors = [t for t in tensors if t.numel() and t.element_size() in _MARK]
        sizes = [(t.numel() * t.element_size() + _PAGE - 1) // _PAGE * _PAGE for t in tensors]
        nbytes = sum(sizes)
        f, tried = None, ""
        try:
            if tensors and not _carry.in_memory(nbytes, self._held + nbytes + _carry._MARGIN):
                f, _, tried = _carry.reserve(nbytes)
                tried = tried or ""
            refused = bool(tensors) and f is None and tried != ""
            if _any_rank(refused, self._group):
                raise DosError(Status.RESOURCE_EXHAUSTED, _refusal(nbytes, tried) if refused else (
                    "dos.torch: another rank refused torch.distributed.checkpoint's load for "
                    "want of memory and disk (its error says which); nothing was loaded"))
        except BaseException:
            if f is not None:
                f.close()
            raise
        if f is None:
            self._held += nbytes
            return
        with f:  # the mapping keeps the file (and its reserved blocks) until its tensors go
            mm = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
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
