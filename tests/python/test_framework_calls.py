"""Frameworks' own calls that DOS answers differently (dos/_callers.py):
accelerate's device placement round trip (AcceleratedOptimizer.__init__:
state_dict(), every tensor to the device, load_state_dict()) moves no state
and changes none, also once the optimizer has state; the same calls made by
a user still read and load the state."""

import types

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402

# accelerate/optimizer.py's placement, as accelerate writes it (the module's
# name and the __init__ frame are what DOS recognises).
ACCELERATE_OPTIMIZER = '''
import torch

moved = []


def move_to_device(state, device):
    if isinstance(state, (list, tuple)):
        return type(state)(move_to_device(t, device) for t in state)
    if isinstance(state, dict):
        return type(state)({k: move_to_device(v, device) for k, v in state.items()})
    if isinstance(state, torch.Tensor):
        moved.append(state.numel() * state.element_size())
        return state.clone()  # a copy, as .to("cuda") would make
    return state


class AcceleratedOptimizer:
    def __init__(self, optimizer, device_placement=True):
        self.optimizer = optimizer
        if device_placement:
            state_dict = self.optimizer.state_dict()
            state_dict = move_to_device(state_dict, "cpu")
            self.optimizer.load_state_dict(state_dict)
'''


@pytest.fixture
def accelerate_optimizer():
    mod = types.ModuleType("accelerate.optimizer")
    exec(compile(ACCELERATE_OPTIMIZER, "accelerate/optimizer.py", "exec"), mod.__dict__)
    return mod


def snapshot(opt):
    return {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for i, s in opt.state_dict()["state"].items()}


def train(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("delay", [0, 1])
def test_accelerates_placement_moves_and_changes_no_state(dos_socket, accelerate_optimizer,
                                                          delay):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    x, y = torch.randn(8, 512), torch.randn(8, 4)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket, model=model,
                         delay=delay, delay_warmup=1) as opt:
        accelerate_optimizer.AcceleratedOptimizer(opt)  # before any step: no state
        train(model, opt, x, y, 3)
        before = snapshot(opt)
        weights = [p.detach().clone() for p in model.parameters()]
        assert before and all(s["exp_avg"].abs().sum() > 0 for s in before.values())
        accelerate_optimizer.AcceleratedOptimizer(opt)  # a second prepare, a resumed session
        assert sum(accelerate_optimizer.moved) == 0  # not one state tensor copied
        after = snapshot(opt)
        assert after.keys() == before.keys()
        for i in before:
            for k, v in before[i].items():
                assert (torch.equal(after[i][k], v) if torch.is_tensor(v)
                        else after[i][k] == v), (i, k)
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
        # A user's own round trip still moves the state (and changes nothing).
        opt.load_state_dict(accelerate_optimizer.move_to_device(opt.state_dict(), "cpu"))
        assert sum(accelerate_optimizer.moved) > 0


def test_a_model_moved_before_its_first_step_is_registered_again_reading_no_state(
        dos_socket, monkeypatch):
    """A framework moving the model to its device after the optimizer was built
    (the HF Trainer's _move_model_to_device with optimizers=(opt, None)), or a
    param group added before training: the new session starts from the
    parameters without reading the old one's state (12 bytes a parameter in
    the trainer, 81 GB at 7B); training then matches, bit for bit, an
    optimizer built with every parameter where it ends up."""
    from dos._state import StateIO
    reads = []
    read = StateIO.read
    monkeypatch.setattr(StateIO, "read", lambda self, e: reads.append(e.name) or read(self, e))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    ref.load_state_dict(model.state_dict())
    extra = torch.nn.Parameter(torch.randn(4))
    ref_extra = torch.nn.Parameter(extra.detach().clone())
    x, y = torch.randn(8, 64), torch.randn(8, 4)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket) as opt, \
            dos.torch.AdamW(list(ref.parameters()) + [ref_extra], lr=1e-3,
                            socket=dos_socket) as ref_opt:
        opt.add_param_group({"params": [extra]})
        for p in model.parameters():  # new storage, same values and dtype: a device move
            p.data = p.data.clone()
        for step in range(3):
            for m, o, e in ((model, opt, extra), (ref, ref_opt, ref_extra)):
                o.zero_grad()
                (torch.nn.functional.mse_loss(m(x), y) + e.square().sum()).backward()
                if o is opt and step == 0:
                    with pytest.warns(RuntimeWarning, match="re-registering"):
                        o.step()
                else:
                    o.step()
        assert reads == []  # nothing read: no step had run before either rebuild
        for p, q in zip(list(model.parameters()) + [extra], list(ref.parameters()) + [ref_extra]):
            assert torch.equal(p, q)


def test_a_rebuild_attaches_again_under_a_one_session_cap():
    """A rebuild closes its session and attaches a new one at once; the old
    session's control block, still mapped until the client's detach returns,
    counts as a session only until dosd looks again (at the attach), so a
    user whose cap is one session is not refused by their own rebuild."""
    from conftest import running_dosd
    with running_dosd("--max_sessions_per_uid=1") as (sock, _):
        model = torch.nn.Linear(8, 4)
        extra = torch.nn.Parameter(torch.randn(4))
        with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=sock) as opt:
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
            opt.add_param_group({"params": [extra]})  # a rebuild with state
            opt.zero_grad()
            (model(torch.randn(2, 8)).sum() + extra.sum()).backward()
            opt.step()
            assert float(opt.state_dict()["state"][0]["step"]) == 3
