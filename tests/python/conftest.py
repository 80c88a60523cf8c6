"""Fixtures for the Python client tests: a real dosd on a temporary socket.

Environment (set by tests/python/CMakeLists.txt under ctest):
  DOS_DOSD        path to the dosd binary (tests skip without it)
  DOS_CLIENT_LIB  path to libdos_client.so (read by dos._native)
"""

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")


def _wait_for_socket(path, proc, deadline):
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dosd exited with code {proc.returncode} before listening")
        if os.path.exists(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.02)
    raise TimeoutError(f"dosd did not accept connections on {path} within the deadline")


@contextlib.contextmanager
def running_dosd(*flags, killed_ok=False):
    """A dosd of its own on a temporary socket: yields (socket path, Popen).
    At the end SIGTERM must make it exit 0; with killed_ok, a daemon that the
    test already stopped or killed is not checked."""
    binary = os.environ.get("DOS_DOSD")
    if not binary or not os.path.exists(binary):
        pytest.skip("DOS_DOSD does not name a dosd binary")
    tmp = tempfile.mkdtemp(prefix="dos-pytest-")
    path = os.path.join(tmp, "dosd.sock")
    log = open(os.path.join(tmp, "dosd.log"), "w+")
    proc = subprocess.Popen([binary, f"--socket={path}", *flags], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        _wait_for_socket(path, proc, time.monotonic() + 20)
        yield path, proc
    finally:
        running = proc.poll() is None
        if running:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = "timeout"
        else:
            code = proc.returncode
        log.seek(0)
        text = log.read()
        log.close()
        if running or not killed_ok:
            assert code == 0, f"dosd exited with {code} after SIGTERM; its log:\n{text[-4000:]}"


@pytest.fixture(scope="session")
def dosd():
    """Starts dosd on a temporary socket for the whole session; yields the
    socket path."""
    with running_dosd() as (path, _proc):
        yield path


@pytest.fixture
def dos_socket(dosd):
    return dosd
