"""The lifetime of a dosd session in Python: who may detach it, and when.

A `SessionHandle` owns one `dos_session*`; `dos_detach` (which also frees the
shared-memory arena that CPU-mode parameters live in) runs exactly once, when
the last user of the handle is gone:
- the optimizer that attached it (and any object that frameworks make of it:
  PyTorch Lightning wraps the optimizer in an object whose class derives from
  the optimizer's and forwards attribute reads to it; such a wrapper shares
  the handle and, when collected, must not close the optimizer under it), and
- every tensor over the arena: the arena's ctypes object references the handle
  and `torch.frombuffer` views reference the arena, so a tensor kept from
  before `close()` (a state_dict entry, `p.data`) keeps the memory mapped
  instead of pointing into freed memory.

`close()` marks the handle closed (every view of the optimizer sees it) and
drops the optimizer's references; with nothing else holding it the handle is
detached at once, else when the last tensor over the arena goes.

A forked child (a `multiprocessing` worker started with fork, a notebook's
`os.fork()`) shares its parent's sessions and their sockets but owns none:
right after the fork every handle is marked closed in the child without a
detach, so that neither its exit nor its garbage collection closes the
parent's sessions, and the child's use of them raises an error naming the
owner.

At interpreter exit an `atexit` handler closes every optimizer still open,
while torch, CUDA and the client library are intact. Without it, optimizers
that the final garbage collection never reaches (reference cycles, objects
held by extension modules) would keep their gRPC channel and the library's
step watchdog thread alive while the process runs its C++ static destructors.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import weakref

from dos import _native
from dos._errors import DosError, check
from dos._native import Status

__all__ = ["SessionHandle", "closed_error", "track", "untrack"]


class SessionHandle:
    __slots__ = ("ptr", "closed", "owner_pid", "__weakref__")

    def __init__(self, ptr):
        self.ptr = ptr        # ctypes.c_void_p: the dos_session*
        self.closed = False   # close() was called: no more calls through it
        self.owner_pid = os.getpid()  # who attached it (a fork's child does not own it)
        _handles.add(self)

    def detach(self) -> None:
        """dos_detach, once, in the process that attached it; raises its error."""
        ptr, self.ptr = self.ptr, None
        self.closed = True
        if ptr is not None and self.owner_pid == os.getpid():
            check(_native.lib.dos_detach(ptr))

    def __del__(self):
        try:
            self.detach()
        except Exception:  # the daemon is gone, or the interpreter is shutting down
            pass


_open = weakref.WeakSet()  # optimizers not closed yet
_handles = weakref.WeakSet()  # every handle alive


def closed_error(what: str, reg) -> DosError:
    """Why a call `what` through a closed optimizer (its Registration `reg`,
    or None) cannot run, and the fix."""
    handle = getattr(reg, "handle", None)
    if handle is not None and handle.owner_pid != os.getpid():
        return DosError(Status.FAILED_PRECONDITION,
                        f"{what}: the optimizer belongs to process {handle.owner_pid}, and this "
                        f"process ({os.getpid()}) is a fork of it; a forked child cannot use its "
                        "parent's optimizer: build one in the child")
    return DosError(Status.FAILED_PRECONDITION, f"{what}: the optimizer is closed")


def _forget_in_child() -> None:
    for handle in list(_handles):
        handle.ptr = None  # the parent's: never detached from here
        handle.closed = True
    for opt in list(_open):  # nor its step in flight waited for (a reader hook would)
        flight = getattr(getattr(opt, "_parts", None), "flight", None)
        if flight is not None:
            flight.forget()
    _open.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def track(opt) -> None:
    _open.add(opt)


def untrack(opt) -> None:
    _open.discard(opt)


@atexit.register
def _close_all() -> None:
    for opt in list(_open):
        try:
            opt.close()
        except Exception:
            pass


def default_client_name() -> str:
    """The name a session attaches with when the optimizer is given none:
    the script's file name and, where it has arguments, a hash of them
    (`train.py-1f0c2a9b`). dosd's restart rule gives a relaunched job the
    autosaves of its (uid, name, rank): the same command line finds its own,
    and jobs of one script with different arguments (a sweep) never take
    each other's."""
    script = os.path.basename(sys.argv[0] or "python") if sys.argv else "python"
    if script in ("-c", "-"):  # python3 -c CODE, a script on stdin: no file name
        script = "python" + script
    args = sys.argv[1:]
    if not args:
        return script
    return f"{script}-{hashlib.sha256(chr(0).join(args).encode()).hexdigest()[:8]}"
