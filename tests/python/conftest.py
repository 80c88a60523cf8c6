"""Fixtures for the Python client tests: a real dosd on a temporary socket.

Environment (set by tests/python/CMakeLists.txt under ctest):
  DOS_DOSD        path to the dosd binary (tests skip without it)
  DOS_CLIENT_LIB  path to libdos_client.so (read by dos._native)
"""

import os
import shutil
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


@pytest.fixture(scope="session")
def dosd():
    """Starts dosd on a temporary socket; yields the socket path. At the end,
    SIGTERM must make it exit 0."""
    binary = os.environ.get("DOS_DOSD")
    if not binary or not os.path.exists(binary):
        pytest.skip("DOS_DOSD does not name a dosd binary")
    tmp = tempfile.mkdtemp(prefix="dos-pytest-")
    path = os.path.join(tmp, "dosd.sock")
    log = open(os.path.join(tmp, "dosd.log"), "w+")
    # Checkpoints in the test's folder, never the user's or the system's.
    proc = subprocess.Popen([binary, f"--socket={path}",
                             f"--checkpoint_dir={os.path.join(tmp, 'checkpoints')}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_socket(path, proc, time.monotonic() + 20)
        yield path
    finally:
        if proc.poll() is None:
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
        assert code == 0, f"dosd exited with {code} after SIGTERM; its log:\n{text[-4000:]}"
        # A clean stop leaves nothing behind: no socket, no lock file.
        left = sorted(set(os.listdir(tmp)) - {"dosd.log", "checkpoints"})
        assert not left, f"dosd left {left} in {tmp} after a clean stop"
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def dos_socket(dosd):
    return dosd
