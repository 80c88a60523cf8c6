"""Fixtures for the Python client tests: a real dosd on a temporary socket.

Environment (set by tests/python/CMakeLists.txt under ctest):
  DOS_DOSD        path to the dosd binary (tests skip without it)
  DOS_CLIENT_LIB  path to libdos_client.so (read by dos._native)
"""

import contextlib
import faulthandler
import gc
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")

# Hangs are bounded and say where they are: each test (setup, call and
# teardown, session fixtures' teardown included) gets DOS_PYTEST_TIMEOUT
# seconds (default 300), and from session finish on (summary, atexit
# handlers, the final garbage collection) the process gets
# DOS_PYTEST_EXIT_TIMEOUT seconds (default 60) to exit. Past either,
# faulthandler prints every thread's Python stack and exits with status 1,
# instead of the run eating the CI or device time limit in silence.
TEST_TIMEOUT_S = float(os.environ.get("DOS_PYTEST_TIMEOUT", "300"))
EXIT_TIMEOUT_S = float(os.environ.get("DOS_PYTEST_EXIT_TIMEOUT", "60"))
_dump_file = None  # the real stderr (pytest captures fd 2 during tests)


def pytest_configure(config):
    global _dump_file
    capman = config.pluginmanager.getplugin("capturemanager")
    ctx = capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()
    with ctx:
        # Kept open until the process ends (closefd=False: no ResourceWarning).
        _dump_file = os.fdopen(os.dup(2), "w", closefd=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TEST_TIMEOUT_S > 0:
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_dump_file)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    # Not cancelled: interpreter finalization ends the timer (after atexit
    # handlers and the last collection, the places a session close runs).
    faulthandler.dump_traceback_later(EXIT_TIMEOUT_S, exit=True, file=_dump_file)
    # Optimizers that tests left in reference cycles are finalized (closed,
    # detached) here, under the timer and at a known point, rather than by
    # whichever collection happens to run while the summary is printed.
    gc.collect()


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
    # Checkpoints in the test's folder, never the user's or the system's
    # (a --checkpoint_dir in flags comes later and wins).
    proc = subprocess.Popen([binary, f"--socket={path}",
                             f"--checkpoint_dir={os.path.join(tmp, 'checkpoints')}", *flags],
                            stdout=log, stderr=subprocess.STDOUT)
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
        if running:
            # A clean stop leaves nothing behind: no socket, no lock file.
            left = sorted(set(os.listdir(tmp)) - {"dosd.log", "checkpoints"})
            assert not left, f"dosd left {left} in {tmp} after a clean stop"
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def dosd():
    """Starts dosd on a temporary socket for the whole session; yields the
    socket path."""
    with running_dosd() as (path, _proc):
        yield path


@pytest.fixture
def dos_socket(dosd):
    return dosd
