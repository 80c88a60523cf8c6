"""Finding and loading libdos_client.so: the one place that decides which
library the package uses.

The package is pure Python: it loads the C library at import time and never
compiles against torch, so one copy works with any torch and Python 3.11+.

Search order (find_library() returns the first that loads):
  1. $DOS_CLIENT_LIB, a path to libdos_client.so; when set, nothing else is
     tried (an override must not fall back silently)
  2. libdos_client.so next to this package (a wheel or folder that bundles it)
  3. the system's library, by its soname: what the `dos` Debian package
     installs (/usr/lib/<multiarch>/libdos_client.so.1), found through the
     ldconfig cache (ctypes.util.find_library), then through the dynamic
     linker's own search (LD_LIBRARY_PATH, the default paths)
  4. the build trees of a source checkout, for developers: <repo>/build/
     client/src, then <repo>/build*/client/src in sorted order; only when
     the package is imported from a checkout (<repo>/client/python/dos), and
     only the build trees that exist (an installed copy has none to offer)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from typing import Iterator, List, Tuple

__all__ = ["find_library", "candidates", "loaded_path", "SONAME"]

# libdos_client's soname: CMake's DOS_CLIENT_SOVERSION. It changes only with
# an incompatible change of dos.h, and then this package changes with it.
SONAME = "libdos_client.so.1"


def candidates() -> Iterator[Tuple[str, str]]:
    """(path or soname, where it comes from), in the order tried."""
    env = os.environ.get("DOS_CLIENT_LIB")
    if env:
        yield env, "$DOS_CLIENT_LIB"
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libdos_client.so"), "next to the package"
    found = ctypes.util.find_library("dos_client")
    if found:
        yield found, "the system's library path (ldconfig, LD_LIBRARY_PATH)"
    yield SONAME, "the dynamic linker's search path"
    repo = _checkout_root(here)
    if repo is None:
        return
    builds = [os.path.join(repo, "build", "client", "src", "libdos_client.so")]
    builds += sorted(glob.glob(os.path.join(repo, "build*", "client", "src", "libdos_client.so")))
    for b in dict.fromkeys(builds):
        if os.path.exists(b):
            yield b, "a build tree of this checkout"


def _checkout_root(here: str):
    """The source checkout this package lies in (`here` is <repo>/client/
    python/dos), or None for an installed copy (site-packages)."""
    python = os.path.dirname(here)
    repo = os.path.dirname(os.path.dirname(python))
    if (os.path.basename(python) == "python" and
            os.path.basename(os.path.dirname(python)) == "client" and
            os.path.isfile(os.path.join(repo, "CMakeLists.txt")) and
            os.path.isfile(os.path.join(python, "pyproject.toml"))):
        return repo
    return None


def find_library() -> ctypes.CDLL:
    """Loads libdos_client from the first candidate that loads (see the top
    of this module). Raises ImportError naming every candidate tried and how
    to fix it."""
    lib, _, tried = _find()
    if lib is None:
        raise ImportError(
            "dos: cannot load libdos_client.so; tried " + "; ".join(tried) +
            ". Install the dos Debian package (it ships libdos_client.so.1), build it "
            "(cmake --build build --target dos_client), or set DOS_CLIENT_LIB to its path.")
    return lib


def _find():
    """(CDLL or None, where it came from, what was tried)."""
    tried: List[str] = []
    for path, source in candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(f"{path} ({source}: no such file)")
            continue
        try:
            return ctypes.CDLL(path), source, tried
        except OSError as e:
            tried.append(f"{path} ({source}: {e})")
    return None, "", tried


def loaded_path(lib: ctypes.CDLL) -> str:
    """The file the dynamic linker mapped for `lib` (resolves sonames)."""
    name = os.path.basename(getattr(lib, "_name", "") or "") or "libdos_client"
    stem = name.split(".so")[0]
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[5]).startswith(stem + ".so"):
                    return parts[5]
    except OSError:
        pass
    return getattr(lib, "_name", "")
