"""The composition root of dos.torch's optimizer: builds its parts, wires
them, and builds them again when the parameters are re-registered.

The parts (each with its own module and narrow interface):

    Registration  dos/_register.py  the session and the registered tensors
    StateIO       dos/_state.py     state_dict()/load_state_dict() through the session
    GpuLease      dos/_lease.py     the GPU memory lent to dosd (GPU mode)
    Flight        dos/_flight.py    the step in flight and dosd's report on it
    a driver      dos/_drivers.py   how a step begins and completes, for the mode
                  dos/_early.py     decided once (dos/_step.py: decide_mode)

An `Assembly` holds one set of them for the optimizer, which reaches them
only through it. A re-registration (moved storage, thawed parameters,
add_param_group) closes the registration and its driver and builds new
ones; the flight and the lease go on. The parts call back into the optimizer
only through the two weak callables given here (`groups`: its param_groups;
`finish`: its _finish_inflight), so none holds it alive.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, Optional

import torch

from dos import _adapters, _carry, _grads, _views
from dos._delay import DelayedDriver
from dos._drivers import make_driver
from dos._early import EarlyDriver, early_driver
from dos._errors import DosError
from dos._flight import Flight
from dos._hooks import weak_hook
from dos._lease import GpuLease
from dos._native import Status
from dos._register import Registration, local_of
from dos._state import StateIO
from dos._step import Complete, Early, StepMode, decide_mode

__all__ = ["Options", "Assembly"]

_NO_STEPS = StepMode(stream=False, complete=Complete.WAIT, early=Early.NONE)


def _no_op() -> None:
    pass


@dataclasses.dataclass
class Options:
    """The constructor's arguments the parts are built from."""
    attach: tuple  # (socket, client_name, rank, local_rank, world_size)
    subgroup_size: int
    decoupled: bool
    compact: bool
    overlap: Any  # False, True or "update" (checked)
    model: Optional[Callable[[], Any]]  # a weak reference to model=
    async_step: Optional[bool]
    delay: int = 0          # 1: the CPU path's subgroups one step late (dos/_delay.py)
    delay_warmup: int = 0   # exact steps before the delay starts


class Assembly:
    def __init__(self, options: Options, groups: Callable[[], list],
                 finish: Callable[[], None]):
        self._options = options
        self._groups = groups
        self._finish = finish
        self.flight = Flight()
        self.lease: Optional[GpuLease] = None
        self.reg: Optional[Registration] = None
        self.state_io: Optional[StateIO] = None
        self.driver = None
        self.mode = _NO_STEPS
        self.armed = True
        self._seen_hooks = []
        self._on_attach = None
        # Here, not on the optimizer, so that wrappers sharing its __dict__'s
        # values (LightningOptimizer) share them too:
        self.clip = None  # from clip_grad_norm_(), for the next step() (_grads.Clip)
        self.amp_found_inf = None  # torch's GradScaler's inf-check tensor (found_inf)
        _adapters.install()  # torch.load, Lightning's saves, DCP's load (dos/_adapters.py)

    def register(self, resume=None, on_attach=None) -> None:
        """Attaches (or resumes) a session and registers the parameters.
        `on_attach()` runs once the session exists (the optimizer is then
        tracked for closing at exit)."""
        if on_attach is not None:
            self._on_attach = on_attach
        self.reg = Registration(*self._options.attach, resume=resume)
        if self._on_attach is not None:
            self._on_attach()
        self.reg.register(self._groups(), self._options.subgroup_size,
                          self._options.decoupled, self._options.compact)
        self._seen_hooks = _grads.install_seen_hooks(self.reg.entries) + \
            _grads.install_take_hooks(self.reg.entries, weak_hook(self, Assembly._collect_before))
        self.state_io = StateIO(self.reg, self._finish, self._options.compact,
                                loaded=lambda: getattr(self.driver, "rebase", _no_op)())
        self.flight.bind(self.reg.ptr)

    def _collect_before(self) -> None:
        """Before a gradient goes into its registered buffer during backward:
        the step still in flight from before (not one this backward's overlap
        hooks began) is collected, as it may read the buffer; a delayed
        update stays pending."""
        if self.flight.in_flight and not self.flight.hook_begun and self.driver is not None:
            self.driver.report()

    def lend(self, gpu_budget_bytes) -> None:
        """GPU mode: the memory this trainer lends dosd's resident tier
        (dos/_lease.py); made once, for the first registration's device."""
        if self.reg.device is not None:
            self.lease = GpuLease(self.reg.device, gpu_budget_bytes)

    def configure(self, overlap=None) -> None:
        """Decides the step's mode (dos/_step.py: the one place) and builds
        its driver; `overlap` (checked) replaces the constructor's."""
        if overlap is not None:
            self._options.overlap = overlap
        reg = self.reg
        model = None if self._options.model is None else self._options.model()
        mode = _NO_STEPS
        if reg.entries:
            mode = decide_mode(gpu=reg.device is not None, dtensor=reg.dtensor,
                               stream_supported=reg.stream_supported(),
                               model=model is not None, async_step=self._options.async_step,
                               overlap=self._options.overlap, delay=self._options.delay,
                               hooks=hasattr(torch.Tensor, "register_post_accumulate_grad_hook"))
        driver = make_driver(mode, reg, self.flight, self.lease, self._groups, model,
                             self._finish)
        if mode.early is not Early.NONE:
            driver = early_driver(driver, mode.early, reg, self.flight)
            driver.armed = self.armed
        if self._options.delay and reg.entries:
            driver = DelayedDriver(driver, reg, self.flight, self._options.delay_warmup, model,
                                   self._finish)
        self.driver = driver
        self.mode = mode

    @property
    def overlap(self):
        """The overlap= in effect: False, True or "update" (the default,
        None, is True for delay=1 on CUDA: dos/_step.py)."""
        early = self.mode.early
        return {Early.VERDICT: True, Early.UPDATE: "update"}.get(early, False)

    def set_armed(self, value) -> None:
        self.armed = value
        if isinstance(self._early(), EarlyDriver):
            self._early().armed = value

    def _early(self):
        d = self.driver
        return d.inner if isinstance(d, DelayedDriver) else d

    @property
    def ready_log(self):
        """The last early step's ready order (overlap=), else []."""
        return self._early().ready_log if isinstance(self._early(), EarlyDriver) else []

    def close(self, timeout_ms: int) -> bool:
        """Finishes the step in flight (within `timeout_ms`), removes the
        hooks, gives the memory back to the model and detaches; False if it
        was closed already."""
        reg = self.reg
        if reg is None or reg.ptr is None:
            return False
        if self.driver is not None:
            self.driver.close(timeout_ms)
        for h in self._seen_hooks:
            h.remove()
        self._seen_hooks = []
        _views.forget(reg.ptr)  # its state dicts' copies keep their last values
        reg.close()
        return True

    def rebuild(self, saved: Dict[int, Dict[str, Any]], close: Callable[[], None],
                last_try: bool = True) -> None:
        """A new session for the current param_groups, with the state `saved`
        (StateIO.saved_state) written back; parameters not in it start
        afresh. `close`: the optimizer's close(). Refused on the `last_try`
        (the optimizer stays closed): the state goes to files (_carry.rescue)
        that the error names, not lost."""
        close()  # copies what lives in the old arena out, detaches
        try:
            self._rebuilt(saved)
        except Exception as err:
            if not last_try:
                raise
            try:
                close()  # a session registered before the failure goes too
            except Exception:
                pass
            folder, why = _carry.rescue(saved, self._groups())
            then = (f"its state was written to {folder}: build it again over the same param "
                    "groups and call opt.load_state_dict(dos.torch.rescued_state_dict("
                    f"{folder!r}))" if folder else
                    f"its state could not be written anywhere ({why}) and is lost")
            raise DosError(getattr(err, "code", Status.INTERNAL), (
                f"dos.torch: dosd's session could not be rebuilt ({err}); the optimizer is "
                f"closed, and {then}")) from err

    def _rebuilt(self, saved) -> None:
        self.register()
        for e in self.reg.entries:
            s = _carry.restored(saved.get(id(e.param)))  # from disk where it was spilled
            self.state_io.write(e, None if s is None or s.get("fresh") else s)
            if s is not None and s["grad_none"] and not e.copy_grad:
                # No gradient this step (before the rebuild): a zeroed,
                # untouched buffer says so to the gradients' binding.
                _grads.zero_entry(e)
                e.grad_none = True
        self.configure()

    def add_group(self, why: str, close, check: Callable[[], None],
                  undo: Callable[[], Any]) -> None:
        """rebuild() for the param group just added, its state read after
        `check()` passed (a typo costs no read of the state). Refused
        (`check()` raises, no room to carry the state, or dosd refuses a
        parameter): `undo()` takes the group out and the optimizer goes on
        as it was, its groups and their state."""
        rebuilding = False
        saved = None
        try:
            check()
            self.reg.sync_device()
            saved = self.state_io.saved_state(why=why, adding=_state_bytes(
                self._groups()[-1]["params"]))
            rebuilding = True
            self.rebuild(saved, close, last_try=False)
        except BaseException:
            undo()
            if rebuilding:
                self.rebuild(saved, close)
            raise
        finally:
            if saved is not None:
                saved.close()

    def reregister(self, close: Callable[[], None]):
        """Parameters whose storage moved, or frozen at construction and
        trainable now, are registered afresh (a new session, the fp32 state
        carried over); returns the step driver in charge afterwards."""
        moved = [e for e in self.reg.entries if self.reg.moved(e)]
        if moved:
            names = ", ".join(e.name for e in moved[:4]) + (" ..." if len(moved) > 4 else "")
            warnings.warn(f"dos.torch: {len(moved)} parameter(s) moved to new storage ({names}); "
                          "re-registering with dosd (once a step has run, the state is carried "
                          "over through this process's memory, or a disk file where memory is "
                          "short: DOS_SPILL_DIR; move the model before its first step, or build "
                          "the optimizer after)",
                          RuntimeWarning, stacklevel=4)
            self.reg.sync_device()
            # With a delayed update pending, compared before its weights are
            # installed into the old storage: a moved copy of what the model
            # held (the step before, for delayed subgroups) is no new value of
            # the user's. (Without one, new values win over the masters.)
            kept = {id(e.param) for e in moved if self.flight.delayed_pending
                    and _same_values(e.param, e.local)}
            with self.state_io.saved_state(moved, kept, "parameters moved to new storage "
                                           "after steps") as saved:
                self.rebuild(saved, close)
        thawed = _grads.thawed(self._groups(), self.reg.entries)
        if thawed:
            # Frozen at construction (not registered), trainable now: torch
            # would start updating them, so they are registered (afresh).
            warnings.warn(f"dos.torch: {len(thawed)} parameter(s) frozen when the optimizer was "
                          "built now have gradients; re-registering with dosd to train them "
                          "(the state carried over as for a move)", RuntimeWarning, stacklevel=4)
            self.reg.sync_device()
            with self.state_io.saved_state(why="parameters unfrozen after steps",
                                           adding=_state_bytes(thawed)) as saved:
                self.rebuild(saved, close)
        self.take_written()
        return self.driver

    def take_written(self) -> None:
        """Parameters written in place since dosd last wrote them (DDP's
        broadcast of rank 0's weights at wrap time, model.load_state_dict()
        or torch.nn.init after the optimizer was built, p.clamp_()): their
        values become dosd's masters before the step (reload_weights()),
        as torch's optimizers would start from them. A delayed update
        pending installs its weights first, over writes to its subgroups."""
        written = [e for e in self.reg.entries if e.written()]
        if not written:
            return
        if self.flight.in_flight:  # overlap="update" (overlap=True gave its early step up)
            warnings.warn("dos.torch: parameters were written in place while a step with "
                          "overlap=\"update\" was updating them during backward; the step "
                          "writes its weights over the write, and its subgroups updated "
                          "before it keep it in the model only: write weights before "
                          "backward, or use overlap=True", RuntimeWarning, stacklevel=5)
            return
        if self.flight.delayed_pending:
            warnings.warn("dos.torch: parameters were written in place while a delayed update "
                          "(delay=1) was pending; its new weights are installed over the "
                          "write for the subgroups it updates: call opt.synchronize() before "
                          "writing weights", RuntimeWarning, stacklevel=5)
            self.driver.finish()
        self.state_io.take_weights(written, False)


def _state_bytes(params) -> int:
    """fp32 state bytes of the trainable ones of `params` (a new session's share)."""
    return sum(12 * local_of(p).numel() for p in params
               if getattr(p, "requires_grad", False))


def _same_values(param, old) -> bool:
    """True if `param` (moved) holds `old`'s values, converted to its dtype
    (model.to(dtype), .data = .data.clone(), a copy to another device)."""
    new = local_of(param).detach()
    return torch.equal(new, old.detach().to(device=new.device, dtype=new.dtype))
