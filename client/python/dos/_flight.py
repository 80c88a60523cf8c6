"""The step in flight: dosd's step calls for one session, the step's state
machine (dos/_step.py) and the daemon's report on the last step.

A `Flight` outlives re-registrations (the report and the state go on);
`bind()` points it at the current session. The step drivers (dos/_drivers.py,
dos/_early.py) are its only callers for the step calls; everyone else reads
`state`, `found_inf` and `last_step`. Thread-safety: none (one thread per
optimizer).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, Optional

from dos import _native
from dos._errors import DosError, call
from dos._step import StepMachine, StepState

__all__ = ["Flight", "step_args"]


def step_args(groups, grad_scale: float, clip_coef: float, gradients_checked: bool = False,
              skip=()):
    """A dos_step_args for dosd's groups `groups` (dos_hparams array)."""
    args = _native.StepArgs()
    _native.lib.dos_step_args_init(ctypes.byref(args))
    args.groups = groups
    args.num_groups = len(groups)
    args.grad_scale = float(grad_scale)
    args.clip_coef = float(clip_coef)
    args.gradients_checked = 1 if gradients_checked else 0
    if skip:
        # ctypes keeps the array alive with `args` (its _objects).
        args.skip_tensors = (ctypes.c_uint32 * len(skip))(*skip)
        args.num_skip_tensors = len(skip)
    return args


class Flight:
    def __init__(self):
        self.machine = StepMachine()
        self.found_inf = False
        self.last_step: Optional[Dict[str, Any]] = None  # dosd's report on the last step
        self._session = None
        self._delay = 0  # what the session was last told (dos_set_step_delay)
        # A collected step left delayed weights in dosd that the trainer's
        # memory does not have yet (dos/_delay.py).
        self.delayed_pending = False

    def bind(self, session) -> None:
        """Steps from now on go to `session` (a dos_session*)."""
        self._session = session
        self._delay = 0  # a new session starts exact
        self.delayed_pending = False

    def forget(self) -> None:
        """In a forked child: the parent's step in flight and pending weights
        are the parent's; nothing here may wait for or install them through
        the shared control block."""
        self._session = None
        self.machine = StepMachine()
        self.delayed_pending = False

    # -- the delayed host path (dos/_delay.py) --

    def set_delay(self, delay: int) -> None:
        """Steps begun from now on are delayed (1) or exact (0)."""
        if delay != self._delay:
            call("dos_set_step_delay", self._session, ctypes.c_uint32(delay))
            self._delay = delay

    def finish_delayed(self, stream=None, timeout_ms: int = -1) -> None:
        """Installs the weights the last delayed step left pending (after
        the work queued on `stream`); returns once they are in."""
        if not self.delayed_pending:
            return
        call("dos_step_finish_delayed", self._session, stream, ctypes.c_int64(timeout_ms))
        self.delayed_pending = False

    @property
    def state(self) -> StepState:
        return self.machine.state

    @property
    def in_flight(self) -> bool:
        return self.machine.in_flight

    @property
    def hook_begun(self) -> bool:
        return self.machine.hook_begun

    def begin(self, args, stream=None, *, host_sync: Callable[[], None] = None) -> None:
        """Begins a step at step(): stream-ordered on `stream` (the daemon
        waits for its work on the GPU), else after `host_sync()`."""
        if stream is not None:
            call("dos_step_begin_on_stream", self._session, ctypes.byref(args), stream)
        else:
            if host_sync is not None:
                host_sync()
            call("dos_step_begin", self._session, ctypes.byref(args))
        self.machine.begun(False)

    def begin_early(self, args, no_verdict: bool, stream) -> None:
        """Begins an early step (the overlap hooks, at the first gradient)."""
        flags = _native.DOS_EARLY_NO_VERDICT if no_verdict else 0
        call("dos_step_begin_early", self._session, ctypes.byref(args),
             ctypes.c_uint32(flags), stream)
        self.machine.begun(True)

    def claim(self) -> None:
        self.machine.claim()

    def verdict(self, args, stream, rewritten: bool = False, scaled=None) -> None:
        """The verdict on the claimed early step (None: its begin-time
        hyperparameters, overlap="update"); `rewritten`: a gradient was
        written after its subgroup was marked ready (dosd copies the delayed
        subgroups' gradients again); `scaled`: they were all multiplied by
        this after stop_captures, and nothing else wrote them (a float, or a
        one-element fp32 device tensor `stream` computes it into: NaN there
        has dosd copy them again)."""
        if rewritten:
            call("dos_step_gradients_rewritten", self._session)
        elif hasattr(scaled, "data_ptr"):  # a device tensor: copied on the stream
            try:
                call("dos_step_gradients_scaled_on_stream", self._session,
                     ctypes.c_void_p(scaled.data_ptr()), stream)
            except DosError as e:
                # No GPU mode or no CUDA in the client library: dosd copies
                # them again. Anything else (a CUDA error) is the trainer's.
                if e.code not in (_native.Status.FAILED_PRECONDITION,
                                  _native.Status.UNIMPLEMENTED):
                    raise
                call("dos_step_gradients_rewritten", self._session)
        elif scaled is not None:
            call("dos_step_gradients_scaled", self._session, ctypes.c_float(scaled))
        call("dos_step_verdict", self._session, None if args is None else ctypes.byref(args),
             stream)

    def stop_captures(self, stream) -> None:
        """Before the gradients of the early step in flight are scaled in
        place: dosd stops copying them, and `stream` (None: this thread)
        waits until the copy dosd had begun, if any, is complete.
        FAILED_PRECONDITION when the step is not a delayed one."""
        call("dos_step_stop_captures", self._session, stream, ctypes.c_int64(-1))

    def abandon(self) -> None:
        """Asks dosd to give the claimed early step up (before its verdict)."""
        call("dos_step_abandon", self._session)

    def needs_wait(self, indices) -> bool:
        """Per-layer waits: the step in flight (not one the overlap hooks
        began: that is this backward's own) has weights of these entries the
        trainer has not waited for yet."""
        m = self.machine
        return m.state is StepState.IN_FLIGHT and not all(i in m.waited for i in indices)

    def waited(self, indices) -> None:
        self.machine.waited.update(indices)

    def mark_ready(self, first: int, last: int, stream) -> None:
        call("dos_mark_ready", self._session, ctypes.c_uint32(first), ctypes.c_uint32(last),
             stream)

    def wait_subgroups(self, first: int, last: int, stream) -> None:
        """Waits (on the host, or queued on `stream`) for the new weights of
        subgroups first..last."""
        call("dos_wait_subgroups", self._session, ctypes.c_uint32(first),
             ctypes.c_uint32(last), stream, ctypes.c_int64(-1))

    def skipped(self) -> None:
        """A step the GradScaler skipped before it began: nothing applied."""
        self.found_inf = True
        # Every key a step's report has (zero: nothing ran), and "skipped".
        self.last_step = {"found_inf": True, "step": self.last_step["step"]
                          if self.last_step else 0, "wall_us": 0.0, "update_us": 0.0,
                          "overlapped": False, "early": False, "before_verdict_us": 0.0,
                          "after_verdict_us": 0.0, "prefetched_bytes": 0, "skipped": True,
                          **dict.fromkeys(_DELAY_COUNTS, 0), **dict.fromkeys(_DELAY_TIMES, 0.0)}

    def wait(self, timeout_ms: int = -1) -> None:
        """Collects the step in flight: waits for dosd's result, records its
        report and raises its error, if any."""
        res = _native.StepResult()
        overlapped = self.machine.overlapped
        try:
            call("dos_step_wait", self._session, ctypes.c_int64(timeout_ms), ctypes.byref(res))
        finally:
            self.machine.collected()
        self.found_inf = bool(res.found_inf)
        early = ctypes.c_int32()
        before, after = ctypes.c_double(), ctypes.c_double()
        prefetched = ctypes.c_uint64()
        call("dos_last_step_early", self._session, ctypes.byref(early), ctypes.byref(before),
             ctypes.byref(after), ctypes.byref(prefetched))
        self.last_step = {"found_inf": self.found_inf, "step": int(res.step),
                          "wall_us": float(res.wall_us), "update_us": float(res.update_us),
                          "overlapped": overlapped, "early": bool(early.value),
                          "before_verdict_us": float(before.value),
                          "after_verdict_us": float(after.value),
                          "prefetched_bytes": int(prefetched.value)}
        self.last_step.update(self._delay_report())
        self.delayed_pending = self.last_step["delayed_subgroups"] > 0

    def _delay_report(self) -> Dict[str, Any]:
        subgroups, params = ctypes.c_uint32(), ctypes.c_uint64()
        figures = [ctypes.c_double() for _ in range(5)]
        call("dos_last_step_delay", self._session, ctypes.byref(subgroups), ctypes.byref(params),
             *[ctypes.byref(f) for f in figures])
        report = dict(zip(_DELAY_COUNTS, (int(subgroups.value), int(params.value))))
        report.update({n: float(f.value) for n, f in zip(_DELAY_TIMES, figures)})
        return report


_DELAY_COUNTS = ("delayed_subgroups", "delayed_params")
_DELAY_TIMES = ("delayed_update_us", "delayed_wait_us", "window_us", "predicted_update_us",
                "predicted_iter_us")
