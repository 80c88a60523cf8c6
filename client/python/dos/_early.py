"""Early steps (`overlap=True` / `overlap="update"`): a step begun during
backward, at the first final gradient, by post-accumulate-grad hooks that
mark each subgroup ready once all its tensors' gradients are final (on CUDA
the mark is enqueued on the current stream after the gradient kernels; on
the CPU a store).

An early driver wraps the driver of the mode's completion (dos/_drivers.py)
and has its interface: step() claims the early step the hooks began (or lets
the inner driver begin an ordinary one); finish(), zero_grad() and close()
end one step() never claimed. The two modes differ in what that means:

    VerdictDriver (overlap=True)    dosd applies nothing before step()'s
        verdict (loss scale, clip coefficient, learning rates); an unclaimed
        step is given up, and so is one a second backward (gradient
        accumulation) reaches: step() then begins an ordinary one.
    UpdateDriver (overlap="update") dosd applies each subgroup as soon as it
        is ready; an unclaimed step is completed with its begin-time
        hyperparameters, and a scale, clip or second backward is an error.

A driver owns its hooks, the step's ready bookkeeping (`ready`,
`ready_left`, `ready_log`) and `armed` (the optimizer's overlap_armed).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, List, Optional

import torch

from dos import _grads, _inplace, _native
from dos._errors import DosError
from dos._hooks import weak_hook
from dos._native import Status
from dos._step import Early

__all__ = ["EarlyDriver", "VerdictDriver", "UpdateDriver", "early_driver", "check_overlap"]

_TOO_LATE = ("with overlap=\"update\" dosd updates each subgroup during backward, so a grad "
             "scale or clip coefficient given at step() comes too late (the step was applied "
             "without it); use overlap=True (a verdict at step(): clipping and GradScaler "
             "work) or overlap=False")


def check_overlap(overlap):
    """overlap= checked: None (the default: dos/_step.py decides), False,
    True or "update" (False on a torch without post-accumulate-grad hooks,
    with a warning)."""
    if overlap is None:
        return None
    if overlap not in (False, True, "update"):
        raise ValueError(f"overlap={overlap!r}: use False, True or \"update\" (or leave it "
                         "out: on with delay=1 on CUDA)")
    if overlap and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        warnings.warn(f"dos.torch: overlap=True needs torch >= 2.1 "
                      f"(register_post_accumulate_grad_hook); torch {torch.__version__} "
                      "has none, so steps start at step() as usual")
        return False
    return overlap


class EarlyDriver:
    """What both early modes share: the hooks and the ready marks."""

    no_verdict = False  # dos_step_begin_early's flag (and gradients_checked)

    def __init__(self, inner, reg, flight):
        self.inner = inner
        self.mode = inner.mode
        self._reg = reg
        self._flight = flight
        self.armed = True
        self.ready = set()
        self.ready_left: List[int] = []
        self.ready_log: List[Any] = []  # (tensor index, seconds since the first ready) last step
        self._ready_t0 = None
        self._error: Optional[str] = None
        # overlap=True saw a second backward before step() (gradient
        # accumulation): early begins wait for the next step().
        self._accumulating = False
        self._refused = False
        self._handles = []
        if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            for e in reg.entries:
                def hook(drv, _param, i=e.index):
                    drv.on_ready(drv._reg.entries[i])
                self._handles.append(
                    e.param.register_post_accumulate_grad_hook(weak_hook(self, hook)))

    # -- the driver interface --

    def arm(self) -> None:
        self._accumulating = False
        self._refused = False  # _possible() answered False during this backward

    def settle(self, thawed) -> None:
        self.inner.settle(thawed)

    def begin_step(self, req, amp_scale: float) -> None:
        """An ordinary step on the driver in charge after a re-registration."""
        self.inner.begin_step(req, amp_scale)

    def finish(self) -> None:
        if self._flight.hook_begun:
            self._flight.claim()
            if not self._end_claimed():
                return
        self.inner.finish()

    def report(self) -> None:
        self.finish()

    def before_zero_grad(self, entries):
        if self._flight.hook_begun:
            self.finish()
        entries = self.inner.before_zero_grad(entries)
        self.ready.clear()
        return entries

    def close(self, timeout_ms: int, prepare=None) -> None:
        self.inner.close(timeout_ms, self._end_unclaimed)
        for h in self._handles:
            h.remove()
        self._handles = []

    def step(self, req) -> None:
        if not self._flight.hook_begun:
            self.inner.step(req)
            self.ready.clear()
            return
        # An early step, begun at the first gradient.
        self._flight.claim()
        self.inner.update_lease()  # goes with the next step (peak after backward)
        if not self._verdict(req):
            return
        self.ready.clear()
        self.inner.complete(req)

    # -- what the modes decide --

    def _end_claimed(self) -> bool:
        """Ends a claimed step nobody will give a verdict; True if it is
        still to be collected."""
        raise NotImplementedError

    def _end_unclaimed(self) -> None:
        """close(): ends a step step() never claimed, without waiting."""
        raise NotImplementedError

    def _verdict(self, req) -> bool:
        """step(): the verdict on the claimed step; False if it was given up."""
        raise NotImplementedError

    def _second_backward(self, e) -> None:
        raise NotImplementedError

    def _give_up(self) -> None:
        self.inner.give_up()
        self.ready = set()

    # -- the hooks --

    def _possible(self) -> bool:
        """No parameter moved or written in place (step() re-registers
        them, or has dosd take the written values, before its step)."""
        return not any(self._reg.moved(e) or e.written() for e in self._reg.entries)

    def _begin(self, now) -> None:
        self.ready = set()
        self._ready_t0 = now
        self.ready_log = []
        self._error = None
        left = [0] * self._reg.num_subgroups
        for first, last in self._reg.ranges:
            for sg in range(first, last + 1):
                left[sg] += 1
        self.ready_left = left
        with torch.no_grad():
            args = self.inner.args(1.0, 1.0, gradients_checked=self.no_verdict)
            self._flight.begin_early(args, self.no_verdict, self.inner.stream())

    def on_ready(self, e) -> None:
        """Post-accumulate-grad hook: e's gradient is final for this backward.
        The first one begins an early step (dosd plans it, and with
        overlap="update" updates each subgroup as soon as it is marked ready);
        each subgroup is marked ready when all its tensors' gradients are
        final. Without early steps possible here, the step begins at step()."""
        if not self.armed or self._reg.ptr is None or self._accumulating:
            return
        if self._flight.in_flight and not self._flight.hook_begun:
            self.inner.finish()  # the previous asynchronous step (already done)
        now = time.perf_counter()
        if not self._flight.hook_begun:
            if self._refused or not self._possible():
                self._refused = True  # asked once a backward (each hook would scan them all)
                return
            self._begin(now)
        if e.index in self.ready:
            self._second_backward(e)
            return
        if _grads.sparse_seen(e):
            # Not marked: dosd applies nothing of it before the verdict,
            # which refuses the step (overlap="update" skips it).
            self._error = self._error or f"{e.name} {_grads.SPARSE}"
            return
        self.ready.add(e.index)
        self.ready_log.append((e.index, now - self._ready_t0))
        if self._take_gradient(e):
            # What dosd may copy from now on (a delayed step copies it during
            # backward): a later write shows in the version (the verdict).
            e.ready_version = e.grad_shm._version
            self._mark(e)

    def _take_gradient(self, e) -> bool:
        """autograd made a new gradient (grads were set to None): it goes
        into the registered buffer before the subgroup is announced
        (dos/_grads.py's hooks took it already where torch has them)."""
        if _grads.take(e):
            return True
        self._error = _grads.unusable(e, e.param.grad)
        return False

    def _mark(self, e) -> None:
        """Marks the subgroups whose last tensor e is ready, in runs."""
        first, last = self._reg.ranges[e.index]
        run = None
        for sg in range(first, last + 1):
            self.ready_left[sg] -= 1
            if self.ready_left[sg] == 0:
                if run is not None and run[1] == sg - 1:
                    run = (run[0], sg)
                else:
                    self._mark_run(run)
                    run = (sg, sg)
        self._mark_run(run)

    def _mark_run(self, run) -> None:
        if run is not None:
            self._flight.mark_ready(run[0], run[1], self.inner.stream())


class VerdictDriver(EarlyDriver):
    """overlap=True: nothing is applied before step()'s verdict."""

    _scaled: Optional[_inplace.Scaled] = None  # torch's in-place clip, for the verdict

    # -- torch's in-place clip (dos/_inplace.py) --

    def scalable(self, params):
        """The ready entries when a clip of `params` now may be reported to
        dosd as a scale (an early step in flight, unclaimed), else None."""
        if not self._flight.hook_begun or self._error or not self.ready:
            return None
        entries = [e for e in self._reg.entries if e.index in self.ready]
        return entries if _inplace.scalable(entries, params) else None

    def stop_captures(self) -> bool:
        """Stops dosd's captures before an in-place clip (False: this step
        is not delayed, e.g. in the delay's warm-up; nothing was done)."""
        try:
            self._flight.stop_captures(self.inner.stream() and _current_stream())
        except DosError as e:
            if e.code != Status.FAILED_PRECONDITION:
                raise
            return False
        return True

    def note_scaled(self, scaled) -> None:
        self._scaled = scaled

    def stream(self):
        """The stream the steps are ordered on (None: the host orders them)."""
        return self.inner.stream()

    def on_stream(self) -> bool:
        """A clip's coefficient may reach dosd through the stream (protocol
        11) instead of being read on the host: DOS_TORCH_CLIP_SCALED=stream,
        the default on CUDA (dos/_inplace.py)."""
        stream = self.stream()
        return stream is not None and _inplace.clip_mode(stream) == "stream"

    def settle(self, thawed) -> None:
        super().settle(thawed)
        if self._flight.hook_begun and (thawed() or any(e.written() for e in self._reg.entries)):
            # Gives the early step up: an ordinary one registers them, or
            # has dosd take the weights written since it began.
            self.finish()

    def _end_claimed(self) -> bool:
        self._give_up()
        return False

    def _end_unclaimed(self) -> None:
        if self._flight.hook_begun:
            self._flight.claim()
            self._flight.abandon()

    def _verdict(self, req) -> bool:
        amp_scale, skip = req.amp()
        if skip:  # the scaler found inf/nan: nothing is applied
            self._give_up()
            self._flight.skipped()  # found_inf, and last_step says so (as SyncDriver's)
            return False
        if self._error:
            self._give_up()
            raise DosError(Status.FAILED_PRECONDITION, f"step: {self._error}")
        try:
            req.reregister()
            skip = _grads.bind(self._reg.entries)
            args = self.inner.args(req.grad_scale * amp_scale, req.clip_coef, req.checked,
                                   skip=skip)
        except BaseException:
            self._give_up()
            raise
        rewritten, scaled = self._writes(args)
        if scaled is not None and scaled.proves_finite and self._all_ready(skip):
            args.gradients_checked = 1  # the clip's finite norm covered every gradient
        try:
            self._flight.verdict(args, self.inner.stream(), rewritten=rewritten,
                                 scaled=None if scaled is None else scaled.coef)
        except DosError:
            with contextlib.suppress(DosError):  # the first error is the one to see
                self._give_up()
            raise
        return True

    def _all_ready(self, skip) -> bool:
        """Every tensor with a gradient this step was marked ready."""
        missing = {e.index for e in self._reg.entries} - set(self.ready)
        return missing <= set(skip)

    def _writes(self, args):
        """(rewritten, _inplace.Scaled or None): whether a gradient was
        written since its subgroup was marked ready (an in-place clip or
        unscale, DDP's average, a replaced gradient copied in by bind()), so
        that dosd must not keep what it copied during backward, unless the
        only write was torch's in-place clip of them all (dos/_inplace.py)
        and the step scales nothing else."""
        scaled, self._scaled = self._scaled, None
        ready = [e for e in self._reg.entries if e.index in self.ready]
        if all(e.grad_shm._version == e.ready_version for e in ready):
            return False, None
        if (scaled is not None and args.grad_scale == 1.0 and args.clip_coef == 1.0 and
                all(e.grad_shm._version == scaled.versions.get(e.index) for e in ready)):
            return False, scaled
        return True, None

    def _begin(self, now) -> None:
        self._scaled = None
        super()._begin(now)

    def _second_backward(self, e) -> None:
        # Gradient accumulation with a verdict: dosd reads the gradients only
        # after step(), but the early step is given up (nothing was applied)
        # and step() begins an ordinary one, so that dosd does not wait
        # through every micro-batch (holding the session, within
        # --early_step_ready_timeout).
        self._accumulating = True
        self.finish()


class UpdateDriver(EarlyDriver):
    """overlap="update": dosd applies each subgroup as soon as it is ready."""

    no_verdict = True

    def _end_claimed(self) -> bool:
        self._flight.verdict(None, self.inner.stream())  # its begin-time hyperparameters
        return True

    def _end_unclaimed(self) -> None:
        if self._flight.hook_begun:
            self._flight.claim()
            self._end_claimed()

    def _verdict(self, req) -> bool:
        # Parameters backward did not reach: dosd has not updated their
        # subgroups yet and leaves them as torch would.
        skip = [e.index for e in self._reg.entries
                if e.index < _native.MAX_SKIP_TENSORS and
                (_grads.no_gradient(e) or _grads.sparse_seen(e))]
        self._flight.verdict(self.inner.args(1.0, 1.0, skip=skip), self.inner.stream())
        late = req.grad_scale != 1.0 or req.clip_coef != 1.0 or req.scaled
        if late or self._error:
            self.inner.collect()
            raise DosError(Status.FAILED_PRECONDITION, f"step: {self._error or _TOO_LATE}")
        return True

    def _second_backward(self, e) -> None:
        # Without a verdict dosd may have updated with the first backward's
        # gradients already.
        self._error = (f"{e.name}'s gradient was accumulated twice before "
                       "step() with overlap=\"update\", so dosd may have applied "
                       "the first backward's gradients; set opt.overlap_armed = "
                       "False during gradient-accumulation micro-steps")


def _current_stream():
    return torch.cuda.current_stream().cuda_stream


def early_driver(inner, early: Early, reg, flight) -> EarlyDriver:
    """The early driver of `early` (not Early.NONE) around `inner`."""
    cls = UpdateDriver if early is Early.UPDATE else VerdictDriver
    return cls(inner, reg, flight)
