"""Asynchronous steps with per-layer waits (model=), and resuming a dead
trainer's session (resume=).

On the CPU (shared memory) the per-layer waits are host waits on the
control block's per-subgroup progress words; on CUDA the same hooks enqueue
stream waits instead (tests/python/test_cuda.py). Either way the result must
be bit for bit the result of synchronous steps: the same daemon arithmetic
runs, only the trainer's waiting changes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from dos import DosError  # noqa: E402

LR = dict(lr=2e-3, weight_decay=0.05)
# Small subgroups: the 7 tensors below span ~30 subgroups, several per layer
# and some shared by two layers.
SUBGROUP = 300


def make_deep(seed=0):
    torch.manual_seed(seed)
    layers = []
    for i in range(3):
        layers += [torch.nn.Linear(16 if i == 0 else 48, 48), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(48, 4))
    return torch.nn.Sequential(*layers)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def train(model, opt, data, zero_at="first"):
    """zero_at: where the loop calls zero_grad: "first", "after_forward"
    (between forward and backward) or "last" (after step)."""
    losses = []
    for x, y in data:
        if zero_at == "first":
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if zero_at == "after_forward":
            opt.zero_grad()
        loss.backward()
        opt.step()
        if zero_at == "last":
            opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("zero_at", ["first", "after_forward", "last"])
def test_layer_waits_equal_synchronous_steps(dos_socket, zero_at):
    data = batches(25)
    sync_model, async_model = make_deep(), make_deep()
    with dos.torch.AdamW(sync_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as sync_opt, \
            dos.torch.AdamW(async_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                            model=async_model, async_step=True, **LR) as async_opt:
        assert (async_opt._parts.driver.mode.complete.name != "WAIT") and not (sync_opt._parts.driver.mode.complete.name != "WAIT")
        assert async_opt._parts.reg.num_subgroups > 10
        ref = train(sync_model, sync_opt, data, zero_at)
        got = train(async_model, async_opt, data, zero_at)
        # Collects the last step (it was only queued).
        assert async_opt.last_step["step"] == len(data)
        assert got == ref
        for a, b in zip(async_model.parameters(), sync_model.parameters()):
            assert torch.equal(a, b)
        for (ka, sa), (kb, sb) in zip(async_opt.state_dict()["state"].items(),
                                      sync_opt.state_dict()["state"].items()):
            assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def decay_groups(model):
    """Weights in one group, biases in another registered after every
    weight (as GPT and Hugging Face training split weight decay): a layer's
    weight and bias then lie far apart in the shard."""
    weights = [p for p in model.parameters() if p.ndim >= 2]
    biases = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": weights, "weight_decay": 0.05}, {"params": biases, "weight_decay": 0.0}]


def test_a_layer_waits_for_its_own_subgroups_not_everything_between(dos_socket, monkeypatch):
    import dos._flight as hooks  # where dos_wait_subgroups is called
    data = batches(6)
    sync_model, async_model = make_deep(), make_deep()
    with dos.torch.AdamW(decay_groups(sync_model), socket=dos_socket, subgroup_size=SUBGROUP,
                         lr=2e-3) as sync_opt, \
            dos.torch.AdamW(decay_groups(async_model), socket=dos_socket, subgroup_size=SUBGROUP,
                            lr=2e-3, model=async_model, async_step=True) as async_opt:
        first_linear = async_model[0]
        by_param = {id(e.param): e for e in async_opt._entries}
        w = async_opt._parts.reg.ranges[by_param[id(first_linear.weight)].index]
        b = async_opt._parts.reg.ranges[by_param[id(first_linear.bias)].index]
        assert b[0] > w[1] + 1  # far apart: subgroups of other layers lie between
        waits = []
        real_call = hooks.call

        def record(name, *args):
            if name == "dos_wait_subgroups":
                waits.append((args[1].value, args[2].value))
            return real_call(name, *args)
        monkeypatch.setattr(hooks, "call", record)
        ref = train(sync_model, sync_opt, data)
        got = train(async_model, async_opt, data)
        async_opt.synchronize()  # the last step was only queued
        assert got == ref
        for a, c in zip(async_model.parameters(), sync_model.parameters()):
            assert torch.equal(a, c)
        # The first layer's forward waited for its weight's and its bias's
        # subgroups, and never for one range from one to the other.
        assert w in waits and b in waits
        assert all(not (first <= w[0] and last >= b[1]) for first, last in waits)


def test_cpu_steps_finish_before_step_returns_by_default(dos_socket):
    """On the CPU path model= alone keeps step() synchronous: a read of the
    shared memory that passes through no hook could not be made to wait
    (test_read_after_step.py); async_step=True opts in to the overlap."""
    model = make_deep()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         model=model, **LR) as opt:
        assert not (opt._parts.driver.mode.complete.name != "WAIT")
        x, y = batches(1)[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert not opt._inflight


def test_step_returns_before_the_update_is_collected(dos_socket):
    model = make_deep()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         model=model, async_step=True, **LR) as opt:
        x, y = batches(1)[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert opt._inflight  # queued, not waited for
        assert opt.found_inf is False  # reading the verdict collects the step
        assert not opt._inflight
        assert opt.last_step["step"] == 1


def test_async_step_needs_an_ordering(dos_socket):
    model = make_deep()
    with pytest.raises(DosError) as err:
        dos.torch.AdamW(model.parameters(), socket=dos_socket, async_step=True, **LR)
    assert "model=" in str(err.value)


def test_tensor_subgroups_cover_the_shard(dos_socket):
    model = make_deep()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as opt:
        total = sum(p.numel() for p in model.parameters())
        assert opt._parts.reg.num_subgroups == (total + SUBGROUP - 1) // SUBGROUP
        prev_last = 0
        offset = 0
        for e, (first, last) in zip(opt._entries, opt._parts.reg.ranges):
            n = e.local.numel()
            assert first == offset // SUBGROUP and last == (offset + n - 1) // SUBGROUP
            assert first >= prev_last
            prev_last = last
            offset += n


TRAINER = textwrap.dedent("""
    import json, os, signal, sys, torch
    sys.path.insert(0, {testdir!r})
    import dos.torch
    from test_async import make_deep, batches, LR, SUBGROUP
    model = make_deep()
    opt = dos.torch.AdamW(model.parameters(), socket={socket!r}, subgroup_size=SUBGROUP,
                          client_name="killed-trainer", **LR)
    data = batches({total})
    for x, y in data[:{crash_after}]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with open({info!r}, "w") as f:
        json.dump(opt.session_info(), f)
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no detach, no cleanup
""")


KILLED_BEFORE_REGISTER = textwrap.dedent("""
    import json, os, signal, sys
    from dos._register import Registration
    reg = Registration(socket={socket!r}, resume=json.load(open({info!r})))
    os.kill(os.getpid(), signal.SIGKILL)  # resumed, then killed before it registered
""")


@pytest.mark.parametrize("wrong_model_first", [False, True, "killed_before_register"],
                         ids=["resume", "wrong_model_first", "killed_before_register"])
def test_resume_after_sigkill_continues_exactly(dos_socket, tmp_path, wrong_model_first):
    """A trainer killed after k steps; a new process (here: this one) builds
    its optimizer with resume=session_info: the daemon kept the session for
    its lease, rewrites the new model's weights from the fp32 masters, and
    training continues with the results of an uninterrupted run.
    wrong_model_first: a try with another model is refused, naming both
    layouts, and the state still waits for the right one (the refused try
    once freed it); killed_before_register: so does a try whose process dies
    between resuming and registering."""
    import json
    total, crash_after = 20, 8
    info_path = tmp_path / "session.json"
    script = TRAINER.format(testdir=os.path.dirname(__file__), socket=dos_socket, total=total,
                            crash_after=crash_after, info=str(info_path))
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), timeout=120)
    assert proc.returncode == -signal.SIGKILL
    info = json.loads(info_path.read_text())

    data = batches(total)
    # Uninterrupted reference.
    ref_model = make_deep()
    with dos.torch.AdamW(ref_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as ref_opt:
        ref_losses = train(ref_model, ref_opt, data)

    if wrong_model_first == "killed_before_register":
        script = KILLED_BEFORE_REGISTER.format(socket=dos_socket, info=str(info_path))
        proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), timeout=60)
        assert proc.returncode == -signal.SIGKILL
        time.sleep(1.5)  # dosd's reaper looks for unregistered sessions' clients once a second
    elif wrong_model_first:
        with pytest.raises(DosError) as err:
            dos.torch.AdamW(torch.nn.Linear(4, 3).parameters(), socket=dos_socket,
                            subgroup_size=SUBGROUP, resume=info, client_name="other-job", **LR)
        msg = str(err.value)
        assert "is 2 in this registration but" in msg and "in the kept state" in msg, msg
    if wrong_model_first:
        # The waiting state is saved like a crashed trainer's: `dosctl
        # checkpoint save` (and dosd's final autosave) once skipped it.
        from test_ddp import find_dosctl
        if find_dosctl() is not None:
            out = subprocess.run([find_dosctl(), f"--socket={dos_socket}", "checkpoint", "save",
                                  str(info["session_id"]), f"kept-{os.getpid()}.dckpt"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            row = out.stdout.splitlines()[1].split()  # SESSION STEP BYTES ...
            assert row[:2] == [str(info["session_id"]), str(crash_after)], out.stdout
            # Into a folder: the file names the client whose state it is, not
            # the one whose resume was refused (it once named that one).
            out = subprocess.run([find_dosctl(), f"--socket={dos_socket}", "checkpoint", "save",
                                  str(info["session_id"]), f"kept-{os.getpid()}/"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            assert "killed-trainer.r" in out.stdout and "other-job" not in out.stdout, out.stdout
    # The restarted trainer: fresh (differently initialised) weights, which
    # the resumed session overwrites with the daemon's.
    model = make_deep(seed=123)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         resume=info, **LR) as opt:
        assert opt.resumed
        losses = train(model, opt, data[crash_after:])
        assert opt.last_step["step"] == total
        assert losses == ref_losses[crash_after:]
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)


def test_resume_with_a_wrong_token_is_refused(dos_socket):
    model = make_deep()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        info = opt.session_info()
    with pytest.raises(DosError) as err:
        dos.torch.AdamW(make_deep().parameters(), socket=dos_socket,
                        resume={"session_id": info["session_id"], "token": "x" * 32}, **LR)
    assert "resume" in str(err.value).lower() or "token" in str(err.value).lower()


@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                    reason="overlap=True needs torch >= 2.1")
@pytest.mark.parametrize("with_model", [False, True], ids=["overlap", "overlap_and_layer_waits"])
def test_overlap_steps_every_iteration(dos_socket, with_model):
    """overlap=True begins each step from the last gradient hook; step() then
    only claims it. Every iteration must apply exactly one step, also when
    step() returns before the step is done (model=)."""
    data = batches(15)
    sync_model, model = make_deep(), make_deep()
    kw = dict(model=model, async_step=True) if with_model else {}
    with dos.torch.AdamW(sync_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as sync_opt, \
            dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                            overlap=True, **kw, **LR) as opt:
        ref = train(sync_model, sync_opt, data)
        got = train(model, opt, data)
        assert opt.last_step["step"] == len(data)
        assert opt.last_step["overlapped"]
        assert got == ref
        for a, b in zip(model.parameters(), sync_model.parameters()):
            assert torch.equal(a, b)
