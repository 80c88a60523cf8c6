"""Build script: the package's metadata is in pyproject.toml; this file only
supplies the version, from the one place it is written.

The version is CMake's project(dos VERSION x.y.z) in the repository's
top-level CMakeLists.txt (two folders up). It goes into the wheel as
dos/_build_info.py, which dos/_version.py reads once installed. Built from an
sdist (no CMakeLists.txt beside it), the version comes from its PKG-INFO.
"""

import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _version_module():
    spec = importlib.util.spec_from_file_location(
        "_dos_version", os.path.join(HERE, "dos", "_version.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # standalone: imports nothing of dos
    return mod


def _version():
    cmake = os.path.join(HERE, "..", "..", "CMakeLists.txt")
    if os.path.exists(cmake):
        return _version_module().read_cmake_version(cmake)
    pkg_info = os.path.join(HERE, "PKG-INFO")
    if os.path.exists(pkg_info):
        with open(pkg_info) as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    raise RuntimeError(
        "dos-optimizer: cannot find the version: build from a DOS checkout (client/python, "
        "with CMakeLists.txt two folders up) or from an sdist")


VERSION = _version()


class BuildPy(build_py):
    """Also writes dos/_build_info.py (the version) into the build."""

    def run(self):
        super().run()
        path = os.path.join(self.build_lib, "dos", "_build_info.py")
        with open(path, "w") as f:
            f.write('"""Written by setup.py at build time; do not edit."""\n')
            f.write(f"VERSION = {VERSION!r}\n")


setup(version=VERSION, cmdclass={"build_py": BuildPy})
