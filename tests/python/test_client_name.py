"""The default client name (dos._session.default_client_name) and dosd's
restart rule: two jobs of one script with different arguments (a sweep)
each get their own autosave back after dosd restarts, and a relaunch with
the same command line finds its own (a hostile review found the second
job's state given to the first when both were named after the script)."""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from conftest import running_dosd
from dos._session import default_client_name

JOB = textwrap.dedent("""
    import sys, torch, dos.torch
    lr, steps = float(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = dos.torch.AdamW(model.parameters(), lr=lr)
    state = opt.state_dict()["state"].get(0)
    start = int(state["step"]) if state else 0
    del state
    for _ in range(steps if start == 0 else 1):
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    print(start, flush=True)
    sys.stdin.readline()  # held until the test is done with it
    opt.close()
""")


def test_the_default_name_is_the_script_and_a_hash_of_its_arguments(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/train.py"])
    assert default_client_name() == "train.py"
    monkeypatch.setattr(sys, "argv", ["/x/train.py", "--lr", "1e-3"])
    first = default_client_name()
    assert first.startswith("train.py-") and len(first) == len("train.py-") + 8
    monkeypatch.setattr(sys, "argv", ["/y/train.py", "--lr", "1e-3"])
    assert default_client_name() == first  # the same command line elsewhere
    monkeypatch.setattr(sys, "argv", ["/x/train.py", "--lr", "5e-2"])
    assert default_client_name() != first
    monkeypatch.setattr(sys, "argv", [])
    assert default_client_name() == "python"
    monkeypatch.setattr(sys, "argv", ["-c"])  # python3 -c CODE: no file (it was "-c")
    assert default_client_name() == "python-c"


def launch(folder, sock, lr, steps):
    env = dict(os.environ, DOS_SOCKET=sock)
    return subprocess.Popen([sys.executable, os.path.join(folder, "job.py"), str(lr), str(steps)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def started_at(job):
    line = job.stdout.readline().strip()
    assert line, "the job ended without reporting its first step"
    return int(line)


def end(*jobs):
    for j in jobs:
        if j.poll() is None:
            j.stdin.close()
            try:
                j.wait(timeout=30)
            except subprocess.TimeoutExpired:
                j.kill()
                j.wait()


def test_a_sweep_after_a_dosd_crash_resumes_each_job_from_its_own_autosave():
    folder = tempfile.mkdtemp(prefix="dos-sweep-")
    with open(os.path.join(folder, "job.py"), "w") as f:
        f.write(JOB)
    store = os.path.join(folder, "checkpoints")
    flags = (f"--checkpoint_dir={store}", "--autosave_interval=300ms")
    with running_dosd(*flags, killed_ok=True) as (sock, proc):
        a, b = launch(folder, sock, 1e-3, 3), launch(folder, sock, 5e-2, 7)
        try:
            assert started_at(a) == 0 and started_at(b) == 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:  # both autosaved at their last step
                # Written files only: a save in progress is <name>.tmp.<pid>.<n> until
                # its rename (killing dosd then lost B's only autosave: a flaky test).
                names = [n for _, _, fs in os.walk(store) for n in fs if ".tmp." not in n]
                if any(n.startswith("auto-000000000003") for n in names) and \
                        any(n.startswith("auto-000000000007") for n in names):
                    break
                time.sleep(0.1)
            else:
                pytest.fail(f"no autosaves at steps 3 and 7 in {store}: {names}")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            for j in (a, b):
                j.kill()
                j.wait()
    with running_dosd(*flags) as (sock, _):
        a = launch(folder, sock, 1e-3, 3)  # A first: it once took B's state (steps 7)
        try:
            assert started_at(a) == 3
            b = launch(folder, sock, 5e-2, 7)
            try:
                assert started_at(b) == 7
            finally:
                end(b)
        finally:
            end(a)
