"""Registration progress in the trainer's log.

Registering a large shard takes seconds (a 6B model is ~72 GB of fp32 state
for dosd to allocate, fill and page-lock). While `dos_register` runs in the
calling thread (ctypes releases the GIL), a helper thread reads the progress
the daemon publishes in the session's control block
(`dos_register_progress_read`: no call into the daemon) and logs a line every
few seconds to the `dos` logger, e.g.

    dos: registering 71.9 GB of optimizer state: pinning 34.1 of 72.0 GB, 38.2 GB/s, 1 s left (5 s so far)

Lines go to logging.getLogger("dos") at INFO; when the program configured no
logging at all they go to stderr, so they are seen either way. Nothing is
logged for a registration that ends within the first interval.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from typing import Callable, TypeVar

from dos import _native

__all__ = ["with_progress", "format_progress"]

T = TypeVar("T")
log = logging.getLogger("dos")


def format_progress(p: "_native.RegisterProgress") -> str:
    name = (p.phase_name or b"").decode()
    line = f"{name} {p.bytes_done / 1e9:.1f} of {p.bytes_total / 1e9:.1f} GB"
    rate = p.bytes_done / p.phase_seconds if p.phase_seconds > 0 else 0.0
    if rate > 0:
        line += f", {rate / 1e9:.1f} GB/s"
        if p.bytes_total > p.bytes_done:
            line += f", {(p.bytes_total - p.bytes_done) / rate:.0f} s left"
    return line + f" ({p.total_seconds:.0f} s so far)"


def _emit(msg: str) -> None:
    if logging.getLogger().hasHandlers() or log.hasHandlers():
        log.info(msg)
    else:
        print(f"dos: {msg}", file=sys.stderr, flush=True)


def with_progress(session, what: str, fn: Callable[[], T], interval: float = 2.0) -> T:
    """Runs fn() (which calls dos_register on `session`) and logs the
    daemon's progress every `interval` seconds until it returns."""
    done = threading.Event()
    start = time.monotonic()
    logged = []

    def watch():
        p = _native.RegisterProgress()
        while not done.wait(interval):
            if _native.lib.dos_register_progress_read(session, ctypes.byref(p)) != 0:
                return
            if p.phase != 0:
                _emit(f"registering {what}: {format_progress(p)}")
                logged.append(True)

    t = threading.Thread(target=watch, name="dos-register-progress", daemon=True)
    t.start()
    try:
        return fn()
    finally:
        done.set()
        t.join()
        if logged:
            _emit(f"registered {what} in {time.monotonic() - start:.1f} s")
