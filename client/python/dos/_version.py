"""The package's version: the DOS release, one number for dosd, dosctl,
libdos_client and this package.

It is written once, in CMake's project(dos VERSION x.y.z) (top-level
CMakeLists.txt). An installed package reads the copy setup.py wrote into
dos/_build_info.py; a source checkout used through PYTHONPATH reads
CMakeLists.txt itself. This module imports nothing of dos (setup.py loads it
on its own).
"""

from __future__ import annotations

import os
import re

__all__ = ["__version__", "read_cmake_version"]

_PROJECT = re.compile(r"project\(\s*dos\s+VERSION\s+([0-9]+(?:\.[0-9]+)*)", re.I)


def read_cmake_version(path: str) -> str:
    """x.y.z from `project(dos VERSION x.y.z ...)` in the CMakeLists.txt at
    `path`; ValueError when it has none."""
    with open(path) as f:
        m = _PROJECT.search(f.read())
    if not m:
        raise ValueError(f"{path} has no `project(dos VERSION x.y.z)`")
    return m.group(1)


def _version() -> str:
    try:
        from dos._build_info import VERSION  # an installed package
        return VERSION
    except ImportError:
        pass
    cmake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                         "CMakeLists.txt")
    try:
        return read_cmake_version(cmake)
    except (OSError, ValueError):
        return "0+unknown"


__version__ = _version()
