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


# torch/distributed/checkpoint/state_dict.py's init step (torch >= 2.4), as
# torch writes it: with opt.state empty and every gradient None (FSDP2 after
# zero_grad(set_to_none=True)), a step with zero gradients and lr 0.
DCP_STATE_DICT = '''
import torch


def _init_optim_state(optim):
    if optim.state:
        return
    for group in optim.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return
    for group in optim.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = []
    for group in optim.param_groups:
        lrs.append(group["lr"])
        group["lr"] = 0.0
    optim.step(closure=None)
    for group in optim.param_groups:
        group["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)
'''


@pytest.mark.parametrize("delay", [0, 1])
def test_dcps_zero_gradient_init_step_changes_no_state(dos_socket, delay):
    """get_optimizer_state_dict / set_optimizer_state_dict on an FSDP2 model
    after zero_grad(set_to_none=True) call DCP's init step; run, it would
    decay both moments and count a step in the live state and in the
    checkpoint being written (dosd holds every parameter's state already)."""
    mod = types.ModuleType("torch.distributed.checkpoint.state_dict")
    exec(compile(DCP_STATE_DICT, "torch/distributed/checkpoint/state_dict.py", "exec"),
         mod.__dict__)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    x, y = torch.randn(8, 64), torch.randn(8, 4)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket, model=model,
                         delay=delay, delay_warmup=1) as opt:
        train(model, opt, x, y, 3)
        opt.zero_grad(set_to_none=True)
        for p in model.parameters():  # FSDP2's gradients: not registered, None now
            p.grad = None
        before = snapshot(opt)
        weights = [p.detach().clone() for p in model.parameters()]
        mod._init_optim_state(opt)
        after = snapshot(opt)
        for i in before:
            for k, v in before[i].items():
                assert (torch.equal(after[i][k], v) if torch.is_tensor(v)
                        else after[i][k] == v), (i, k)
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
        assert opt.param_groups[0]["lr"] == 1e-3
        train(model, opt, x, y, 1)  # training goes on from the same state
        assert float(opt.state_dict()["state"][0]["step"]) == 4


class LightningLikeOptimizer:
    """lightning.pytorch.core.optimizer.LightningOptimizer's way of wrapping:
    a copy of the optimizer's __dict__ (the same values) and a class deriving
    from the optimizer's, step() forwarded."""

    def __init__(self, optimizer):
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items()
                         if k not in ("step", "__del__")}
        self.__class__ = type("Lightning" + optimizer.__class__.__name__,
                              (self.__class__, optimizer.__class__), {})
        self._optimizer = optimizer

    def step(self, closure=None):
        return self._optimizer.step(closure)


def test_clip_grad_norm_through_a_lightning_wrapper_clips_the_step(dos_socket):
    """Manual optimisation in Lightning: opt = self.optimizers();
    opt.clip_grad_norm_(1.0); opt.step(). The coefficient set through the
    wrapper goes with the optimizer's next step (it was set on the wrapper
    alone and dropped); bit for bit the same as the call on the optimizer."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(32, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(8, 32) * 50, torch.randn(8, 4)
    with dos.torch.AdamW(models[0].parameters(), lr=1e-2, socket=dos_socket) as a, \
            dos.torch.AdamW(models[1].parameters(), lr=1e-2, socket=dos_socket) as b:
        wrapped = LightningLikeOptimizer(a)
        for _ in range(3):
            for m, opt in ((models[0], wrapped), (models[1], b)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                assert float(opt.clip_grad_norm_(0.5)) > 0.5  # clipping applies
                opt.step()
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)


def patch_optimizer_step(accelerated_optimizer, method):
    def patched_step(*args, **kwargs):
        accelerated_optimizer._accelerate_step_called = True
        return method(*args, **kwargs)
    return patched_step


class AcceleratedOptimizerWithScaler:
    """accelerate's AcceleratedOptimizer with a GradScaler (fp16), as
    accelerate 1.x writes it: a skip is inferred from step() not being
    called while its function is over the optimizer's step."""

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler, self._is_overflow = optimizer, scaler, False
        self._accelerate_step_called = False
        self._optimizer_original_step_method = self.optimizer.step
        self._optimizer_patched_step_method = patch_optimizer_step(self, self.optimizer.step)

    def step(self, closure=None):
        self.optimizer.step = self._optimizer_patched_step_method
        self.scaler.step(self.optimizer, closure)
        self._is_overflow = not self._accelerate_step_called
        self.optimizer.step = self._optimizer_original_step_method
        self._accelerate_step_called = False

    @property
    def step_was_skipped(self):
        return self._is_overflow


class Torch2Scaler:
    """torch 2.x GradScaler.step() for an optimizer that sets
    _step_supports_amp_scaling: its own inf check in `found_inf`, the scale
    in `grad_scale`, both deleted after step()."""

    def __init__(self):
        self.found = False

    def step(self, opt, closure=None):
        opt.grad_scale = torch.tensor(1.0)
        opt.found_inf = torch.tensor(1.0 if self.found else 0.0)
        try:
            return opt.step(closure)
        finally:
            del opt.grad_scale
            del opt.found_inf


@pytest.mark.parametrize("delay", [0, 1])
def test_a_step_the_scaler_skips_is_skipped_to_accelerate(dos_socket, delay):
    """fp16 under the HF Trainer / Accelerate: a skipped step shows in
    step_was_skipped (the Trainer then leaves its LR scheduler), a taken one
    does not; the skipped step changes no weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    scaler = Torch2Scaler()
    with dos.torch.AdamW(model.parameters(), lr=1e-2, socket=dos_socket, model=model,
                         delay=delay, delay_warmup=1) as opt:
        wrapped = AcceleratedOptimizerWithScaler(opt, scaler)
        for found in (False, False, True, False, True, True, False):
            scaler.found = found
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            before = [p.detach().clone() for p in model.parameters()]
            wrapped.step()
            assert wrapped.step_was_skipped == found
            opt.synchronize()
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) == found
        assert float(opt.state_dict()["state"][0]["step"]) == 4
