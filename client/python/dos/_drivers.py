"""Step drivers: how a step begins, completes and is collected, one class per
way a step completes (dos/_step.py's `Complete`; the early steps of overlap=
wrap one of these: dos/_early.py).

Every driver has the same small interface, which the optimizer calls and
nothing else:

    arm()                   step() starts (before its closure runs)
    settle(thawed)          step() is about to begin a step: collect what is
                            in flight
    step(req)               one step (a StepRequest)
    finish()                collect the step in flight, if any (state_dict,
                            synchronize, found_inf, a module's state_dict ...)
    before_zero_grad(ents)  zero_grad(): the entries to zero now
    close(timeout_ms)       finish within a bound and remove the hooks

    report()                collect the step in flight for found_inf / last_step

The delayed update (delay=1: the CPU path's subgroups updated one step late,
during the next forward and backward) is one more wrapper of this interface
(dos/_delay.py), as the early drivers are: step() returns once dosd has the
gradients, and finish(), which state_dict(), synchronize(), close() and the
module hooks call, also installs the weights dosd left pending; report()
does not. Drivers hold the registration, the flight and the lease they were built with;
a re-registration builds new ones (`StepRequest.reregister` returns the
driver in charge afterwards). Thread-safety: none.
"""

from __future__ import annotations

import ctypes
import dataclasses
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from dos import _grads, _views
from dos._errors import DosError
from dos._flight import Flight, step_args
from dos._hooks import LayerHooks
from dos._native import Status
from dos._register import Entry, Registration
from dos._step import Complete, StepMode, StepState

__all__ = ["StepRequest", "SyncDriver", "StreamDriver", "LayerDriver", "make_driver"]


@dataclasses.dataclass
class StepRequest:
    """What one step() asks for. `amp()` gives (loss scale, skip) from a
    GradScaler driving it; `record_amp(found_inf)` fills the scaler's
    found_inf (torch 1.x protocol); `reregister()` re-registers moved or
    thawed parameters and returns the driver in charge afterwards."""
    grad_scale: float
    clip_coef: float
    checked: bool     # clip_grad_norm_'s finite norm covers these gradients (_grads.Clip)
    scaler_arg: bool  # a torch 1.x GradScaler passed itself: step() waits
    scaled: bool      # any GradScaler drives this step
    amp: Callable[[], Tuple[float, bool]]
    record_amp: Callable[[bool], None]
    reregister: Callable[[], "SyncDriver"]


class SyncDriver:
    """Complete.WAIT: the step begins at step() and step() returns after the
    update (the CPU path by default, async_step=False, DTensor parameters,
    CUDA without stream memory operations)."""

    def __init__(self, mode: StepMode, reg: Registration, flight: Flight, lease,
                 groups: Callable[[], list]):
        self.mode = mode
        self.reg = reg
        self.flight = flight
        self.lease = lease  # GpuLease (GPU mode) or None
        self._groups = groups  # the optimizer's param_groups, read at each step

    # -- the daemon's side of a step --

    def args(self, grad_scale, clip_coef, gradients_checked=False, skip=()):
        return step_args(self.reg.hparams(self._groups()), grad_scale, clip_coef,
                         gradients_checked, skip)

    def stream(self):
        """The stream steps are ordered on (None: the host orders them)."""
        return self.reg.stream() if self.mode.stream else None

    def update_lease(self) -> None:
        if self.lease is not None:
            self.lease.update(self.reg.ptr)

    def begin(self, args) -> None:
        """Begins a step; the lease goes first (a lowered one is given back
        by dosd before the step call returns)."""
        self.update_lease()
        self.flight.begin(args, self.stream(), host_sync=self.reg.sync_device)

    def collect(self, timeout_ms: int = -1) -> None:
        self.flight.wait(timeout_ms)
        self.reg.copy_out()
        if not self.flight.delayed_pending:  # else after the install (dos/_delay.py)
            _views.refresh(self.reg.ptr)

    def give_up(self) -> None:
        """Gives up the claimed early step (before its verdict): dosd applies
        nothing and answers ABORTED, which is what we asked for."""
        self.flight.abandon()
        try:
            self.collect()
        except DosError as e:
            if getattr(e, "code", None) != Status.ABORTED:
                raise

    # -- the interface --

    def arm(self) -> None:
        pass

    def settle(self, thawed: Callable[[], list]) -> None:
        if self.flight.state is StepState.IN_FLIGHT:
            self.finish()  # the previous asynchronous step

    def finish(self) -> None:
        if self.flight.in_flight:
            self.collect()

    def report(self) -> None:
        """Collects the step in flight for its report (found_inf,
        last_step); a delayed update's driver (dos/_delay.py) leaves its
        install for finish()."""
        self.finish()

    def step(self, req: StepRequest) -> None:
        amp_scale, skip = req.amp()
        if skip:  # the scaler found inf/nan: torch optimizers skip the step
            self.flight.skipped()
            return
        req.reregister().begin_step(req, amp_scale)

    def begin_step(self, req: StepRequest, amp_scale: float) -> None:
        skip = _grads.bind(self.reg.entries)
        self.begin(self.args(req.grad_scale * amp_scale, req.clip_coef, req.checked, skip=skip))
        self.complete(req)

    def complete(self, req: StepRequest) -> None:
        """After the step began (or an early one got its verdict)."""
        self.collect()
        req.record_amp(self.flight.found_inf)

    def must_wait(self, req: StepRequest) -> bool:
        """Synchronous anyway: a torch 1.x GradScaler reads the verdict at
        once, and while a state dict's views of dosd's memory are alive
        (dos/_views.py) whoever holds one never sees a half step."""
        return req.scaler_arg or _views.live()

    def before_zero_grad(self, entries: List[Entry]) -> List[Entry]:
        if not (self.flight.state is StepState.IN_FLIGHT and self.mode.stream):
            self.finish()
        # else: stream-ordered, the zeroing queues behind the step
        return entries

    def close(self, timeout_ms: int, prepare: Optional[Callable[[], None]] = None) -> None:
        """Collects the step in flight within `timeout_ms` (`prepare` first:
        an early step's end). Bounded: close() also runs from the atexit
        handler and from finalizers, where a daemon that is alive but stuck
        must not keep the process from exiting (a daemon that is gone or
        closed the session is noticed at once, within the library's liveness
        slice)."""
        if not self.flight.in_flight:
            return
        try:
            if prepare is not None:
                prepare()
            self.collect(timeout_ms)
        except Exception as e:  # dosd gone, stuck, or the step failed
            if getattr(e, "code", None) == Status.DEADLINE_EXCEEDED:
                warnings.warn(f"dos.torch: close(): the step in flight did not finish within "
                              f"{timeout_ms // 1000} s; detaching without it", RuntimeWarning)


class StreamDriver(SyncDriver):
    """Complete.STREAM (CUDA, stream-ordered, without model=): step() returns
    at once; everything queued on the current stream from then on waits, on
    the GPU, for the whole step. The result is collected at the next step()
    or by a reader (found_inf, last_step, state, synchronize())."""

    def complete(self, req: StepRequest) -> None:
        if self.must_wait(req):
            super().complete(req)
            return
        self.queue_wait_all(self.reg.stream())

    def queue_wait_all(self, stream) -> None:
        if self.reg.num_subgroups:
            self.flight.wait_subgroups(0, self.reg.num_subgroups - 1, stream)


class LayerDriver(StreamDriver):
    """Complete.LAYERS (model=, async): step() returns at once and each
    layer's forward waits for its own subgroups (dos/_hooks.py), so the next
    forward starts while later layers are still being updated. zero_grad()
    is deferred to each layer's wait."""

    def __init__(self, mode, reg, flight, lease, groups, model, finish: Callable[[], None]):
        super().__init__(mode, reg, flight, lease, groups)
        self._sync_stream = None
        # The hooks' stream without a reference back to this driver.
        stream = (lambda: reg.stream()) if mode.stream else (lambda: None)
        self.hooks = LayerHooks(reg, flight, stream, model, finish)

    def collect(self, timeout_ms: int = -1) -> None:
        super().collect(timeout_ms)
        self.hooks.zero_pending(self.reg.entries)  # nothing reads the gradients any more

    def complete(self, req: StepRequest) -> None:
        if self.must_wait(req):
            SyncDriver.complete(self, req)
        elif self.mode.stream:
            self._queue_device_wait()

    def _queue_device_wait(self) -> None:
        """The current stream stays free to start the next forward; a stream
        of the optimizer's own waits for the whole step instead, so that
        torch.cuda.synchronize() (which waits for every stream of the
        device) returns only once the new weights are in."""
        if self._sync_stream is None:
            self._sync_stream = torch.cuda.Stream(device=self.reg.device)
        self.queue_wait_all(ctypes.c_void_p(self._sync_stream.cuda_stream))

    def before_zero_grad(self, entries: List[Entry]) -> List[Entry]:
        if not self.flight.in_flight:
            return super().before_zero_grad(entries)
        self.hooks.defer_zero(e for e in entries if not e.copy_grad)
        return [e for e in entries if e.copy_grad]

    def close(self, timeout_ms: int, prepare=None) -> None:
        super().close(timeout_ms, prepare)
        self.hooks.remove()


def make_driver(mode: StepMode, reg: Registration, flight: Flight, lease, groups,
                model: Optional[torch.nn.Module], finish: Callable[[], None]) -> SyncDriver:
    """The driver for `mode` (early steps: wrapped by dos/_early.py)."""
    if mode.complete is Complete.LAYERS:
        return LayerDriver(mode, reg, flight, lease, groups, model, finish)
    if mode.complete is Complete.STREAM:
        return StreamDriver(mode, reg, flight, lease, groups)
    return SyncDriver(mode, reg, flight, lease, groups)
