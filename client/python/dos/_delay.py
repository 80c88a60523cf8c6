"""The delayed update (delay=1): dosd updates the subgroups it puts on its
CPU one step late, during the trainer's next forward and backward
(dos/wire/control_block.h, "delayed host path"); the resident and streamed
subgroups are applied at once as always.

`DelayedDriver` wraps the step driver of any mode (dos/_drivers.py,
dos/_early.py) with the same interface and adds two things:

  - which steps are delayed: none of the first `warmup` optimizer steps
    (dosd's step count), and none while a state dict's views of dosd's memory
    are alive (dos/_views.py: their holder must never see a half step);
    a step begun during backward (overlap=True) is delayed as the flag stood
    when it began, which the previous step() set;
  - whole steps for readers: `finish()` (state_dict(), synchronize(), a
    module's state_dict hook, an evaluation's forward (eval mode, no grad),
    `opt.state`) and `close()` collect the step in
    flight, then have dosd install the weights it left pending (the daemon's
    state is whole already: dosd serialises its state reads behind the
    update). `report()` (found_inf, last_step) only collects, so reading the
    last step's figures every iteration costs no install.

What the model holds between step() and the next step's end: the weights of
the step before for the delayed subgroups (`opt.last_step["delayed_params"]`
of them), of the last step for the others. Thread-safety: none.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch

from dos import _inplace, _views
from dos._hooks import reader_hooks
from dos._errors import DosError
from dos._native import Status

__all__ = ["DelayedDriver", "check_delay"]


def check_delay(delay, warmup, overlap, model) -> tuple:
    """(delay, warmup) checked: delay 0 or 1, warmup >= 0; not with
    overlap="update" (whose steps update during backward already); model=
    given (its state_dict() must see whole steps)."""
    if isinstance(delay, bool) or delay not in (0, 1):
        raise ValueError(f"delay={delay!r}: use 0 (exact steps) or 1 (the CPU path's "
                         "subgroups updated one step late)")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"delay_warmup={warmup!r}: the number of exact steps before the "
                         "delay starts, an int >= 0")
    if delay and model is None:
        raise ValueError("delay=1 needs model= (the module being trained): its state_dict() and "
                         "load_state_dict(), through which frameworks save and load weights, "
                         "must first install the delayed subgroups' new weights")
    if delay and overlap == "update":
        raise ValueError("delay=1 with overlap=\"update\": those steps update each subgroup "
                         "during backward already; use overlap=True (or False) with the delay")
    return int(delay), int(warmup)


def owner_reader_hooks(model, entries, finish) -> list:
    """dos/_hooks.py's reader hooks on each module of `model` that owns
    registered parameters."""
    registered = {id(e.param) for e in entries}
    handles = []
    for module in model.modules():
        if any(id(p) in registered for p in module.parameters(recurse=False)):
            handles += reader_hooks(module, finish)
    return handles


def eval_forward_hooks(model, entries, finish) -> list:
    """An evaluation's forward (eval mode, no gradients: the HF Trainer's
    evaluate(), Lightning's validation loop) of `model` or of a module owning
    registered parameters (a validation_step calling self.net) finishes the
    step first, so its metrics are of whole steps, as is the checkpoint they
    may select; forwards that compute gradients go on beside the update."""
    def before(module, _inputs):
        if not module.training and not torch.is_grad_enabled():
            finish()
    registered = {id(e.param) for e in entries}
    owners = [m for m in model.modules()
              if m is model or any(id(p) in registered for p in m.parameters(recurse=False))]
    return [m.register_forward_pre_hook(before) for m in owners]


def warn_outside(model, entries) -> None:
    """Warns about registered parameters that are not `model`'s: reading
    them through another module installs no pending update."""
    if model is None:
        return
    owned = {id(p) for p in model.parameters()}
    outside = [e.name for e in entries if id(e.param) not in owned]
    if outside:
        names = ", ".join(outside[:4]) + (" ..." if len(outside) > 4 else "")
        warnings.warn(f"dos.torch: delay=1: {len(outside)} optimized parameter(s) are not in "
                      f"model= ({names}): a read of them that does not go through model= (their "
                      "own module's state_dict()) may see the step before for some; pass the "
                      "module holding every optimized parameter as model=, or call "
                      "opt.synchronize() before such a read", RuntimeWarning, stacklevel=5)


class DelayedDriver:
    def __init__(self, inner, reg, flight, warmup: int, model, finish):
        if reg.dtensor:
            raise DosError(Status.INVALID_ARGUMENT,
                           "dos.torch: delay=1 is not supported for FSDP2 (DTensor) parameters: "
                           "their shards are copied at step(); use delay=0")
        self.inner = inner
        self._reg = reg
        self._flight = flight
        self._warmup = warmup
        # A per-layer driver's hooks finish steps on state_dict() already;
        # for the others the model's modules get the same reader hooks.
        self._handles = [] if hasattr(inner, "hooks") or model is None else \
            owner_reader_hooks(model, reg.entries, finish)
        if model is not None:
            self._handles += eval_forward_hooks(model, reg.entries, finish)
        warn_outside(model, reg.entries)
        if hasattr(inner, "scalable"):
            _inplace.watch(inner)  # torch's in-place clip beside the captures
        self.rebase()

    def __getattr__(self, name):
        # Everything else a driver offers (mode, hooks, armed, ready_log ...).
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "_reg", "_flight", "_warmup", "_handles", "_base", "_counted"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    # -- the interface --

    def arm(self) -> None:
        self.inner.arm()

    def settle(self, thawed) -> None:
        self.inner.settle(thawed)  # collects the step in flight; the next one installs

    def step(self, req) -> None:
        self._plan_next()  # settle() collected the step before: its count is known
        skipped = []  # the GradScaler's verdict, as whichever driver asks for it

        def amp():
            scale, skip = req.amp()
            skipped.append(skip)
            return scale, skip

        self.inner.step(dataclasses.replace(req, amp=amp))
        if _views.live() or any(skipped):
            # A view's holder must see whole steps: wait until dosd ended the
            # delayed update (it runs behind this step's result). A step the
            # GradScaler skipped installs the pending update, as dosd does at
            # a step whose gradients it finds non-finite itself: either skip
            # leaves the same weights.
            self.finish()
        self._plan_next()

    def report(self) -> None:
        """Collects the step in flight for its report (found_inf,
        last_step), leaving a delayed update pending."""
        self.inner.finish()

    def finish(self) -> None:
        self.inner.finish()
        self._install()
        self._plan_next()

    def before_zero_grad(self, entries):
        return self.inner.before_zero_grad(entries)  # the gradients were captured

    def close(self, timeout_ms: int, prepare=None) -> None:
        self.inner.close(timeout_ms, prepare)
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._flight.in_flight:
            return  # the step did not finish in time: nothing to install after it
        try:
            self._install(timeout_ms)
        except DosError as e:  # dosd gone or stuck: detaching goes on (close() is bounded)
            if e.code not in (Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED):
                raise

    # -- the delay --

    def _plan_next(self) -> None:
        """Whether the next step is delayed: after the warm-up (a step the
        overlap hooks begin during backward goes by what the previous
        step() set, so the count includes the step it left in flight).
        Asks dosd nothing: a step begun during backward holds the session
        until step() gives its verdict."""
        last = self._flight.last_step
        base_last, base_step = self._base
        if last is not None and last is not base_last and not last.get("skipped"):  # a skipped step counts nothing
            self._counted = last["step"]  # (its record repeats a count from before a load)
        # A step in flight (an asynchronous one, not collected yet) counts:
        # the next step is the one after it, whose begin the overlap hooks
        # may make during the coming backward.
        steps = self._counted + (1 if self._flight.in_flight else 0)
        self._flight.set_delay(1 if steps >= self._warmup and not _views.live() else 0)

    def rebase(self) -> None:
        """With nothing in flight (construction, after a load_state_dict()):
        counts from dosd's step count until the next step reports, then from
        its report. One state-map fetch (never on a step's path)."""
        self._base = (self._flight.last_step, self._state_step())
        self._counted = self._base[1]
        self._plan_next()

    def _state_step(self) -> int:
        """dosd's step count of the state it holds (a resumed session's, a
        loaded state dict's, also after this optimizer stepped), so that a
        resumed or rolled-back run delays the steps the run it continues
        delayed."""
        session = self._reg.ptr
        if session is None or not self._reg.entries or self._warmup == 0:
            return 0
        _views.fetch(session)
        return max(_views.step_of(session, e.index) for e in self._reg.entries)

    def _install(self, timeout_ms: int = -1) -> None:
        if self._flight.in_flight or not self._flight.delayed_pending:
            return
        stream: Optional[object] = self._reg.stream() if self.inner.mode.stream else None
        # Written by the trainer before the install: the next step compares
        # them with dosd's masters (a write to a subgroup the delay did not
        # hold survives the install; Entry.written).
        written = [e.written() for e in self._reg.entries]
        self._flight.finish_delayed(stream, timeout_ms)
        _views.refresh(self._reg.ptr)  # the state dicts' copies held: the whole step
        # dosd wrote the parameters where autograd does not see it: moved
        # version counters make a backward through a graph built before (a
        # read between forward and backward) fail as torch's in-place
        # update would, instead of mixing two steps' weights in a gradient.
        bump_versions(e.param for e in self._reg.entries)
        for e, w in zip(self._reg.entries, written):
            if not w:
                e.see()  # the install's own write, not the trainer's


def bump_versions(params) -> None:
    """Each parameter's autograd version counter moved on, its data untouched."""
    inc = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
    with torch.no_grad():
        for p in params:
            if inc is not None:
                inc(p)
            else:  # torch < 2.1: an in-place op that writes nothing
                p.as_strided_(p.size(), p.stride(), p.storage_offset())
