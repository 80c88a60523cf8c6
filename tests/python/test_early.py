"""Early steps (work during backward, protocol 5): overlap=True begins the
step at the first gradient (dosd plans it and waits for the verdict that
step() brings), overlap="update" has dosd update each subgroup as soon as all
its gradients are final. Either way the result must be bit for bit that of
synchronous steps with the same clip coefficient and loss scale.

On the CPU (shared memory) the subgroups are marked ready by release stores.
torch < 2.1 has no post-accumulate-grad hooks: the tests then call the hook's
body (`_on_ready`) for each parameter after backward, last layer first, as
autograd would; with torch >= 2.1 the real hooks run during backward."""

import time
import warnings

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from dos import DosError  # noqa: E402
from dos._native import Status  # noqa: E402

from test_async import SUBGROUP, batches, make_deep  # noqa: E402

LR = dict(lr=2e-3, weight_decay=0.05)
HAS_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def early_opt(model, socket, overlap, **kw):
    opt = dos.torch.AdamW(model.parameters(), socket=socket, subgroup_size=SUBGROUP,
                          overlap=overlap if HAS_HOOK else False, **kw, **LR)
    if not HAS_HOOK:  # the hooks' body is called by hand (backward() below)
        opt.overlap = True
        opt._parts.configure(overlap)  # the early driver, without hooks to install
    return opt


def backward(opt, loss, upto=None):
    """loss.backward(); on old torch, then the hooks' body for each
    parameter, last first (all, or the last `upto`)."""
    loss.backward()
    if not HAS_HOOK and opt.overlap:
        ents = list(reversed(opt._entries))
        for e in ents[:upto]:
            opt._parts.driver.on_ready(e)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def train(model, opt, data, clip=None, grad_scale=1.0, torch_clip=None):
    """clip: opt.clip_grad_norm_ on the early optimizer, step(clip_coef=) with
    the same coefficient on the reference (opt.clip_grad_norm_ too: it
    computes the coefficient without touching gradients)."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_of(model, x, y) * grad_scale
        backward(opt, loss)
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step(grad_scale=grad_scale)
        losses.append(loss.item())
    return losses


def assert_bitwise(a_model, b_model, a_opt, b_opt):
    for a, b in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(a, b)
    for (_, sa), (_, sb) in zip(a_opt.state_dict()["state"].items(),
                                b_opt.state_dict()["state"].items()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


@pytest.mark.parametrize("case", ["plain", "clip", "grad_scale", "torch_clip"])
def test_verdict_steps_equal_synchronous(dos_socket, case):
    """overlap=True: dosd reads nothing before step(), so clipping through the
    optimizer, a loss scale and even torch's in-place clip are exact."""
    kw = {"clip": dict(clip=0.05), "grad_scale": dict(grad_scale=64.0),
          "torch_clip": dict(torch_clip=0.05)}.get(case, {})
    data = batches(12)
    ref_model, model = make_deep(), make_deep()
    with dos.torch.AdamW(ref_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as ref_opt, early_opt(model, dos_socket, True) as opt:
        assert opt._parts.reg.num_subgroups > 10
        ref = train(ref_model, ref_opt, data, **kw)
        got = train(model, opt, data, **kw)
        assert got == ref
        last = opt.last_step
        assert last["early"] and last["step"] == len(data)
        assert last["before_verdict_us"] > 0 and last["after_verdict_us"] > 0
        assert last["prefetched_bytes"] == 0  # no GPU path on the CPU
        assert not ref_opt.last_step["early"]
        assert_bitwise(model, ref_model, opt, ref_opt)


def test_clip_grad_norm_returns_torch_norm_and_leaves_gradients(dos_socket):
    model = make_deep()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        x, y = batches(1)[0]
        loss_of(model, x, y).backward()
        before = [p.grad.clone() for p in model.parameters()]
        norm = opt.clip_grad_norm_(0.01)
        for p, g in zip(model.parameters(), before):
            assert torch.equal(p.grad, g)  # not clipped in place
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in before]
        for p, g in zip(params, before):
            p.grad = g.clone()
        expected = torch.nn.utils.clip_grad_norm_(params, 1e9)
        assert torch.allclose(norm, expected, rtol=1e-6)
        assert 0 < opt._parts.clip.coef < 1
        opt.step()
        assert opt._parts.clip is None  # consumed by the step


def test_update_during_backward_equals_synchronous(dos_socket):
    """overlap="update": subgroups are updated as they become ready, before
    step(), and the result is still that of synchronous steps."""
    data = batches(10)
    ref_model, model = make_deep(), make_deep()
    with dos.torch.AdamW(ref_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as ref_opt, early_opt(model, dos_socket, "update") as opt:
        ref = train(ref_model, ref_opt, data)
        got = train(model, opt, data)
        assert got == ref
        assert opt.last_step["early"] and opt.last_step["before_verdict_us"] == 0
        assert_bitwise(model, ref_model, opt, ref_opt)


class WithUnused(torch.nn.Module):
    """make_deep() behind a layer its forward never uses (registered first,
    so its weight shares a subgroup with the used network's first weight)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(16, 48)
        self.net = make_deep()

    def forward(self, x):
        return self.net(x)


def test_update_during_backward_skips_parameters_backward_did_not_reach(dos_socket):
    """overlap="update" with an unused layer: as torch (and synchronous dos
    steps) skip a parameter without a gradient, its weights and state stay
    as they are, and everything else is bitwise the synchronous result."""
    data = batches(6)
    torch.manual_seed(0)
    ref_model = WithUnused()
    torch.manual_seed(0)
    model = WithUnused()
    before = [p.detach().clone() for p in model.unused.parameters()]
    with dos.torch.AdamW(ref_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as ref_opt, early_opt(model, dos_socket, "update") as opt:
        for m, o in ((ref_model, ref_opt), (model, opt)):
            for x, y in data:
                o.zero_grad(set_to_none=True)
                loss_of(m, x, y).backward()
                if not HAS_HOOK and o.overlap:  # the hooks' body, for what backward reached
                    for e in reversed(o._entries):
                        if not e.grad_none:
                            o._parts.driver.on_ready(e)
                o.step()
        assert opt.last_step["early"]
        for p, b in zip(model.unused.parameters(), before):
            assert torch.equal(p.detach(), b)
        assert_bitwise(model, ref_model, opt, ref_opt)
        state = opt.state_dict()["state"]
        assert 0 not in state  # never updated: no state, as torch


@pytest.mark.skipif(HAS_HOOK, reason="needs the hooks' body called by hand, between gradients")
def test_update_starts_before_the_last_gradient(dos_socket):
    """With only the last layer's gradients final, dosd updates that layer's
    subgroups while the first layer's weights stay untouched (they wait)."""
    model = make_deep()
    with early_opt(model, dos_socket, "update") as opt:
        x, y = batches(1)[0]
        last, first = opt._entries[-1], opt._entries[0]
        last_before, first_before = last.param.detach().clone(), first.param.detach().clone()
        loss_of(model, x, y).backward()
        # The last tensors, until every subgroup of the last one is ready.
        lf, ll = opt._parts.reg.ranges[last.index]
        for e in reversed(opt._entries):
            opt._parts.driver.on_ready(e)
            if all(opt._parts.driver.ready_left[sg] == 0 for sg in range(lf, ll + 1)):
                break
        assert first.index not in opt._parts.driver.ready
        deadline = time.monotonic() + 60
        while torch.equal(last.param.detach(), last_before):
            assert time.monotonic() < deadline, "dosd did not update the ready subgroups"
            time.sleep(0.001)
        f0, _ = opt._parts.reg.ranges[first.index]
        l0, _ = opt._parts.reg.ranges[last.index]
        assert f0 < l0
        assert torch.equal(first.param.detach(), first_before)
        opt.step()  # marks the rest ready; the step completes
        assert not torch.equal(first.param.detach(), first_before)
        assert opt.last_step["early"]


def test_update_refuses_a_late_clip(dos_socket):
    model = make_deep()
    with early_opt(model, dos_socket, "update") as opt:
        x, y = batches(1)[0]
        backward(opt, loss_of(model, x, y))
        with pytest.raises(DosError, match="too late"):
            opt.step(clip_coef=0.5)
        # The optimizer goes on: the next step is a normal early one.
        opt.zero_grad()
        backward(opt, loss_of(model, x, y))
        opt.step()
        assert opt.last_step["step"] == 2


def test_verdict_step_abandoned_by_a_reader(dos_socket):
    """state_dict() between backward and step() gives the early step up
    (nothing applied); step() then begins an ordinary step."""
    data = batches(3)
    ref_model, model = make_deep(), make_deep()
    with dos.torch.AdamW(ref_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as ref_opt, early_opt(model, dos_socket, True) as opt:
        train(ref_model, ref_opt, data)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            backward(opt, loss_of(model, x, y))
            assert opt._parts.flight.machine.hook_begun
            if i == 1:
                opt.state_dict()  # abandons the early step
                assert not opt._inflight
            opt.step()
        assert opt.last_step["step"] == len(data)
        assert_bitwise(model, ref_model, opt, ref_opt)


def test_grad_scaler_skip_abandons(dos_socket):
    """A GradScaler that found inf (torch 2.x protocol: found_inf set) skips
    the early step: dosd applies nothing."""
    model = make_deep()
    with early_opt(model, dos_socket, True) as opt:
        x, y = batches(1)[0]
        before = [p.detach().clone() for p in model.parameters()]
        backward(opt, loss_of(model, x, y))
        opt.found_inf = torch.ones(1)
        opt.step()
        del opt.found_inf
        assert opt.found_inf
        assert opt.last_step["skipped"] and opt.last_step["found_inf"]  # as without overlap
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b)
        opt.zero_grad()
        backward(opt, loss_of(model, x, y))
        opt.step()
        assert opt.last_step["step"] == 1


def test_early_step_api_errors(dos_socket):
    model = make_deep()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as opt:
        from dos import _native
        from dos._errors import call
        import ctypes
        with pytest.raises(DosError) as err:
            call("dos_mark_ready", opt._session, ctypes.c_uint32(0), ctypes.c_uint32(0), None)
        assert err.value.code == Status.FAILED_PRECONDITION
        args = opt._parts.driver.args(1.0, 1.0)
        call("dos_step_begin_early", opt._session, ctypes.byref(args), ctypes.c_uint32(0), None)
        res = _native.StepResult()
        with pytest.raises(DosError, match="no verdict yet"):
            call("dos_step_wait", opt._session, ctypes.c_int64(-1), ctypes.byref(res))
        with pytest.raises(DosError, match="not within"):
            call("dos_mark_ready", opt._session, ctypes.c_uint32(0),
                 ctypes.c_uint32(opt._parts.reg.num_subgroups), None)
        call("dos_step_abandon", opt._session)
        with pytest.raises(DosError) as err:
            call("dos_step_wait", opt._session, ctypes.c_int64(-1), ctypes.byref(res))
        assert err.value.code == Status.ABORTED


def test_a_stalled_early_step_holds_up_no_one_elses_calls(dos_socket):
    """An early step waiting for a verdict that never comes holds the session
    for up to --early_step_ready_timeout. A state read of that session once
    waited as long on the descriptor socket's one thread (and a state write
    or checkpoint load on threads serving every user), so every other user's
    attach waited too. Now it is refused after 1 s, naming the step; another
    optimizer attaches meanwhile, and once the step is given up the read
    goes through."""
    import ctypes
    from dos import _views
    from dos._errors import call
    model = make_deep()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as opt:
        args = opt._parts.driver.args(1.0, 1.0)
        call("dos_step_begin_early", opt._session, ctypes.byref(args), ctypes.c_uint32(0), None)
        deadline = time.monotonic() + 10
        while True:  # until dosd's step thread has taken the session for the verdict
            start = time.monotonic()
            try:
                _views.fetch(opt._session)
            except DosError as err:
                assert err.code == Status.ABORTED and "waits for its trainer" in str(err), err
                break
            assert time.monotonic() < deadline, "the early step never held the session"
            time.sleep(0.05)
        with dos.torch.AdamW(make_deep().parameters(), socket=dos_socket, **LR) as other:
            assert other.session_id != opt.session_id
        assert time.monotonic() - start < 10
        call("dos_step_abandon", opt._session)
        res = dos._native.StepResult()
        with pytest.raises(DosError):
            call("dos_step_wait", opt._session, ctypes.c_int64(-1), ctypes.byref(res))
        assert _views.fetch(opt._session) > 0


@pytest.mark.parametrize("overlap", [True, "update"])
def test_close_between_backward_and_step(dos_socket, overlap):
    """close() with an early step step() never claimed: abandoned (verdict)
    or completed (update), and the session detaches cleanly."""
    model = make_deep()
    opt = early_opt(model, dos_socket, overlap)
    x, y = batches(1)[0]
    backward(opt, loss_of(model, x, y))
    assert opt._parts.flight.machine.hook_begun
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "did not finish" RuntimeWarning
        opt.close()
    assert opt._session is None


def test_stalled_update_step_times_out_and_dosd_goes_on():
    """overlap="update" holds the session's engine while dosd waits for ready
    words (on the GPU, the engine all trainers on that device share): a
    trainer that begins such a step and then stalls, alive, must not hold it
    forever. dosd gives up after --early_step_ready_timeout with
    DEADLINE_EXCEEDED naming the flag; the session and the daemon go on."""
    import ctypes
    from conftest import running_dosd
    from dos import _native
    from dos._errors import call
    with running_dosd("--early_step_ready_timeout=1s") as (socket, _proc):
        model, other_model = make_deep(), make_deep()
        with dos.torch.AdamW(model.parameters(), socket=socket, subgroup_size=SUBGROUP,
                             **LR) as opt, \
                dos.torch.AdamW(other_model.parameters(), socket=socket,
                                subgroup_size=SUBGROUP, **LR) as other:
            x, y = batches(1)[0]
            loss_of(model, x, y).backward()
            args = opt._parts.driver.args(1.0, 1.0, gradients_checked=True)
            t0 = time.monotonic()
            call("dos_step_begin_early", opt._session, ctypes.byref(args),
                 ctypes.c_uint32(_native.DOS_EARLY_NO_VERDICT), None)
            # Nothing is marked ready: the trainer "stalls" mid-backward. The
            # other trainer steps meanwhile.
            other.zero_grad()
            loss_of(other_model, x, y).backward()
            other.step()
            assert other.last_step["step"] == 1
            while time.monotonic() - t0 < 2.5:
                time.sleep(0.1)
            # The trainer comes back: its verdict marks everything, too late.
            call("dos_step_verdict", opt._session, ctypes.byref(args), None)
            res = _native.StepResult()
            with pytest.raises(DosError, match="early_step_ready_timeout") as err:
                call("dos_step_wait", opt._session, ctypes.c_int64(30_000), ctypes.byref(res))
            assert err.value.code == Status.DEADLINE_EXCEEDED
            # The session goes on: the next step is an ordinary one.
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()


def test_ready_timeout_flag_is_checked():
    import os
    import subprocess
    binary = os.environ.get("DOS_DOSD")
    if not binary or not os.path.exists(binary):
        pytest.skip("DOS_DOSD does not name a dosd binary")
    out = subprocess.run([binary, "--socket=/tmp/dos-never.sock", "--early_step_ready_timeout=-1s"],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode != 0
    assert "--early_step_ready_timeout must be positive" in out.stderr + out.stdout


def test_verdict_step_with_gradient_accumulation(dos_socket):
    """overlap=True with two micro-batches per step: the second backward
    gives the early step up (dosd would otherwise wait through every
    micro-batch) and step() begins an ordinary one with the summed
    gradients; bitwise the synchronous optimizer's result."""
    data = batches(6)
    ref_model, model = make_deep(), make_deep()
    with dos.torch.AdamW(ref_model.parameters(), socket=dos_socket, subgroup_size=SUBGROUP,
                         **LR) as ref_opt, early_opt(model, dos_socket, True) as opt:
        for m, o in ((ref_model, ref_opt), (model, opt)):
            for i in range(0, len(data), 2):
                o.zero_grad()
                for x, y in data[i:i + 2]:
                    if o is opt:
                        backward(o, loss_of(m, x, y))
                    else:
                        loss_of(m, x, y).backward()
                if o is opt:
                    assert not opt._parts.flight.machine.hook_begun  # given up at the 2nd backward
                o.step()
        assert opt.last_step["step"] == 3
        assert_bitwise(model, ref_model, opt, ref_opt)
        # Without accumulation the next step is early again.
        opt.zero_grad()
        x, y = data[0]
        backward(opt, loss_of(model, x, y))
        assert opt._parts.flight.machine.hook_begun
        opt.step()
        assert opt.last_step["early"]
