"""The Python package as a user installs and checks it.

Environment (tests/python_package/CMakeLists.txt): DOS_DOSD, DOS_CLIENT_LIB
(the built library), DOS_REPO (the checkout). Every subprocess that plays a
user runs outside the checkout with PYTHONPATH cleared, so it sees only what
was installed.
"""

import ctypes
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest

REPO = os.environ.get("DOS_REPO", os.path.join(os.path.dirname(__file__), "..", ".."))
LIB = os.environ.get("DOS_CLIENT_LIB", "")
DOSD = os.environ.get("DOS_DOSD", "")


def _cmake_version():
    from dos._version import read_cmake_version
    return read_cmake_version(os.path.join(REPO, "CMakeLists.txt"))


def _user_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DOS_CLIENT_LIB", "DOS_SOCKET", "LD_LIBRARY_PATH")}
    env.update(extra)
    return env


def _run(cmd, env, cwd, timeout=300):
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dosd():
    if not DOSD or not os.path.exists(DOSD):
        pytest.skip("DOS_DOSD does not name a dosd binary")
    tmp = tempfile.mkdtemp(prefix="dos-pkg-")
    path = os.path.join(tmp, "dosd.sock")
    log = open(os.path.join(tmp, "dosd.log"), "w+")
    proc = subprocess.Popen([DOSD, f"--socket={path}", "--checkpoint_dir="], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, "dosd exited before listening"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            break
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    try:
        yield path
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_one_version_everywhere(dosd):
    """CMake's project(VERSION), dos.__version__, the library and dosd agree."""
    import dos
    from dos import _native
    want = _cmake_version()
    assert dos.__version__ == want
    info = _native.DaemonInfo()
    assert _native.lib.dos_daemon_probe(dosd.encode(), 5000, ctypes.byref(info)) == 0, \
        _native.lib.dos_last_error()
    assert info.client_version.decode() == want
    assert info.version.decode() == want
    assert info.protocol_version == info.client_protocol_version
    if hasattr(_native.lib, "dos_version"):
        _native.lib.dos_version.restype = ctypes.c_char_p
        assert _native.lib.dos_version().decode() == want
    out = _run([DOSD, "--version"], _user_env(), tempfile.gettempdir())
    if "NDEBUG" in out.stdout:  # abseil's default text: dosd does not print its own yet
        pytest.xfail("dosd --version does not print the release yet")
    assert want in out.stdout + out.stderr


def test_python_m_dos_reports_a_healthy_daemon(dosd):
    r = _run([sys.executable, "-m", "dos", "--socket", dosd],
             _user_env(DOS_CLIENT_LIB=LIB, PYTHONPATH=os.path.join(REPO, "client", "python")),
             tempfile.gettempdir())
    assert r.returncode == 0, r.stdout + r.stderr
    v = _cmake_version()
    assert f"dos-optimizer {v}" in r.stdout
    assert f"release {v}" in r.stdout and "$DOS_CLIENT_LIB" in r.stdout
    assert f"{dosd}: dosd {v}" in r.stdout and "SERVING" in r.stdout
    assert "ok:" in r.stdout


def test_python_m_dos_names_what_is_wrong(tmp_path):
    env = _user_env(DOS_CLIENT_LIB=LIB, PYTHONPATH=os.path.join(REPO, "client", "python"))
    # No daemon: no socket at all.
    r = _run([sys.executable, "-m", "dos", "--socket", str(tmp_path / "none.sock")], env,
             str(tmp_path))
    assert r.returncode == 1
    assert "NOT REACHED" in r.stdout and "start the daemon" in r.stdout, r.stdout
    # A stale socket: bound, nobody listening (a killed daemon's).
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    try:
        r = _run([sys.executable, "-m", "dos", "--socket", stale, "--timeout", "2"], env,
                 str(tmp_path))
    finally:
        s.close()
    assert r.returncode == 1
    assert "does not answer" in r.stdout and "restart dosd" in r.stdout, r.stdout
    # No library.
    env["DOS_CLIENT_LIB"] = str(tmp_path / "libdos_client.so")
    r = _run([sys.executable, "-m", "dos"], env, str(tmp_path))
    assert r.returncode == 1
    assert "NOT FOUND" in r.stdout and "DOS_CLIENT_LIB" in r.stdout, r.stdout


@pytest.fixture(scope="module")
def source_copy():
    """client/python and the top-level CMakeLists.txt (the version's home)
    copied out, so builds leave the checkout untouched."""
    tmp = tempfile.mkdtemp(prefix="dos-pkg-src-")
    shutil.copy(os.path.join(REPO, "CMakeLists.txt"), tmp)
    shutil.copytree(os.path.join(REPO, "client", "python"), os.path.join(tmp, "client", "python"),
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "examples"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_wheel_and_pip_install_in_a_fresh_venv(tmp_path, source_copy, dosd):
    """As CI's users: a venv with the system's packages, installing offline,
    once from a built wheel and once from the source folder; the installed
    package finds the library by soname (here on LD_LIBRARY_PATH, as the
    Debian package's /usr/lib/<multiarch> would be) with no DOS_ variable."""
    pkg = os.path.join(source_copy, "client", "python")
    env = _user_env()
    want = _cmake_version()
    wheels = tmp_path / "wheels"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-index",
              "--no-deps", "-w", str(wheels), pkg], env, str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = glob.glob(str(wheels / "dos_optimizer-*.whl"))
    assert os.path.basename(wheel).startswith(f"dos_optimizer-{want}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("dos/_build_info.py").decode().strip().endswith(f"VERSION = {want!r}")
        assert "dos/__main__.py" in z.namelist() and "dos/torch.py" in z.namelist()

    venv = tmp_path / "venv"
    r = _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], env,
             str(tmp_path))
    assert r.returncode == 0, r.stderr
    py = str(venv / "bin" / "python")
    libdir = os.path.dirname(os.path.realpath(LIB))
    check = [py, "-c", "import dos, dos._native as n, dos._lib as l; "
             "print(dos.__version__, dos.__file__, l.loaded_path(n.lib))"]
    for source in (wheel, pkg):
        r = _run([py, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps",
                  "--force-reinstall", source], env, str(tmp_path))
        assert r.returncode == 0, r.stdout + r.stderr
        r = _run(check, _user_env(LD_LIBRARY_PATH=libdir), str(tmp_path))
        assert r.returncode == 0, r.stderr
        version, where, lib = r.stdout.split()
        assert version == want
        assert where.startswith(str(venv)), where  # the installed copy, not the checkout
        assert os.path.realpath(lib) == os.path.realpath(LIB)
        r = _run([py, "-m", "dos", "--socket", dosd], _user_env(LD_LIBRARY_PATH=libdir),
                 str(tmp_path))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "dynamic linker" in r.stdout or "ldconfig" in r.stdout, r.stdout


def test_registration_progress_is_logged(dosd, caplog):
    """dos._progress logs the daemon's progress while dos_register runs."""
    import logging
    from dos import _native, _progress
    from dos._errors import call
    opts = _native.AttachOptions()
    _native.lib.dos_attach_options_init(ctypes.byref(opts))
    opts.socket_path = dosd.encode()
    opts.client_name = b"test_package"
    session = ctypes.c_void_p()
    call("dos_attach", ctypes.byref(opts), ctypes.byref(session))
    try:
        n = 24 << 20  # 288 MiB of state: long enough on any machine for a 1 ms interval
        p, g = ctypes.c_void_p(), ctypes.c_void_p()
        call("dos_buffer_alloc", session, n * 2, ctypes.byref(p))
        call("dos_buffer_alloc", session, n * 2, ctypes.byref(g))
        t = (_native.Tensor * 1)()
        t[0].name, t[0].param_dtype, t[0].param = b"w", _native.DTYPE_BF16, p.value
        t[0].grad_dtype, t[0].grad, t[0].numel, t[0].group = _native.DTYPE_BF16, g.value, n, 0
        h = (_native.Hparams * 1)()
        _native.lib.dos_hparams_init_adamw(h)
        start = time.monotonic()
        # caplog's handler sits on the root logger, so lines go to logging.
        with caplog.at_level(logging.INFO, logger="dos"):
            _progress.with_progress(session, "0.3 GB of optimizer state",
                                    lambda: call("dos_register", session, t, 1, h, 1, None),
                                    interval=0.001)
        took = time.monotonic() - start
        lines = [r.getMessage() for r in caplog.records if r.name == "dos"]
        if took > 0.2:  # a sample surely fell inside the registration
            assert any(m.startswith("registering 0.3 GB of optimizer state: ") and " of " in m
                       and "GB" in m and "s so far" in m for m in lines), lines
            assert lines[-1].startswith("registered 0.3 GB of optimizer state in "), lines
        after = _native.RegisterProgress()
        call("dos_register_progress_read", session, ctypes.byref(after))
        assert after.phase == 0
    finally:
        _native.lib.dos_detach(session)


def test_format_progress():
    from dos import _native, _progress
    p = _native.RegisterProgress(phase=3, phase_name=b"pinning", bytes_done=34_100_000_000,
                                 bytes_total=72_000_000_000, phase_seconds=1.0,
                                 total_seconds=5.2)
    assert _progress.format_progress(p) == \
        "pinning 34.1 of 72.0 GB, 34.1 GB/s, 1 s left (5 s so far)"
