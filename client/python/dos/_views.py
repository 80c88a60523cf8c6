"""Zero-copy views of the optimizer state held by dosd.

state_dict() at 7B must not copy 81 GB of fp32 state into the trainer. dosd
keeps each session's state in a memfd and hands its owner a read-only
descriptor of it with a map of where each tensor's state lies
(dos_state_views_fetch); dos_state_view_map maps one tensor's master,
exp_avg or exp_avg_sq as one contiguous range over dosd's pages. A tensor
made here from such a range (torch.frombuffer) costs no host memory of the
trainer's own (the pages are dosd's: RssShmem, not RssAnon), so torch.save
streams the state from dosd's memory to the file.

Like torch's own state tensors, a view shows later steps (dosd updates the
pages in place); a write into it changes only the writer's private copy of
that page, never dosd's state (load_state_dict() is the way to change it).
The mapping is released when the last tensor over it is freed. Small tensors
(under 64 Ki elements), and every tensor of a small optimizer (under 1 Mi
parameters in all), are not page-aligned in dosd and come back as copies.

While any view (or copy handed out in a state dict) is alive, step()
returns only once the step is finished, so a framework that still holds a
state dict never reads a half-updated one; the copies then take each
step's values (refresh), as the views show them.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import weakref
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch

from dos._errors import DosError, call, check
from dos._native import StateView, Status, lib

__all__ = ["fetch", "read", "step_of", "view", "live", "refresh", "forget", "is_view_of",
           "over_dosd", "ranges", "tensors_over_dosd"]

_lock = threading.RLock()  # _release (a finalizer) may run under it
_live = 0
# Address of a live view -> (session identity, tensor index, array, bytes
# mapped): lets load_state_dict() see that it is handed the state it already
# holds.
_origins: Dict[int, Tuple[Tuple[int, int], int, int, int]] = {}
# Sessions whose state dosd could not share (fetch() answered 0).
_unshared: set = set()


def _release(addr: int, map_bytes: int) -> None:
    global _live
    with _lock:
        _live -= 1
        _origins.pop(addr, None)
    lib.dos_state_view_unmap(ctypes.c_void_p(addr), ctypes.c_uint64(map_bytes))


def _address(session) -> Tuple[int, int]:
    """The session's identity in this process: its dos_session* with dosd's
    session id (a pointer alone is reused by the next session after a
    detach frees it)."""
    ptr = int(getattr(session, "value", session) or 0)
    return ptr, int(lib.dos_session_id(session)) if ptr else 0


def live() -> int:
    """Views alive now, and copies handed out in state dicts still held (all
    sessions of this process): while any is, steps are whole when step()
    returns and the delay pauses (dos/_delay.py)."""
    return _live + len(_handed)


def forget(session) -> None:
    """`session` is closing: its copies still held keep their values, count
    no more in live() and are no longer its state (handed())."""
    addr = _address(session)
    for key, t in list(_handed.items()):
        if t._dos_handed[0] == addr:
            _handed.pop(key, None)


def refresh(session) -> None:
    """After a whole step of `session`: its copies still held in state dicts,
    unchanged since (a user's write keeps its values), take the step's values,
    as views (and torch's own state tensors) show them, so that a state dict
    kept across a step shows that step whole, not its large tensors' and
    another's of small ones. Views alive show dosd's host arrays, which a
    GPU session's resident subgroups update only when dosd brings them home:
    the fetch below has it do so after each step while any view is alive."""
    if not session or not (_handed or _origins):
        return  # nothing held: the common step pays nothing here
    addr = _address(session)
    with _lock:
        viewed = any(o[0] == addr for o in _origins.values())
    if not _handed and not viewed:
        return
    by_index: Dict[int, list] = {}
    for t in list(_handed.values()):
        tag = t._dos_handed
        if tag[0] == addr and torch.equal(t, tag[3]):
            by_index.setdefault(tag[1], []).append(t)
    if viewed or any(all(t._dos_handed[2] == "step" for t in ts) for ts in by_index.values()):
        fetch(session)  # resident state home; the step counts, in one request (step_of)
    for index, ts in by_index.items():
        arrays = [t for t in ts if t._dos_handed[2] != "step"]
        if arrays:  # small tensors' copies: read whole (with the step)
            buf, step = read(session, index, arrays[0].numel())
        else:  # only the step count (the map's, where dosd shares it)
            step = step_of(session, index)
        with torch.no_grad():
            for t in ts:
                w = t._dos_handed[2]
                if w == "step":
                    t.fill_(float(step))
                else:
                    t.copy_(buf[w].view(t.shape))
                t._dos_handed = t._dos_handed[:3] + (t.clone(),)


# Tensors handed out in a state dict as copies (small tensors' moments, the
# step counts), by identity: a deep copy, a clone or a torch.load() of one is
# another object, whatever attributes it carries.
_handed: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def hand_out(t: torch.Tensor, session, index: int, which) -> torch.Tensor:
    """Marks `t`, a copy of tensor `index`'s array `which` (or its step
    count) put in a state dict, so that handed knows it while it holds what
    it held then (compared whole: writes through .data or numpy() move no
    version counter; these copies are small)."""
    t._dos_handed = (_address(session), index, which, t.clone())
    _handed[id(t)] = t
    return t


def handed(t, session, index: int, which) -> bool:
    """True if `t` is hand_out's very tensor for that array, unchanged."""
    tag = getattr(t, "_dos_handed", None)
    return (tag is not None and _handed.get(id(t)) is t and
            tag[:3] == (_address(session), index, which) and torch.equal(t, tag[3]))


def is_view_of(t, session, index: int, which: int) -> bool:
    """True if `t` is a view made here of tensor `index`'s array `which` of
    `session` (what load_state_dict() of a state dict just taken gets)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    o = _origins.get(t.data_ptr())
    if o is None or o[:3] != (_address(session), index, which):
        return False
    modified = ctypes.c_int32()
    call("dos_state_view_modified", ctypes.c_void_p(t.data_ptr()), ctypes.c_uint64(o[3]),
         ctypes.byref(modified))
    return not modified.value  # written into: the caller's values, to be loaded


def ranges() -> List[Tuple[int, int]]:
    """(start, end) of every live view's mapping, sorted."""
    with _lock:
        return sorted((a, a + o[3]) for a, o in _origins.items())


def _local_over(t, spans: List[Tuple[int, int]], starts: List[int]):
    """`t`'s local tensor (a DTensor's shard: FSDP2 state) where it lies in
    one of `spans` (ranges(); `starts` their starts), else None."""
    try:
        t = getattr(t, "_local_tensor", t)
        if t.device.type != "cpu" or t.layout != torch.strided:
            return None  # sparse and other tensors without one storage
        p = t.data_ptr()
    except Exception:  # noqa: BLE001 - no storage, a subclass that will not say
        return None
    i = bisect.bisect_right(starts, p) - 1
    return t if i >= 0 and p < spans[i][1] else None


def over_dosd(t) -> bool:
    """True if `t` lies in a view of dosd's memory made here (a state dict's
    large tensor: steps change it in place, and a copy of it is the copy
    of the state that views exist to avoid)."""
    if not isinstance(t, torch.Tensor) or not _origins:
        return False
    spans = ranges()
    return _local_over(t, spans, [a for a, _ in spans]) is not None


def tensors_over_dosd(obj) -> List[torch.Tensor]:
    """The non-empty tensors over dosd's memory in the nested dicts, lists
    and tuples `obj` (a checkpoint, a state dict; a DTensor's local shard for
    a DTensor), each once: one snapshot of the views, bisected per tensor."""
    spans = ranges()
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
            t = _local_over(o, spans, starts)
            if t is not None and t.numel():
                found[id(t)] = t
        elif isinstance(o, Mapping):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
    return list(found.values())


def fetch(session) -> int:
    """Asks dosd for the session's state map now; returns the bytes of a
    moment element (4, or 2 in compact format), or 0 where dosd cannot share
    the state (its log says why): then view() returns None (copies)."""
    moment = ctypes.c_uint32()
    rc = lib.dos_state_views_fetch(session, None, ctypes.byref(moment))
    if rc == Status.FAILED_PRECONDITION:
        _unshared.add(_address(session))
        return 0
    check(rc)
    _unshared.discard(_address(session))
    return int(moment.value)


def read(session, index: int, numel: int, master: bool = True):
    """Tensor `index`'s arrays copied into a new CPU fp32 [3, numel] buffer
    (master, exp_avg, exp_avg_sq; row 0 left unwritten without `master`)
    and its step count, in one request."""
    buf = torch.empty(3, numel, dtype=torch.float32)
    step = ctypes.c_int64()
    call("dos_state_read", session, ctypes.c_uint32(index),
         buf[0].data_ptr() if master else None, buf[1].data_ptr(), buf[2].data_ptr(),
         ctypes.byref(step))
    return buf, int(step.value)


def step_of(session, index: int) -> int:
    step = ctypes.c_int64()
    if _address(session) in _unshared:
        call("dos_state_read", session, ctypes.c_uint32(index), None, None, None,
             ctypes.byref(step))
    else:
        call("dos_state_view_step", session, ctypes.c_uint32(index), ctypes.byref(step))
    return int(step.value)


def view(session, index: int, which: int, dtype: torch.dtype,
         shape: torch.Size) -> Optional[torch.Tensor]:
    """Tensor `index`'s array `which` (0 master, 1 exp_avg, 2 exp_avg_sq) as
    a tensor over dosd's memory, or None where it cannot be mapped."""
    global _live
    if _address(session) in _unshared:
        return None
    v = StateView()
    rc = lib.dos_state_view_map(session, ctypes.c_uint32(index), ctypes.c_int32(which),
                                ctypes.byref(v))
    if rc == Status.FAILED_PRECONDITION:
        return None
    check(rc)
    addr, map_bytes = int(v.addr), int(v.map_bytes)
    buf = (ctypes.c_uint8 * map_bytes).from_address(addr)
    with _lock:
        _live += 1
        _origins[addr] = (_address(session), index, which, map_bytes)
    weakref.finalize(buf, _release, addr, map_bytes)
    if int(v.numel) == 0:
        raise DosError(Status.INTERNAL, "state view of an empty tensor")
    # Shaped in place, not a view of a base: a tensor set_() onto other
    # storage (dos/_dcp.py) then lets the mapping go.
    flat = torch.frombuffer(buf, dtype=dtype, count=int(v.numel))
    try:
        return flat.resize_(shape)
    except RuntimeError:  # (a torch that will not: a view, which keeps the mapping longer)
        return flat.view(shape)
