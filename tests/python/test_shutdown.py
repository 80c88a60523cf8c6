"""Clean shutdown in every order: each case runs a child interpreter that
trains a few steps through its own dosd and then ends in one particular
order (the optimizer garbage-collected late, at interpreter exit; the daemon
stopped or killed first; an exception in the middle of a step; a framework's
wrapper object collected while the optimizer lives on). The child must exit
with its own status (0, or 1 for an uncaught exception), never by a signal,
and print nothing from finalizers ("Exception ignored in ...").

Found on the GPU machine: a Python process died with SIGSEGV (exit status
139) at interpreter exit after Accelerate runs, once dosd had stopped.
"""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from conftest import running_dosd  # noqa: E402

CHILD = textwrap.dedent("""
    import gc, os, signal, sys, time
    import torch
    import dos.torch
    from dos import DosError

    case, sock, dosd_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def stop_daemon(sig):
        # Waits (bounded) until dosd is gone: after SIGTERM it drains, removes
        # its socket and exits; after SIGKILL it is a zombie (our parent reaps it).
        os.kill(dosd_pid, sig)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{dosd_pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return
            if state in ("Z", "X") and (sig == signal.SIGKILL or not os.path.exists(sock)):
                return
            time.sleep(0.01)
        raise SystemExit(f"dosd {dosd_pid} did not stop within 30 s")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    kw = {}
    if "inflight" in case:
        kw = dict(model=model, async_step=True)  # step() returns with the step in flight
    opt = dos.torch.AdamW(model.parameters(), socket=sock, lr=1e-2, subgroup_size=64, **kw)
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    def one_step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    if case == "wrapper_collected":
        # What PyTorch Lightning does (lightning.pytorch.core.optimizer): a
        # wrapper whose class derives from the optimizer's class and forwards
        # attribute reads; the strategy drops and re-creates such wrappers.
        class Wrapper:
            def __init__(self, o):
                self._optimizer = o
                self.__class__ = type("Lightning" + o.__class__.__name__,
                                      (self.__class__, o.__class__), {})
            def __getattr__(self, item):
                return getattr(self._optimizer, item)
        w = Wrapper(opt)
        w.zero_grad()
        del w
        gc.collect()
    for _ in range(3):
        one_step()

    if case.startswith("daemon_stopped"):
        stop_daemon(signal.SIGTERM)
    elif case.startswith("daemon_killed"):
        stop_daemon(signal.SIGKILL)
    if case == "daemon_stopped_close":
        opt.close()  # the daemon already dropped the session: nothing to detach
        opt.close()
    if case == "exception_mid_step":
        def closure():
            raise RuntimeError("the closure failed inside step()")
        opt.step(closure)
    if case == "exception_inflight":
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        raise RuntimeError("the trainer failed with a step in flight")
    if case == "cycle":
        # Only the interpreter's final collection can free the optimizer.
        model.dos_opt = opt
        opt.cycle = model
        gc.disable()
    if case == "wrapper_collected":
        ref = [p.detach().clone() for p in model.parameters()]
        print("STEP", opt.last_step["step"], flush=True)
    print("END", flush=True)
    # The optimizer (and model) stay referenced: finalized at interpreter exit.
""")

# case -> the exit status the child must end with.
CASES = {
    "daemon_alive": 0,
    "daemon_stopped": 0,
    "daemon_stopped_inflight": 0,
    "daemon_stopped_close": 0,
    "daemon_killed": 0,
    "daemon_killed_inflight": 0,
    "cycle": 0,
    "exception_mid_step": 1,
    "exception_inflight": 1,
    "wrapper_collected": 0,
}


@pytest.fixture
def private_dosd():
    """A dosd of this test alone (the child may stop or kill it)."""
    with running_dosd(killed_ok=True) as daemon:
        yield daemon


@pytest.mark.parametrize("case", sorted(CASES))
def test_child_exits_cleanly(private_dosd, case):
    sock, proc = private_dosd
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    out = subprocess.run([sys.executable, "-c", CHILD, case, sock, str(proc.pid)], env=env,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == CASES[case], (
        f"{case}: exit status {out.returncode} (negative: killed by that signal), expected "
        f"{CASES[case]}; output:\n{text[-3000:]}")
    assert "END" in out.stdout or CASES[case] != 0, text[-3000:]
    assert "Exception ignored" not in text, text[-3000:]
    assert "Fatal Python error" not in text, text[-3000:]
    if case == "wrapper_collected":
        assert "STEP 3" in out.stdout, text[-3000:]


@pytest.mark.parametrize("kw", [{}, {"async_step": True}], ids=["model", "model_async"])
def test_dropping_the_optimizer_closes_it_at_once(dos_socket, kw):
    """Hooks on the model and its parameters refer to the optimizer weakly:
    the last reference gone, it is finalized at once (not by a later cyclic
    collection, at exit after torch is torn down), the session is detached
    and the model keeps its trained weights in ordinary memory."""
    import gc
    import weakref

    import dos.torch
    gc.disable()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 2))
        opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model, **kw)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        handle = weakref.ref(opt._parts.reg.handle)
        gone = weakref.ref(opt)
        del opt
        assert gone() is None, "the optimizer is kept alive by a reference cycle"
        assert handle() is None, "the session handle outlived the optimizer"
        weights = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(4, 8)).sum().backward()  # hooks are gone, nothing waits
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
    finally:
        gc.enable()


def test_lightning_style_wrapper_zero_grad_before_first_backward(dos_socket):
    """PyTorch Lightning wraps the optimizer in an object whose class derives
    from the optimizer's (attribute reads forwarded), calls zero_grad() on it
    before the first backward, and drops and re-creates such wrappers. A
    collected wrapper used to run the optimizer's __del__ and close the live
    optimizer under it: zero_grad() then failed with AttributeError
    ('NoneType' object has no attribute 'zero_')."""
    import gc

    import dos.torch

    class Wrapper:  # lightning.pytorch.core.optimizer.LightningOptimizer's mechanics
        def __init__(self, o):
            self._optimizer = o
            self.__class__ = type("Lightning" + o.__class__.__name__,
                                  (self.__class__, o.__class__), {})

        def __getattr__(self, item):
            return getattr(self._optimizer, item)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, model=model)
    for _ in range(2):  # the strategy sets its optimizers twice
        w = Wrapper(opt)
        w.zero_grad()
        del w
        gc.collect()
    w = Wrapper(opt)
    for _ in range(3):
        w.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert w.last_step["step"] == 3 and opt.last_step["step"] == 3
    w.close()  # closing through a wrapper closes the optimizer itself, once
    assert opt._session is None
    opt.close()


def test_cuda_close_with_stream_waits_still_queued(dos_socket):
    """GPU mode: the next forward's per-layer waits sit on the stream behind
    other GPU work when the optimizer is closed. The library releases them
    and lets the device pass them before the control block they read is
    unregistered and unmapped; otherwise the GPU would fault when it reached
    them (an illegal memory access at the trainer's next CUDA call)."""
    import dos.torch
    from dos import _native
    if not torch.cuda.is_available() or not _native.cuda_supported():
        pytest.skip("needs a CUDA device and a CUDA build of libdos_client")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    try:
        opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=65536,
                              model=model)
    except dos.DosError as e:
        if "no GPU engine" in e.message:
            pytest.skip(f"dosd has no GPU engine: {e.message}")
        raise
    if not opt._parts.driver.mode.stream:
        opt.close()
        pytest.skip("the CUDA driver has no stream memory operations")
    x = torch.randn(64, 1024, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time ahead of the waits
    with torch.no_grad():
        model(x)  # its per-layer waits are queued behind the sleep
    opt.close()
    torch.cuda.synchronize()  # raises if a wait read the vanished block
    assert torch.isfinite(model(x)).all()


def test_open_optimizers_are_known_to_the_exit_handler(dos_socket):
    """The atexit handler closes what is still open, also an optimizer that
    re-registered (moved storage: a new session)."""
    import dos.torch
    from dos import _session
    model = torch.nn.Linear(4, 2)
    opt = dos.torch.AdamW(model.parameters(), socket=dos_socket)
    assert opt in _session._open
    model.weight.data = model.weight.data.clone()  # moved: re-registered at step()
    model(torch.randn(3, 4)).sum().backward()
    with pytest.warns(RuntimeWarning, match="re-registering"):
        opt.step()
    assert opt in _session._open
    opt.close()
    assert opt not in _session._open


# The exact order of a test run's end: the trainer's steps are in flight
# (async), the fixture kills dosd (SIGKILL) and reaps it, and only then does
# the interpreter exit, the optimizer still referenced globally: its close
# runs from the atexit handler against a daemon that is gone.
KILLED_FIRST = textwrap.dedent("""
    import sys
    import torch
    import dos.torch
    from dos import DosError, _native

    sock, device = sys.argv[1], sys.argv[2]
    if device == "cuda" and not (torch.cuda.is_available() and _native.cuda_supported()):
        print("SKIP needs a CUDA device and a CUDA build of libdos_client", flush=True)
        sys.exit(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(device)
    try:
        opt = dos.torch.AdamW(model.parameters(), socket=sock, lr=1e-2, subgroup_size=4096,
                              model=model, async_step=True)
    except DosError as e:
        if "no GPU engine" in e.message:
            print("SKIP dosd has no GPU engine", flush=True)
            sys.exit(0)
        raise
    x = torch.randn(32, 256, device=device)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.no_grad():
        model(x)  # the next forward: on CUDA its per-layer waits are queued
    assert opt._inflight
    print("INFLIGHT", flush=True)
    sys.stdin.readline()  # the parent kills dosd
    print("END", flush=True)
""")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_exit_after_daemon_killed_with_step_in_flight(device):
    import select
    import signal
    import time
    with running_dosd(killed_ok=True) as (sock, proc):
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        child = subprocess.Popen([sys.executable, "-c", KILLED_FIRST, sock, device], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([child.stdout], [], [], 120)
            assert ready, "the child did not train 3 steps within 120 s"
            first = child.stdout.readline()  # one flushed line (or EOF if it failed)
            if first.startswith("SKIP"):
                child.communicate(timeout=60)
                pytest.skip(first.strip())
            assert first.strip() == "INFLIGHT", first + child.communicate(timeout=60)[1][-3000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            start = time.monotonic()
            out, err = child.communicate("go\n", timeout=60)
            elapsed = time.monotonic() - start
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    text = first + out + err
    assert child.returncode == 0, f"exit status {child.returncode}; output:\n{text[-3000:]}"
    assert "END" in out, text[-3000:]
    assert "Exception ignored" not in text and "Fatal Python error" not in text, text[-3000:]
    # Interpreter exit with torch loaded takes about a second; a wait left
    # unbounded would take the whole timeout.
    assert elapsed < 20, f"the child took {elapsed:.1f} s to exit after dosd was killed"


FORKED = textwrap.dedent("""
    import os, sys
    import torch
    import dos.torch
    from dos import DosError

    model = torch.nn.Linear(16, 4)
    opt = dos.torch.AdamW(model.parameters(), socket=sys.argv[1], lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
    other = torch.nn.Linear(4, 4)
    async_opt = dos.torch.AdamW(other.parameters(), socket=sys.argv[1], async_step=True,
                                model=other, delay=1, delay_warmup=0)
    other(torch.randn(2, 4)).sum().backward()
    async_opt.step()  # left in flight across the fork, its update delayed
    pid = os.fork()
    if pid == 0:
        other.state_dict()  # its reader hook: the parent's step is not waited for from here
        async_opt.synchronize()
        try:
            opt.step()
        except DosError as e:
            ok = "is a fork of it" in str(e) and str(os.getppid()) in str(e)
            print("CHILD", "refused" if ok else e, flush=True)
        sys.exit(0)  # the interpreter's exit, with the atexit handlers
    _, status = os.waitpid(pid, 0)
    print("CHILD STATUS", status, flush=True)
    opt.zero_grad()
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    print("PARENT STEP", opt.last_step["step"], flush=True)
    for _ in range(2):
        other(torch.randn(2, 4)).sum().backward()
        async_opt.step()
    async_opt.synchronize()
    print("PARENT ASYNC STEP", async_opt.last_step["step"], flush=True)
    opt.close()
    async_opt.close()
""")


def test_a_forked_child_neither_closes_nor_uses_its_parents_optimizer(dos_socket):
    """A forked child (a multiprocessing worker, os.fork) exits through the
    interpreter's exit: it once closed the parent's session there (the
    atexit handler) and died in the client library's detach. Now the child
    is refused with the owner named, exits 0, and the parent trains on."""
    out = subprocess.run([sys.executable, "-c", FORKED, dos_socket], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "CHILD refused" in out.stdout, text[-3000:]
    assert "CHILD STATUS 0" in out.stdout, text[-3000:]
    assert "PARENT STEP 3" in out.stdout, text[-3000:]
    assert "PARENT ASYNC STEP 3" in out.stdout, text[-3000:]
    assert "terminate called" not in text, text[-3000:]
