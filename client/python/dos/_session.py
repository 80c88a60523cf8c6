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

At interpreter exit an `atexit` handler closes every optimizer still open,
while torch, CUDA and the client library are intact. Without it, optimizers
that the final garbage collection never reaches (reference cycles, objects
held by extension modules) would keep their gRPC channel and the library's
step watchdog thread alive while the process runs its C++ static destructors.
"""

from __future__ import annotations

import atexit
import weakref

from dos import _native
from dos._errors import check

__all__ = ["SessionHandle", "track", "untrack"]


class SessionHandle:
    __slots__ = ("ptr", "closed", "__weakref__")

    def __init__(self, ptr):
        self.ptr = ptr        # ctypes.c_void_p: the dos_session*
        self.closed = False   # close() was called: no more calls through it

    def detach(self) -> None:
        """dos_detach, once; raises its error."""
        ptr, self.ptr = self.ptr, None
        self.closed = True
        if ptr is not None:
            check(_native.lib.dos_detach(ptr))

    def __del__(self):
        try:
            self.detach()
        except Exception:  # the daemon is gone, or the interpreter is shutting down
            pass


_open = weakref.WeakSet()  # optimizers not closed yet


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
