"""The README's Python install, run exactly as written (ctest
python_readme_install): the indented lines after "**Python package.**" run in
bash, in a copy of the checkout, with HOME a fresh folder (so ~/venv is new),
no package index reachable (pip's index points nowhere) and another `python3`
first on PATH that cannot import torch, as on a machine with conda or pyenv.

Environment (tests/python_package/CMakeLists.txt): DOS_DOSD, DOS_CLIENT_LIB
(the built library; its folder plays the Debian package's /usr/lib), DOS_REPO.
"""

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

REPO = os.environ.get("DOS_REPO", os.path.join(os.path.dirname(__file__), "..", ".."))
LIB = os.environ.get("DOS_CLIENT_LIB", "")
DOSD = os.environ.get("DOS_DOSD", "")


def readme_lines():
    """The indented block after the "**Python package.**" paragraph."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read().split("\n")
    start = next(i for i, l in enumerate(text) if l.startswith("**Python package.**"))
    i = start
    while not text[i].startswith("    "):
        i += 1
    lines = []
    while i < len(text) and (text[i].startswith("    ") or not text[i].strip()):
        if text[i].strip():
            lines.append(text[i][4:])
        i += 1
    return lines


@pytest.fixture
def dosd(tmp_path):
    if not DOSD or not os.path.exists(DOSD):
        pytest.skip("DOS_DOSD does not name a dosd binary")
    path = str(tmp_path / "dosd.sock")
    log = open(tmp_path / "dosd.log", "w+")
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
    yield path
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)
    log.close()


def test_readme_python_install_as_written(tmp_path, dosd):
    lines = readme_lines()
    assert lines[0].startswith("/usr/bin/python3 -m venv"), lines
    assert any(l.startswith("pip install ") for l in lines), lines
    assert lines[-1].startswith("python -m dos"), lines
    # The checkout as a user has it (without build trees: the library comes
    # from the system's path, as the dos Debian package installs it).
    work = tmp_path / "checkout"
    shutil.copytree(os.path.join(REPO, "client", "python"), work / "client" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    shutil.copy(os.path.join(REPO, "CMakeLists.txt"), work)
    home = tmp_path / "home"
    home.mkdir()
    # Another python3 first on PATH, which cannot import torch.
    other = tmp_path / "other-bin"
    other.mkdir()
    (other / "python3").write_text("#!/bin/sh\necho 'not Debian python3' >&2\nexit 1\n")
    (other / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DOS_CLIENT_LIB", "VIRTUAL_ENV", "PIP_INDEX_URL",
                        "PIP_FIND_LINKS", "PIP_NO_INDEX")}
    env.update(HOME=str(home), PATH=f"{other}:/usr/local/bin:/usr/bin:/bin", DOS_SOCKET=dosd,
               LD_LIBRARY_PATH=os.path.dirname(os.path.realpath(LIB)),
               # No package index: any download would fail at once.
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], cwd=work, env=env,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert glob.glob(str(home / "venv" / "lib" / "python3*" / "site-packages" / "dos" /
                         "__init__.py")), out
    assert glob.glob(str(work / "dist" / "dos_optimizer-*-py3-none-any.whl")), out
    # python -m dos: the installed copy, a reachable dosd, and only search
    # paths that exist for an installed copy (no checkout build trees).
    assert f"{home}/venv/" in r.stdout, out
    assert "ok:" in r.stdout and "SERVING" in r.stdout, out
    assert "build tree" not in r.stdout, out
    # Without the library, the installed copy lists where it looked: only
    # places that exist for it (no build trees of a checkout it is not in).
    no_lib = {k: v for k, v in env.items() if k != "LD_LIBRARY_PATH"}
    r = subprocess.run([str(home / "venv" / "bin" / "python"), "-m", "dos"], env=no_lib,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "NOT FOUND" in r.stdout, r.stdout + r.stderr
    assert "build tree" not in r.stdout and "/build/" not in r.stdout, r.stdout
    # torch from Debian's packages, through the venv.
    r = subprocess.run([str(home / "venv" / "bin" / "python"), "-c", "import torch, dos.torch"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
