"""Autosaves follow the state, whatever its tensors' step counts say (a
review found them keyed on tensor 0's count): a first parameter that stops
getting gradients does not stop the autosaves, and after a trainer rolls
back to an earlier step its newest autosave is the one kept and restored."""
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402
from conftest import running_dosd  # noqa: E402


def wait_for(store, pred, what, timeout=20):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        names = sorted(n for _, _, fs in os.walk(store) for n in fs if n.endswith(".dckpt"))
        if pred(names):
            return names
        time.sleep(0.05)
    pytest.fail(f"{what}: autosaves in {store}: {names}")


def auto(step):
    return f"auto-{step:012d}."


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    return model, torch.randn(8, 256), torch.randn(8, 4)


def step(model, opt, x, y, frozen=()):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    for p in frozen:
        loss = loss + 0 * p.detach().sum()  # no gradient reaches p
    loss.backward()
    opt.step()
    opt.synchronize()


def test_a_first_parameter_without_gradients_stops_no_autosave(tmp_path):
    store = str(tmp_path / "store")
    with running_dosd(f"--checkpoint_dir={store}", "--autosave_interval=50ms") as (sock, _):
        model, x, y = model_and_data()
        with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=sock,
                             client_name="frozen_first") as opt:
            step(model, opt, x, y)
            first = model[0].weight
            first.requires_grad_(False)  # tensor 0 stays at step 1 from here
            for n in range(2, 6):
                step(model, opt, x, y)
                wait_for(store, lambda names, n=n: any(f.startswith(auto(n)) for f in names),
                         f"no autosave of step {n}")
            assert int(opt.state_dict()["state"][0]["step"]) == 1


def test_after_a_rollback_the_newest_autosave_is_kept_and_restored(tmp_path):
    store = str(tmp_path / "store")
    flags = (f"--checkpoint_dir={store}", "--autosave_interval=50ms", "--autosave_keep=1")
    with running_dosd(*flags, killed_ok=True) as (sock, proc):
        model, x, y = model_and_data()
        opt = dos.torch.AdamW(model.parameters(), lr=1e-3, socket=sock, client_name="rollback")
        step(model, opt, x, y)
        step(model, opt, x, y)
        at2 = {"model": {k: v.clone() for k, v in model.state_dict().items()},
               "opt": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                       for i, s in opt.state_dict()["state"].items()}}
        for _ in range(3):
            step(model, opt, x, y)
        wait_for(store, lambda names: names and names[0].startswith(auto(5)),
                 "no autosave of step 5 alone")
        # Roll back to step 2 (a loss spike), then train on: step 3 of the new branch.
        sd = opt.state_dict()
        sd["state"] = at2["opt"]
        model.load_state_dict(at2["model"])
        opt.load_state_dict(sd)
        step(model, opt, x, y)
        live = [p.detach().clone() for p in model.parameters()]
        names = wait_for(store, lambda names: any(n.startswith(auto(3)) for n in names)
                         and not any(n.startswith(auto(5)) for n in names),
                         "the branch's step 3 not kept alone (auto-5 pruned, auto-3 kept)")
        time.sleep(0.3)  # a few more autosave rounds: the newest stays
        assert wait_for(store, lambda n: True, "") == names
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        opt._parts = None  # dosd is gone: nothing to close
    with running_dosd(*flags) as (sock, _):
        model, _, _ = model_and_data()
        with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=sock,
                             client_name="rollback") as opt:
            assert int(opt.state_dict()["state"][0]["step"]) == 3
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), live))
