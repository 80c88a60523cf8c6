"""dos.torch state_dict interchange with torch.optim.AdamW, 16-bit params,
skipped steps on non-finite gradients, and bad input."""

import math

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from test_equivalence import assert_same, make_data, make_mlp  # noqa: E402

LR = dict(lr=2e-3, weight_decay=0.05)


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_state_dict_matches_torch_format(dos_socket):
    data = make_data(n=20)
    ref, mine = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **LR) as opt:
        train(ref, ref_opt, data)
        train(mine, opt, data)
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for k, s in sd["state"].items():
        r = ref_sd["state"][k]
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}  # fp32 params: no master copy
        assert float(s["step"]) == float(r["step"]) == 20
        for key in ("exp_avg", "exp_avg_sq"):
            assert s[key].shape == r[key].shape and s[key].dtype == torch.float32
            assert torch.allclose(s[key], r[key], rtol=1e-5, atol=1e-6 * r[key].abs().max())
    assert sd["param_groups"][0]["lr"] == LR["lr"]


@pytest.mark.parametrize("direction", ["dos_to_torch", "torch_to_dos"])
def test_state_dict_interchange(dos_socket, direction):
    """Train 30 steps with one optimizer, move model + optimizer state to the
    other, continue 30 steps; compare against a run that never switched."""
    data = make_data(n=60)
    ref = make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    train(ref, ref_opt, data)

    first, second = make_mlp(), make_mlp()
    if direction == "dos_to_torch":
        opt1 = dos.torch.AdamW(first.parameters(), socket=dos_socket, **LR)
        train(first, opt1, data[:30])
        sd = opt1.state_dict()
        opt1.close()
        second.load_state_dict(first.state_dict())
        opt2 = torch.optim.AdamW(second.parameters(), **LR)
        opt2.load_state_dict(sd)
        train(second, opt2, data[30:])
    else:
        opt1 = torch.optim.AdamW(first.parameters(), **LR)
        train(first, opt1, data[:30])
        opt2 = dos.torch.AdamW(second.parameters(), socket=dos_socket, **LR)
        second.load_state_dict(first.state_dict())  # in place into shared memory
        opt2.load_state_dict(opt1.state_dict())
        train(second, opt2, data[30:])
        assert float(opt2.state_dict()["state"][0]["step"]) == 60
        opt2.close()
    assert_same(second, ref, 60)


def test_dos_round_trip_into_fresh_session(dos_socket):
    data = make_data(n=40)
    ref = make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    train(ref, ref_opt, data)
    m1, m2 = make_mlp(), make_mlp()
    with dos.torch.AdamW(m1.parameters(), socket=dos_socket, **LR) as o1:
        train(m1, o1, data[:20])
        sd = o1.state_dict()
        with dos.torch.AdamW(m2.parameters(), socket=dos_socket, **LR) as o2:
            m2.load_state_dict(m1.state_dict())
            o2.load_state_dict(sd)
            train(m2, o2, data[20:])
    assert_same(m2, ref, 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_are_rounded_master(dos_socket, dtype):
    torch.manual_seed(0)
    # Linear algebra in fp32 (CPU torch 1.13 has no fp16 matmul); the params and
    # their grads stay 16-bit.
    w = torch.nn.Parameter((torch.randn(8, 32) * 0.2).to(dtype))
    b = torch.nn.Parameter(torch.zeros(8, dtype=dtype))
    model = torch.nn.ParameterList([w, b])
    data = [(torch.randn(16, 32), torch.randn(16, 8)) for _ in range(10)]
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, lr=1e-2) as opt:
        for x, y in data:
            opt.zero_grad()
            out = x @ w.float().t() + b.float()
            torch.nn.functional.mse_loss(out, y).backward()
            assert w.grad.dtype == dtype
            opt.step()
        sd = opt.state_dict()
        for i, p in enumerate(model.parameters()):
            master = sd["state"][i]["master_param"]
            assert master.dtype == torch.float32 and master.shape == p.shape
            # torch's .to() rounds to nearest even, as the daemon must.
            assert torch.equal(p.detach(), master.to(dtype))
            # The master moved away from the 16-bit weight (fp32 precision kept).
            assert not torch.equal(master, p.detach().float())


def test_non_finite_gradient_skips_step(dos_socket):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket) as opt:
        x = torch.randn(4, 8)
        model(x).sum().backward()
        opt.step()
        assert not opt.found_inf
        before = [p.detach().clone() for p in model.parameters()]
        state_before = opt.state_dict()
        opt.zero_grad()
        model(x).sum().backward()
        model.bias.grad[1] = math.inf
        model.weight.grad[0, 0] = math.nan
        opt.step()
        assert opt.found_inf
        assert opt.last_step["found_inf"]
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p.detach(), b)
        state_after = opt.state_dict()
        for k in state_before["state"]:
            assert float(state_after["state"][k]["step"]) == 1
            assert torch.equal(state_after["state"][k]["exp_avg"],
                               state_before["state"][k]["exp_avg"])
        # A finite step afterwards applies normally.
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert not opt.found_inf and opt.last_step["step"] == 2


def test_unsupported_dtype(dos_socket):
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(dos.DosError) as e:
        dos.torch.AdamW([p], socket=dos_socket)
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert "torch.float64" in e.value.message and "bfloat16" in e.value.message


def test_param_replaced_by_another_shape(dos_socket):
    """A parameter's .data replaced by a tensor of another dtype re-registers
    (test_dropin.py); of another shape, step() refuses, naming it."""
    model = torch.nn.Linear(4, 2)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket) as opt:
        model.weight.data = torch.zeros(3, 4)  # moved out from under DOS
        model.weight.grad = torch.zeros(3, 4)
        with pytest.raises(dos.DosError) as e:
            opt.step()
        assert e.value.code_name == "FAILED_PRECONDITION"
        assert "param 0" in e.value.message and "shared memory" in e.value.message
        assert "(3, 4)" in e.value.message and "shape" in e.value.message


def test_grad_none_is_skipped(dos_socket):
    """A parameter whose grad is None at step() is skipped as torch skips
    it (test_dropin.py has the training patterns)."""
    model = torch.nn.Linear(4, 2)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, lr=0.1) as opt:
        model(torch.randn(3, 4)).sum().backward()
        bias = model.bias.detach().clone()
        model.bias.grad = None
        opt.step()
        assert torch.equal(model.bias.detach(), bias)
        assert opt.state[model.bias] == {}  # never stepped: no state, as torch
        assert float(opt.state[model.weight]["step"]) == 1


def test_replaced_grad_is_copied_in(dos_socket):
    torch.manual_seed(0)
    ref, mine = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    mine.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters())
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket) as opt:
        x = torch.randn(3, 4)
        for model in (ref, mine):
            for p in model.parameters():
                p.grad = None  # what torch 2.x's model.zero_grad() does
            model(x).sum().backward()
        ref_opt.step()
        opt.step()
        assert_same(mine, ref, 1)


def test_frozen_params_not_registered(dos_socket):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, lr=0.1) as opt:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert torch.equal(model[0].weight, frozen)
        assert model[0].weight.grad is None
        assert len(opt.state_dict()["state"]) == 3


def test_amsgrad_not_implemented(dos_socket):
    with pytest.raises(NotImplementedError):
        dos.torch.AdamW(torch.nn.Linear(2, 2).parameters(), socket=dos_socket, amsgrad=True)


def test_daemon_down_message(tmp_path):
    sock = tmp_path / "nobody.sock"
    with pytest.raises(dos.DosError) as e:
        dos.torch.AdamW(torch.nn.Linear(2, 2).parameters(), socket=str(sock))
    assert e.value.code_name == "UNAVAILABLE"
    assert str(sock) in e.value.message and "DOS_SOCKET" in e.value.message


def test_second_step_begin_without_wait_is_refused(dos_socket):
    import ctypes

    from dos import _errors, _native
    model = torch.nn.Linear(4, 2)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket) as opt:
        model(torch.randn(2, 4)).sum().backward()
        groups = opt._parts.reg.hparams(opt.param_groups)
        args = _native.StepArgs()
        _native.lib.dos_step_args_init(ctypes.byref(args))
        args.groups, args.num_groups = groups, len(groups)
        _errors.call("dos_step_begin", opt._session, ctypes.byref(args))
        with pytest.raises(dos.DosError) as e:
            _errors.call("dos_step_begin", opt._session, ctypes.byref(args))
        assert e.value.code_name == "FAILED_PRECONDITION" and "in flight" in e.value.message
        res = _native.StepResult()
        _errors.call("dos_step_wait", opt._session, ctypes.c_int64(-1), ctypes.byref(res))
        assert res.step == 1
