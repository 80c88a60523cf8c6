"""State at any scale: state_dict() streams the daemon's state into CPU
tensors (values equal to the daemon's, host memory bounded by the result
plus one staging buffer), load_state_dict() streams it back, ranged state
transfer through the C ABI, and param_groups that carry torch.optim.AdamW's
keys both ways."""

import copy
import ctypes

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from dos import _errors  # noqa: E402
from test_equivalence import make_data, make_mlp  # noqa: E402

LR = dict(lr=2e-3, weight_decay=0.05)
MiB = 1 << 20


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def storage_bytes(t):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().nbytes()
    return t.storage().size() * t.element_size()  # torch 1.13


def daemon_state(opt, e):
    """Tensor e's (master, exp_avg, exp_avg_sq, step) read with the C ABI."""
    n = e.local.numel()
    buf = torch.empty(3, n)
    step = ctypes.c_int64()
    _errors.call("dos_state_read", opt._session, ctypes.c_uint32(e.index), buf[0].data_ptr(),
                 buf[1].data_ptr(), buf[2].data_ptr(), ctypes.byref(step))
    return buf, step.value


def test_state_dict_is_cpu_and_equals_the_daemons(dos_socket):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    model[1].to(torch.bfloat16)  # a 16-bit layer: its state carries master_param
    data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(5)]
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        for x, y in data:
            opt.zero_grad()
            out = model[1](model[0](x).to(torch.bfloat16)).float()
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
        sd = opt.state_dict()
        for e in opt._entries:
            s = sd["state"][e.index]
            buf, step = daemon_state(opt, e)
            assert float(s["step"]) == step == 5
            keys = {"step", "exp_avg", "exp_avg_sq"}
            if e.param.dtype != torch.float32:
                keys.add("master_param")
                assert torch.equal(s["master_param"].reshape(-1), buf[0])
            assert set(s) == keys
            for key, row in (("exp_avg", 1), ("exp_avg_sq", 2)):
                t = s[key]
                assert t.device.type == "cpu" and t.dtype == torch.float32
                assert t.shape == e.param.shape
                assert torch.equal(t.reshape(-1), buf[row])
            # Own storage per tensor: no larger buffer is kept alive behind it.
            assert storage_bytes(s["exp_avg"]) == 4 * e.param.numel()


def test_state_dict_waits_for_the_step_in_flight(dos_socket):
    """A step begun and not collected (as the overlap hooks or an asynchronous
    GPU step leave it) is finished before the state is read."""
    model = make_mlp()
    data = make_data(n=4)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, data[:3])
        x, y = data[3]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            dos._grads.bind(opt._entries)
            args = opt._parts.driver.args(1.0, 1.0)
            opt._parts.driver.begin(args)  # what the overlap hooks do at the end of backward
        assert opt._inflight
        sd = opt.state_dict()
        assert not opt._inflight
        assert all(float(s["step"]) == 4 for s in sd["state"].values())


def test_ranged_transfer_matches_whole_tensor(dos_socket):
    """dos_state_read_range / dos_state_write_range on a tensor larger than the
    client's 4 Mi-element transfer piece."""
    n = (4 << 20) + 12345
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    with dos.torch.AdamW([p], socket=dos_socket, **LR) as opt:
        opt.step()
        whole, step = daemon_state(opt, opt._entries[0])
        sess = opt._session
        off, cnt = (4 << 20) - 100, 5000  # crosses a piece boundary
        part = torch.empty(3, cnt)
        got = ctypes.c_int64()
        _errors.call("dos_state_read_range", sess, ctypes.c_uint32(0), ctypes.c_uint64(off),
                     ctypes.c_uint64(cnt), part[0].data_ptr(), part[1].data_ptr(),
                     part[2].data_ptr(), ctypes.byref(got))
        assert got.value == step == 1
        assert torch.equal(part, whole[:, off:off + cnt])
        # Write a range: only it changes, and the weights there follow the masters.
        new = torch.full((3, cnt), 0.5)
        _errors.call("dos_state_write_range", sess, ctypes.c_uint32(0), ctypes.c_uint64(off),
                     ctypes.c_uint64(cnt), new[0].data_ptr(), new[1].data_ptr(),
                     new[2].data_ptr(), ctypes.c_int64(7))
        after, step = daemon_state(opt, opt._entries[0])
        assert step == 7
        assert torch.equal(after[:, off:off + cnt], new)
        assert torch.equal(after[:, :off], whole[:, :off])
        assert torch.equal(after[:, off + cnt:], whole[:, off + cnt:])
        assert torch.equal(p.detach()[off:off + cnt], torch.full((cnt,), 0.5))
        assert torch.equal(p.detach()[:off], whole[0, :off])
        with pytest.raises(dos.DosError) as e:
            _errors.call("dos_state_read_range", sess, ctypes.c_uint32(0), ctypes.c_uint64(n),
                         ctypes.c_uint64(1), None, None, None, None)
        assert e.value.code_name == "OUT_OF_RANGE" and str(n) in e.value.message


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS through /proc/self/clear_refs: {e}")


class _AnonPeak:
    """Peak RssAnon (the process's private memory: what a copy of the state
    would cost; pages of dosd's that views map are RssShmem/RssFile) while
    the block runs, sampled every 2 ms."""

    def __enter__(self):
        import threading
        self.peak, self.stop = 0, threading.Event()
        self.base = self._read()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    @staticmethod
    def _read():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

    def _run(self):
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, self._read())

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()
        self.peak = max(self.peak, self._read())
        self.grown = self.peak - self.base


def _peak_and_rss():
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) * 1024
    return vals["VmHWM"], vals["VmRSS"]


def test_state_dict_and_load_peak_memory_is_bounded(dos_socket):
    """A 33.6M-parameter (134 MB) model: state_dict() adds nothing of the
    trainer's own to the peak RSS (its tensors are views of dosd's memory:
    dos/_views.py); load_state_dict() of it after the caller wrote into it
    (the written pages become the caller's) adds at most one 48 MiB transfer
    buffer and the daemon then holds the written values. (Before: 8 B per
    parameter for the result; before that, 12 B/param kept plus the whole
    largest tensor staged at once.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False),
                                torch.nn.Linear(4096, 4096, bias=False))
    nparams = sum(p.numel() for p in model.parameters())
    margin = 24 * MiB  # interpreter and allocator noise
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        for p in model.parameters():
            p.grad.normal_()
        opt.step()
        _reset_peak()
        base_peak, base_rss = _peak_and_rss()
        sd = opt.state_dict()
        peak, rss = _peak_and_rss()
        grown = peak - base_rss
        assert grown <= margin, (
            f"state_dict raised the peak RSS by {grown / MiB:.0f} MiB for a "
            f"{8 * nparams / MiB:.0f} MiB state")
        for s in sd["state"].values():  # something to load that differs from the daemon's
            s["exp_avg"].mul_(2)
        with _AnonPeak() as anon:
            opt.load_state_dict(sd)
        assert anon.grown <= 48 * MiB + margin, (
            f"load_state_dict raised the peak RssAnon by {anon.grown / MiB:.0f} MiB")
        e = opt._entries[0]
        buf, _ = daemon_state(opt, e)
        assert torch.equal(buf[1], sd["state"][0]["exp_avg"].reshape(-1))


def test_load_converts_other_dtypes_and_shapes_in_pieces(dos_socket):
    """fp64 / non-contiguous state (as from another tool) goes through the
    ranged path; the daemon gets the fp32 values."""
    model = make_mlp()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, make_data(n=2))
        sd = opt.state_dict()
        want = {}
        for k, s in sd["state"].items():
            want[k] = (s["exp_avg"] + 1, s["exp_avg_sq"] + 2)
            s["exp_avg"] = want[k][0].double()
            t = want[k][1]
            s["exp_avg_sq"] = t.t().contiguous().t() if t.dim() == 2 else t.double()
            s["step"] = torch.tensor(9.0)
        opt.load_state_dict(sd)
        for e in opt._entries:
            buf, step = daemon_state(opt, e)
            assert step == 9
            assert torch.equal(buf[1], want[e.index][0].reshape(-1))
            assert torch.equal(buf[2], want[e.index][1].reshape(-1))


def state_snapshot(opt):
    """opt.state_dict() copied (its tensors are views of dosd's memory)."""
    sd = opt.state_dict()
    return {"state": {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()}
                      for k, s in sd["state"].items()},
            "param_groups": copy.deepcopy(sd["param_groups"])}


def assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, s in a["state"].items():
        assert s.keys() == b["state"][k].keys(), k
        for n, t in s.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(b["state"][k][n])), (k, n)


@pytest.mark.parametrize("flaw", ["last_tensor_short", "moment_missing", "step_negative",
                                  "step_missing", "exp_avg_meta", "step_2**63",
                                  "step_2**63_tensor", "step_2**64+4096", "exp_avg_complex"])
def test_a_refused_load_loads_nothing(dos_socket, flaw):
    """A state dict whose last tensor is wrong (a moment one element short,
    missing, on the meta device: no data, or complex; a step count over dosd's 2**53,
    which once wrapped or was refused by dosd only at its write) is
    refused naming it, and nothing of it is loaded: the earlier tensors'
    state, the step counts and the lr stay as they were (it once wrote every
    tensor before the wrong one)."""
    model = make_mlp()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, make_data(n=3))
        before = [daemon_state(opt, e) for e in opt._entries]
        before_sd = state_snapshot(opt)
        sd = opt.state_dict()
        bad = {"state": {k: {n: (t.clone() + 1 if torch.is_tensor(t) else t)
                             for n, t in s.items()} for k, s in sd["state"].items()},
               "param_groups": [dict(g, lr=0.5) for g in sd["param_groups"]]}
        last = bad["state"][max(bad["state"])]
        for s in bad["state"].values():
            s["step"] = torch.tensor(50.0)
        if flaw == "last_tensor_short":
            last["exp_avg_sq"] = last["exp_avg_sq"].reshape(-1)[1:]
        elif flaw == "moment_missing":
            del last["exp_avg"]
        elif flaw == "step_negative":  # dosd refuses it, at the last tensor's write
            last["step"] = torch.tensor(-1.0)
        elif flaw == "exp_avg_meta":  # no data: reading it once raised after earlier writes
            last["exp_avg"] = torch.empty(last["exp_avg"].shape, device="meta")
        elif flaw == "exp_avg_complex":  # once loaded its real part, with only torch's warning
            last["exp_avg"] = torch.complex(last["exp_avg"], last["exp_avg"])
        elif flaw == "step_2**63":  # one past int64: dosd refused it after earlier writes
            last["step"] = float(2**63)
        elif flaw == "step_2**63_tensor":
            last["step"] = torch.tensor(2.0**63, dtype=torch.float64)
        elif flaw == "step_2**64+4096":  # once wrapped to 4096 and loaded
            last["step"] = 2**64 + 4096
        else:
            del last["step"]
        with pytest.raises(dos.DosError) as err:
            opt.load_state_dict(bad)
        assert ("exp_avg" if "step" not in flaw else "'step'") in str(err.value), err.value
        if "2**6" in flaw:
            assert "2**53" in str(err.value), err.value
        assert opt.param_groups[0]["lr"] == LR["lr"]
        for e, (buf, step) in zip(opt._entries, before):
            now, now_step = daemon_state(opt, e)
            assert now_step == step == 3 and torch.equal(now, buf), e.name
        assert_same_state(state_snapshot(opt), before_sd)


def test_the_largest_step_count_loads_exactly(dos_socket):
    """A step count is loaded exactly up to dosd's largest, 2**53, as an int,
    a float or a tensor; an int one more is refused, not rounded through a
    float to 2**53 (as it once was), and loads nothing."""
    model = make_mlp()
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, make_data(n=1))
        sd = state_snapshot(opt)
        steps = [2**53, 2.0**52, torch.tensor(2**53 - 1), torch.tensor(8.0)]
        for k, step in zip(sorted(sd["state"]), steps * len(sd["state"])):
            sd["state"][k]["step"] = step
        opt.load_state_dict(sd)
        for e, step in zip(opt._entries, steps * len(opt._entries)):
            assert daemon_state(opt, e)[1] == int(step), e.name
        loaded = state_snapshot(opt)
        sd["state"][max(sd["state"])]["step"] = 2**53 + 1
        with pytest.raises(dos.DosError, match="2\\*\\*53"):
            opt.load_state_dict(sd)
        assert_same_state(state_snapshot(opt), loaded)


def test_a_state_dict_kept_across_steps_loads_as_torchs_does(dos_socket):
    """A state dict kept without a copy while training goes on (a "best so
    far" kept by reference): its views show the later steps, as torch's live
    state tensors do, so loading it changes nothing, as in torch. It once
    wrote the later moments with the earlier step count. A step count
    changed by hand is still loaded."""
    data = make_data(n=8)
    model = make_mlp()
    ref = make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, data[:3])
        train(ref, ref_opt, data[:3])
        held, ref_held = opt.state_dict(), ref_opt.state_dict()
        train(model, opt, data[3:5])
        train(ref, ref_opt, data[3:5])
        before = [daemon_state(opt, e) for e in opt._entries]
        opt.load_state_dict(held)
        ref_opt.load_state_dict(ref_held)
        for e, (buf, step) in zip(opt._entries, before):
            now, now_step = daemon_state(opt, e)
            assert now_step == step == 5 and torch.equal(now, buf), e.name
        assert all(float(s["step"]) == 5 for s in ref_opt.state_dict()["state"].values())
        copied = copy.deepcopy(opt.state_dict())  # a copy rolls the moments back, as torch's
        train(model, opt, data[5:6])
        opt.load_state_dict(copied)
        for e, (buf, step) in zip(opt._entries, before):
            now, now_step = daemon_state(opt, e)
            assert now_step == step == 5 and torch.equal(now[1:], buf[1:]), e.name
        held = opt.state_dict()
        for s in held["state"].values():
            s["step"].fill_(2)
        smallest = min(opt._entries, key=lambda e: e.local.numel())  # its moments: copies
        held["state"][smallest.index]["exp_avg"].data.zero_()  # moves no version counter
        opt.load_state_dict(held)
        assert all(daemon_state(opt, e)[1] == 2 for e in opt._entries)
        assert not daemon_state(opt, smallest)[0][1].any()


def test_a_closed_optimizers_state_dict_loads_into_the_next_one(dos_socket):
    """The state dict of an optimizer closed since (its views outlive it;
    its small tensors are copies) loads into a new optimizer over the same
    model, whose session may sit where the old one's was freed: it once
    looked like the new session's own state and was skipped."""
    data = make_data(n=4)
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR)
    train(model, opt, data)
    held = opt.state_dict()
    want = [daemon_state(opt, e) for e in opt._entries]
    opt.close()
    for _ in range(3):
        with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as again:
            again.load_state_dict(held)
            for e, (buf, step) in zip(again._entries, want):
                now, now_step = daemon_state(again, e)
                assert now_step == step == 4 and torch.equal(now[1:], buf[1:]), e.name


def test_param_groups_carry_torch_adamw_keys(dos_socket):
    """A DOS state dict has every key of torch.optim.AdamW's param_groups, so
    loading it into torch's AdamW keeps them; a torch AdamW state dict with
    non-default keys loads into DOS and comes back out unchanged."""
    model = make_mlp()
    torch_keys = set(torch.optim.AdamW(make_mlp().parameters()).state_dict()["param_groups"][0])
    with dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR) as opt:
        train(model, opt, make_data(n=3))
        sd = opt.state_dict()
    assert torch_keys <= set(sd["param_groups"][0]), torch_keys - set(sd["param_groups"][0])
    other = make_mlp()
    topt = torch.optim.AdamW(other.parameters(), **LR)
    topt.load_state_dict(sd)
    for key in torch_keys - {"params"}:
        assert topt.param_groups[0][key] == sd["param_groups"][0][key], key
    train(other, topt, make_data(n=1))  # torch steps with the loaded state

    # torch -> DOS -> torch: the non-default flag survives the round trip.
    flag = "foreach" if "foreach" in torch_keys else None
    src = make_mlp()
    kwargs = {flag: False} if flag else {}
    topt2 = torch.optim.AdamW(src.parameters(), **LR, **kwargs)
    train(src, topt2, make_data(n=4))
    tsd = topt2.state_dict()
    dst = make_mlp()
    with dos.torch.AdamW(dst.parameters(), socket=dos_socket, **LR) as opt:
        opt.load_state_dict(tsd)
        back = opt.state_dict()
    if flag:
        assert back["param_groups"][0][flag] is False
    for k, s in tsd["state"].items():
        b = back["state"][k]
        assert float(b["step"]) == float(s["step"]) == 4
        assert torch.equal(b["exp_avg"], s["exp_avg"])
        assert torch.equal(b["exp_avg_sq"], s["exp_avg_sq"])


def test_round_trip_dos_torch_dos_continues_exactly(dos_socket):
    """DOS state -> torch AdamW -> its state dict -> a new DOS optimizer:
    training continues as the first DOS optimizer would have."""
    data = make_data(n=8)
    a = make_mlp()
    with dos.torch.AdamW(a.parameters(), socket=dos_socket, **LR) as opt:
        train(a, opt, data[:4])
        sd = copy.deepcopy(opt.state_dict())  # kept as it is now: a copy, as with torch's
        weights = {k: v.clone() for k, v in a.state_dict().items()}
        train(a, opt, data[4:])
        expected = [p.detach().clone() for p in a.parameters()]
    mid = make_mlp()
    mid.load_state_dict(weights)
    topt = torch.optim.AdamW(mid.parameters(), **LR)
    topt.load_state_dict(sd)
    tsd = topt.state_dict()
    b = make_mlp()
    b.load_state_dict(weights)
    with dos.torch.AdamW(b.parameters(), socket=dos_socket, **LR) as opt:
        opt.load_state_dict(tsd)
        train(b, opt, data[4:])
        for x, y in zip(b.parameters(), expected):
            assert torch.equal(x.detach(), y)


def test_a_closed_optimizer_refuses_every_call_that_needs_its_session(dos_socket):
    """After close() every call that needs dosd's session raises
    FAILED_PRECONDITION naming itself (zero_grad() once raised an
    AttributeError and clip_grad_norm_() returned a norm for no step);
    synchronize() has nothing to wait for and the state is empty."""
    model = make_mlp()
    opt = dos.torch.AdamW(model.parameters(), socket=dos_socket, **LR)
    train(model, opt, make_data(n=1))
    opt.close()
    p = next(model.parameters())
    calls = {"step": opt.step, "zero_grad": opt.zero_grad, "state_dict": opt.state_dict,
             "clip_grad_norm_": lambda: opt.clip_grad_norm_(1.0),
             "load_state_dict": lambda: opt.load_state_dict({"state": {}, "param_groups": []}),
             "add_param_group": lambda: opt.add_param_group({"params": [torch.ones(2)]}),
             "set_policy": lambda: opt.set_policy("cpu"),
             "reload_weights": opt.reload_weights}
    ran = []
    with pytest.raises(dos.DosError, match="step: the optimizer is closed"):
        opt.step(lambda: ran.append(1))
    assert not ran, "the closure's forward and backward ran for a step that cannot come"
    for name, call in calls.items():
        with pytest.raises(dos.DosError) as e:
            call()
        assert e.value.code_name == "FAILED_PRECONDITION", name
        assert f"{name}: the optimizer is closed" in str(e.value), e.value
    opt.synchronize()
    assert opt.state[p] == {}
