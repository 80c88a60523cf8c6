"""torch.optim optimizers whose fp32 state lives in the node's dosd daemon.

    import dos.torch
    opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

The manual (the shared binding and its rules, GPU mode, asynchronous and
early steps, reading weights after step(), AMP, several ranks, state, crash
survival) is docs/python.md. This module holds the public classes and their
rules; they are composed of parts with narrow interfaces:

    dos/_assembly.py  Assembly: builds and wires the parts (composition root)
    dos/_register.py  Registration: the session and the registered tensors
    dos/_grads.py     gradients into the registered buffers, zeroing
    dos/_state.py     StateIO: state_dict()/load_state_dict(); opt.state
    dos/_lease.py     GpuLease: the GPU memory lent to dosd
    dos/_step.py      StepMode, decided once (decide_mode); StepMachine
    dos/_flight.py    Flight: the step in flight and dosd's report on it
    dos/_drivers.py   one step driver per way a step completes
    dos/_hooks.py     LayerHooks: per-layer waits on the model (model=)
    dos/_early.py     VerdictDriver, UpdateDriver: steps begun during backward
    dos/_amp.py       the GradScaler protocol
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Any, Dict, List, Optional

import torch

from dos import _amp, _callers, _grads, _native
from dos._assembly import Assembly, Options
from dos._carry import rescued_state_dict
from dos._drivers import StepRequest
from dos._delay import check_delay
from dos._early import check_overlap
from dos._errors import DosError, call
from dos._hooks import weak_hook
from dos._opt_state import DaemonState
from dos._session import closed_error, track, untrack
from dos._state import check_args, group_defaults, once_each

__all__ = ["AdamW", "Adam", "DosError", "rescued_state_dict"]

# zero_grad()'s set_to_none default of the running torch (False in 1.x,
# True from 2.0): DOS's zero_grad() without an argument follows it.
_SET_TO_NONE_DEFAULT = bool(inspect.signature(torch.optim.Optimizer.zero_grad)
                            .parameters["set_to_none"].default)


class _DosAdamBase(torch.optim.Optimizer):
    """The optimizer: construction, step(), zero_grad(), close(), composed
    of the parts listed in this module's docstring."""

    _decoupled = True  # AdamW; Adam (L2) overrides

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler hands the loss scale to step() instead of unscaling in
        place (no pass over the gradients). Lightning reads the same flag to
        refuse gradient_clip_val ("performs unscaling of gradients
        internally"): to Lightning the answer is False, so it unscales in
        place (16-mixed), clips the gradients itself, and its scaler.step()
        then hands step() no scale (grad_scale None: already unscaled)."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return not caller.startswith(("lightning.", "pytorch_lightning.", "lightning_fabric."))

    # close() waits this long for the step in flight before detaching anyway.
    _CLOSE_WAIT_MS = 120_000
    # torch 2.x's GradScaler sets `grad_scale` (a tensor, or None after
    # unscale_) and `found_inf` around step() and deletes them after; it
    # multiplies by a grad_scale it finds, so there is no class default.

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, socket: Optional[str] = None, subgroup_size: int = 0,
                 client_name: Optional[str] = None, maximize: bool = False,
                 rank: Optional[int] = None, local_rank: Optional[int] = None,
                 world_size: Optional[int] = None, overlap=None,
                 model: Optional[torch.nn.Module] = None, async_step: Optional[bool] = None,
                 resume: Optional[Dict[str, Any]] = None, compact_state: bool = False,
                 gpu_budget_bytes=None, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, delay: int = 0, delay_warmup: int = 1000):
        check_args(lr, betas, eps, weight_decay, amsgrad, maximize, differentiable)
        self._owner_id = id(self)  # __del__ closes only for this object, not for wrappers
        self._parts = None
        self._registering = True
        super().__init__(params, group_defaults(self._decoupled, lr, betas, eps,
                                                weight_decay, foreach, fused, capturable))
        self._torch_state = DaemonState(weak_hook(self, lambda opt, p: opt._state_of_param(p)))
        self._registering = False
        overlap = check_overlap(overlap)
        # delay=1: dosd's CPU path one step late (dos/_delay.py, docs/python.md).
        delay, delay_warmup = check_delay(delay, delay_warmup, overlap, model)
        # The model only weakly: it holds this optimizer's hooks (no cycle).
        # compact_state: dosd keeps exp_avg / exp_avg_sq as bf16 (8 bytes of
        # state a parameter instead of 12); state_dict() still returns fp32.
        options = Options(attach=(socket, client_name, rank, local_rank, world_size),
                          subgroup_size=subgroup_size, decoupled=self._decoupled,
                          compact=bool(compact_state), overlap=overlap,
                          model=None if model is None else weakref.ref(model),
                          async_step=async_step, delay=delay, delay_warmup=delay_warmup)
        self._parts = Assembly(options, groups=weak_hook(self, lambda opt: opt.param_groups),
                               finish=weak_hook(self, lambda opt: opt._finish_inflight()))
        try:
            self._parts.register(resume, on_attach=weak_hook(self, track))
        except BaseException:
            self.close()
            raise
        self._parts.lend(gpu_budget_bytes)
        self._parts.configure()
        self.overlap = self._parts.overlap  # the default (None) decided

    # ---- the daemon's report and the session ----

    # found_inf: the daemon's verdict on the last step (a bool). torch 2.x's
    # GradScaler sets and deletes an attribute of the same name around
    # step() (its inf-check tensor); the property keeps the two apart.
    @property
    def found_inf(self) -> bool:
        self._collect_inflight()  # an asynchronous step's verdict is known once it is done
        return self._parts.flight.found_inf

    @found_inf.setter
    def found_inf(self, value) -> None:
        if isinstance(value, torch.Tensor):
            self._parts.amp_found_inf = value
        else:
            self._parts.flight.found_inf = bool(value)

    @found_inf.deleter
    def found_inf(self) -> None:
        self._parts.amp_found_inf = None

    @property
    def last_step(self) -> Optional[Dict[str, Any]]:
        """The daemon's report on the last step (waits for a step in flight;
        with delay=1 it leaves the delayed update pending)."""
        self._collect_inflight()
        return self._parts.flight.last_step

    @last_step.setter
    def last_step(self, value) -> None:
        self._parts.flight.last_step = value

    @property
    def gpu_lease(self) -> Optional[Dict[str, Any]]:
        """GPU mode: the lease last sent to dosd (lease_bytes, budget_bytes,
        peak_bytes, headroom_bytes, budget_source); None before the first
        step, on the CPU path, or with lending off (gpu_budget_bytes=0)."""
        lease = self._parts.lease
        return None if lease is None else lease.last

    @property
    def overlap_armed(self):
        """overlap=: whether the next backward may begin an early step (set it
        False around gradient-accumulation micro-steps with "update")."""
        return self._parts.armed

    @overlap_armed.setter
    def overlap_armed(self, value) -> None:
        self._parts.set_armed(value)

    @property
    def ready_log(self) -> List[Any]:
        """overlap=: (tensor index, seconds since the first ready) of the last
        early step's gradients, in the order they became final."""
        return self._parts.ready_log

    @property
    def rank(self) -> int:
        """The rank this session was tagged with (-1: unknown); local_rank
        and world_size likewise (arguments, else torch.distributed, else
        $RANK/$LOCAL_RANK/$WORLD_SIZE)."""
        return self._parts.reg.rank

    @property
    def local_rank(self) -> int:
        return self._parts.reg.local_rank

    @property
    def world_size(self) -> int:
        return self._parts.reg.world_size

    @property
    def session_id(self) -> int:
        """This optimizer's dosd session (with session_token: what a restarted
        trainer passes as `resume=` to continue from the daemon's state)."""
        self._check_open("session_id")
        return int(_native.lib.dos_session_id(self._session))

    @property
    def session_token(self) -> str:
        self._check_open("session_token")
        return _native.lib.dos_session_token(self._session).decode()

    def session_info(self) -> Dict[str, Any]:
        """{'session_id', 'token'}: save it (privately: the token is the
        session's credential) so that a restarted process can build its
        optimizer with `resume=info` after a crash; dosd keeps a dead
        trainer's state for its --session_lease."""
        return {"session_id": self.session_id, "token": self.session_token}

    @property
    def resumed(self) -> bool:
        """True when this optimizer continued a dead trainer's session."""
        return self._session is not None and bool(_native.lib.dos_session_resumed(self._session))

    @property
    def _session(self):
        """The dos_session* (ctypes.c_void_p), or None once closed."""
        parts = getattr(self, "_parts", None)
        return None if parts is None or parts.reg is None else parts.reg.ptr

    @property
    def _entries(self):
        """The registered tensors (dos/_register.py's Entry)."""
        parts = getattr(self, "_parts", None)
        return [] if parts is None or parts.reg is None else parts.reg.entries

    @property
    def _inflight(self) -> bool:
        """A step was begun and its result is not collected yet."""
        parts = getattr(self, "_parts", None)
        return parts is not None and parts.flight.in_flight

    def _check_open(self, what):
        if self._session is None:
            raise closed_error(what, getattr(getattr(self, "_parts", None), "reg", None))

    def set_policy(self, policy: str) -> None:
        """Scheduling policy of this session: "cpu", "static:<f>",
        "interleave:<k>" or "auto"."""
        self._check_open("set_policy")
        call("dos_set_policy", self._session, policy.encode())

    # ---- state ----

    @property
    def state(self):
        """torch.optim's per-parameter state (empty here: the state lives in
        dosd; state_dict() pulls it). Reading it finishes the step in flight,
        as frameworks read it to move or save the optimizer (Lightning's
        teardown, for one, then moves the model to the CPU)."""
        if self._inflight:
            self._finish_inflight()
        return self._torch_state

    @state.setter
    def state(self, value) -> None:
        self._torch_state = value

    def _state_of_param(self, p) -> Optional[Dict[str, Any]]:
        """A registered parameter's state read from dosd; None for another key."""
        if self._session is None:
            return None
        e = next((e for e in self._entries if e.param is p), None)
        return None if e is None else self._parts.state_io.state_of(e)

    def state_dict(self, *, all_params: Optional[bool] = None) -> Dict[str, Any]:
        """torch.optim.AdamW's format: state[i] = {'step', 'exp_avg',
        'exp_avg_sq'} (CPU tensors over dosd's memory, shaped like the
        parameter, or like a DTensor's local shard wrapped as a DTensor),
        plus 'master_param' (fp32) for 16-bit parameters. Only parameters a
        step has updated have state, as in torch, unless `all_params`: then
        every parameter's (fresh ones: master = weight, zero moments, step 0),
        a layout to load into in place (DCP). torch.distributed.checkpoint's
        get/set_optimizer_state_dict get that by default (torch's own
        optimizers get it from DCP's zero-gradient init step, which step()
        ignores: it would decay the moments and count a step). Waits for a step in flight first, so
        it always shows finished steps."""
        self._check_open("state_dict")
        caller = sys._getframe(1)  # DCP, accelerate's placement: dos/_callers.py
        all_params = _callers.from_dcp(caller) if all_params is None else all_params
        state = {} if _callers.from_placement(caller) else self._parts.state_io.states(all_params)
        saved, self.state = self.state, state
        try:
            return super().state_dict()
        finally:
            self.state = saved

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Accepts this class's or torch.optim.Adam/AdamW's state dicts (CPU,
        GPU or DTensor state) and pushes the state to the daemon. The master
        weight is 'master_param' where present, else the parameter itself."""
        self._check_open("load_state_dict")
        if not (_callers.from_placement(sys._getframe(1)) and not state_dict.get("state")):
            self._parts.state_io.load(state_dict, self.param_groups)

    def synchronize(self) -> None:
        """Waits until the step in flight, if any, is finished: once it
        returns, the new weights are in the parameters for every reader (this
        thread, another thread, and any work queued from now on on any CUDA
        stream), and the step's result is collected (`last_step`; a step the
        daemon failed raises here). A no-op without a step in flight.

        Needed only for reads that pass through none of the optimizer's
        hooks while steps overlap the next forward (`model=` on CUDA, or
        `async_step=True` on the CPU): a tensor read directly (`p.cpu()`,
        `parameters()`, `model.to()`); module state_dict()/load_state_dict(),
        the model's forward, and the optimizer's state wait by themselves.
        With delay=1 it also installs the delayed subgroups' new weights, so
        the model holds the whole last step."""
        self._finish_inflight()

    def _finish_inflight(self) -> None:
        """Collects the step in flight (waits on the host for its result and
        raises its error, if any); an early step that step() has not claimed
        yet is ended as its driver says (dos/_early.py); a delayed update's
        weights are installed (dos/_delay.py)."""
        parts = getattr(self, "_parts", None)
        if parts is not None and parts.driver is not None:
            parts.driver.finish()

    def _collect_inflight(self) -> None:
        """The same for a report (found_inf, last_step): a delayed update's
        weights stay pending."""
        parts = getattr(self, "_parts", None)
        if parts is not None and parts.driver is not None:
            parts.driver.report()

    # ---- setup ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As torch's (a parameter listed twice is refused). After construction
        dosd's session is rebuilt (its tensors are registered once): every
        tensor's state is carried out (memory, or disk: dos/_carry.py), the
        group added, and a new session registered with the state written back."""
        param_group = once_each(param_group)
        if getattr(self, "_registering", True):
            super().add_param_group(param_group)
            return
        self._check_open("add_param_group")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        self._parts.add_group("add_param_group() after steps", self.close,
                              undo=self.param_groups.pop, check=lambda:
                              check_args(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                                          g.get("amsgrad"), g.get("maximize"),
                                          g.get("differentiable")))

    @torch.no_grad()
    def reload_weights(self, params=None) -> None:
        """Takes the parameters' current values (all, or those in `params`) as
        dosd's master weights, keeping their moments and step counts: after
        weights were written in place between steps (weight clipping such as
        p.clamp_(), a max-norm constraint, a re-initialised layer), which the
        next step would otherwise overwrite with dosd's (done at the next
        step for writes that move a version counter). A written element's
        master becomes its value; the others keep their fp32 masters."""
        self._check_open("reload_weights")
        by_param = {id(e.param): e for e in self._entries}
        wanted = None if params is None else [id(p) for p in params]
        if wanted is not None and not all(i in by_param for i in wanted):
            raise ValueError("reload_weights: a parameter this optimizer does not hold")
        entries = self._entries if wanted is None else [by_param[i] for i in wanted]
        getattr(self._parts.driver, "report", lambda: None)()  # collected, weights not installed
        self._parts.state_io.take_weights(entries, self._parts.flight.delayed_pending)

    # ---- training ----

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips like torch.nn.utils.clip_grad_norm_ over this optimizer's
        parameters, without touching the gradients: the total norm (returned,
        as torch's) is computed here, and the coefficient
        min(1, max_norm / (norm + 1e-6)) goes to dosd with the next step(),
        which multiplies each gradient by it as it reads it: bitwise
        step(clip_coef=c), also with overlap=True. zero_grad() drops it (call
        it after the last backward). Reads the norm on the host (one device
        synchronisation); FSDP2's sharded gradients add the other ranks'
        shards, as torch's (a collective: call it on every rank)."""
        self._check_open("clip_grad_norm_")
        grads = _grads.clip_grads(self.param_groups)
        if not grads:
            return torch.tensor(0.0)
        total, self._parts.clip = _grads.clip_coefficient(
            grads, max_norm, norm_type, error_if_nonfinite,
            _grads.clip_shardings(self.param_groups))
        return total

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Zeroes every gradient in place (registered gradients must stay
        where dosd reads them). set_to_none (default: the running torch's)
        makes each parameter count as having no gradient until backward
        reaches it: step() then skips it as torch skips a None grad.
        With a step in flight: on a stream-ordered GPU session the zeroing is
        queued behind the step's completion on the current stream; with
        per-layer waits (model=) it is deferred to each layer's wait, so that
        the daemon still reads the gradients of layers it has not reached.
        Between backward and step() with overlap (an early step not claimed
        by step() yet), the early step is given up first (overlap=True) or
        completed (overlap="update"), as step() would never see these."""
        self._check_open("zero_grad")
        self._parts.clip = None  # the coefficient goes with the gradients it measured
        entries = self._parts.driver.before_zero_grad(self._entries)
        if set_to_none is None:
            set_to_none = _SET_TO_NONE_DEFAULT
        if set_to_none:  # otherwise a gradient that was None stays None, as in torch
            for e in self._entries:
                e.grad_none = True
        with torch.no_grad():
            for e in entries:
                if not e.copy_grad:  # DTensor: the gradient is FSDP's, handled below
                    _grads.zero_entry(e)
            _grads.zero_unregistered(self.param_groups, self._entries, set_to_none)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, clip_coef: float = 1.0, **kwargs):
        """One Adam(W) step in the daemon. `grad_scale` divides the gradients
        (an AMP loss scale), `clip_coef` then multiplies them. Sets
        `self.found_inf` (non-finite gradients: nothing was applied). Driven
        by a GradScaler (`scaler.step(opt)`), its scale is grad_scale. How the
        step runs is its driver's (the mode decided at construction: _step.py)."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(kwargs)}")
        if _callers.from_dcp_init(sys._getframe(1)):
            return None  # DCP's zero-gradient init step: dosd holds every parameter's state
        self._check_open("step")  # before the closure's forward and backward
        self._parts.driver.arm()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open("step")
        if not self._entries:
            return loss
        driver = self._parts.driver
        driver.settle(lambda: _grads.thawed(self.param_groups, self._entries))
        clip, self._parts.clip = self._parts.clip, None
        if clip is not None:
            clip_coef = float(clip_coef) * clip.coef
        scaled = grad_scaler is not None or getattr(self, "grad_scale", None) is not None
        driver.step(StepRequest(
            grad_scale=float(grad_scale), clip_coef=float(clip_coef),
            checked=clip is not None and clip.checked(self.param_groups),
            scaler_arg=grad_scaler is not None, scaled=scaled,
            amp=lambda: _amp.verdict(self, grad_scaler),
            record_amp=lambda found_inf: _amp.record_amp(self, grad_scaler, found_inf),
            reregister=lambda: self._parts.reregister(self.close)))
        return loss

    # ---- teardown ----

    def close(self) -> None:
        """Finishes the step in flight, moves parameters and gradients back to
        ordinary memory and detaches (the daemon frees this session's state).
        Idempotent; also after dosd stopped. The shared memory itself is
        released once no tensor over it is left (dos/_session.py)."""
        parts = getattr(self, "_parts", None)
        if parts is not None and parts.close(self._CLOSE_WAIT_MS):
            untrack(self)

    def __del__(self):
        # Only the optimizer itself closes, not objects sharing its state (LightningOptimizer).
        if self.__dict__.get("_owner_id") != id(self):
            return
        try:
            self.close()
        except Exception:  # interpreter shutdown or daemon gone: nothing to do
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getstate__(self):
        raise TypeError("dos.torch optimizers cannot be pickled or copied: the state is in dosd "
                        "(a copy would be a closed optimizer without it); save opt.state_dict() "
                        "and load it into a new optimizer")


class AdamW(_DosAdamBase):
    """torch.optim.AdamW (decoupled weight decay) with its state in dosd."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class Adam(_DosAdamBase):
    """torch.optim.Adam (L2 weight decay: g += wd * p) with its state in dosd."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
