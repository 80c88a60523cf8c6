"""Finding and loading libdos_client.so: the one place that decides which
library the package uses.

The package is pure Python: it loads the C library at import time and never
compiles against torch, so one copy works with any torch and Python 3.11+.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Iterator

__all__ = ["find_library", "candidates"]


def candidates() -> Iterator[str]:
    """The paths (or sonames) tried, in order; see find_library()."""
    env = os.environ.get("DOS_CLIENT_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libdos_client.so")
    repo = os.path.abspath(os.path.join(here, "..", "..", ".."))
    yield os.path.join(repo, "build", "client", "src", "libdos_client.so")
    yield from sorted(glob.glob(os.path.join(repo, "build*", "client", "src", "libdos_client.so")))
    yield "libdos_client.so.1"


def find_library() -> ctypes.CDLL:
    """Loads libdos_client; the first candidate that loads wins:

      1. $DOS_CLIENT_LIB (path to libdos_client.so); when set, nothing else
         is tried
      2. libdos_client.so next to this package (installed wheels / bundles)
      3. the build trees of a source checkout: <repo>/build/client/src, then
         <repo>/build*/client/src in sorted order
      4. the dynamic linker's search path (ldconfig, LD_LIBRARY_PATH) for
         libdos_client.so.1

    Raises ImportError naming every path tried and how to fix it."""
    tried = []
    for path in candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
    raise ImportError(
        "dos: cannot load libdos_client.so; tried " + ", ".join(tried) +
        ". Build it (cmake --build build --target dos_client) or set DOS_CLIENT_LIB to its path.")
