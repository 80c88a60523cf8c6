"""A step's mode, decided once, and the life of one step, as an explicit
state machine.

The mode (`StepMode`, from `decide_mode`, the one place it is worked out) says
how a step begins, how the trainer learns it is done and whether it begins
early, during backward. It picks the step driver (dos/_drivers.py,
dos/_early.py); nothing else looks at flags to tell modes apart:

    begin     host: synchronise the device, then ring dosd (CPU, DTensor,
                    CUDA without stream memory operations)
              stream: stream-ordered on the trainer's CUDA stream
    complete  WAIT: step() returns after the update
              STREAM: step() returns at once; the current stream waits for
                      the whole step on the GPU
              LAYERS: step() returns at once; each layer's forward (model=)
                      waits for its own subgroups
    early     NONE: the step begins at step()
              VERDICT (overlap=True): begins at the first final gradient,
                      applied after step()'s verdict
              UPDATE (overlap="update"): begins at the first final gradient,
                      each subgroup applied as soon as it is ready

The step's life:

    IDLE ──step()──────────────> IN_FLIGHT ──collect──> IDLE
    IDLE ──overlap hooks───────> HOOK_BEGUN
    HOOK_BEGUN ──step() claims─> IN_FLIGHT
    HOOK_BEGUN ──collect───────> IDLE   (state read, close, or the next backward)

IN_FLIGHT: a step was begun in the daemon and its result (found_inf, errors)
has not been collected. HOOK_BEGUN: the overlap hooks began it at the end of
backward and step() has not claimed it yet. `overlapped` says whether the
step in flight was begun by the hooks (it survives the claim). `waited` is the
set of entry indices whose new weights the trainer already waited for
(per-layer waits). Any other transition is a bug in the client and raises.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Set

from dos._errors import DosError
from dos._native import Status

__all__ = ["StepState", "StepMachine", "StepMode", "Complete", "Early", "decide_mode"]


class Complete(enum.Enum):
    WAIT = "step() returns after the update"
    STREAM = "the current CUDA stream waits for the whole step"
    LAYERS = "each layer's forward waits for its subgroups (model=)"


class Early(enum.Enum):
    NONE = "the step begins at step()"
    VERDICT = "begins during backward, applied after step()'s verdict (overlap=True)"
    UPDATE = "begins and applies during backward (overlap=\"update\")"


@dataclasses.dataclass(frozen=True)
class StepMode:
    stream: bool  # begun on the trainer's CUDA stream (else after a device sync)
    complete: Complete
    early: Early


def decide_mode(*, gpu: bool, dtensor: bool, stream_supported: bool, model: bool,
                async_step, overlap, delay: int = 0, hooks: bool = True) -> StepMode:
    """The step's mode for a registration: `gpu` (CUDA parameters), `dtensor`
    (FSDP2 shards copied at step()), `stream_supported` (the session can order
    steps on a CUDA stream), `model` (model= given), `async_step` (None: the
    default), `overlap` (False, True, "update" or None: the default) and
    `delay` (the delayed update), `hooks` (torch has post-accumulate-grad
    hooks, which early steps need). Raises for an async_step=True that nothing
    could order."""
    stream = gpu and not dtensor and stream_supported
    possible = (stream or model) and not dtensor
    if async_step is None:
        # By default steps overlap the next forward only on CUDA, where the
        # trainer's stream orders every later reader (whole-step stream
        # wait), or model='s hooks and torch.cuda.synchronize() do. On the
        # CPU path step() returns after the update: a read of the shared
        # memory that passes through no hook (p.cpu(), parameters(),
        # torch.save of a parameter) could not be made to wait.
        async_step = possible and gpu
    elif async_step and not possible:
        why = ("FSDP2/DTensor parameters are copied at step()" if dtensor else
               "without model= nothing would order the next forward after the step on "
               "this session (shared-memory tensors, or no CUDA stream memory operations)")
        raise DosError(Status.INVALID_ARGUMENT, f"async_step=True is not possible here: {why}")
    complete = (Complete.WAIT if not async_step else
                Complete.LAYERS if model else Complete.STREAM)
    # Early steps need the parameters registered in place and, on CUDA, a
    # stream to order the ready marks on.
    if overlap is None:
        # By default only the delayed update begins its steps during
        # backward on CUDA: it then copies the delayed subgroups' gradients
        # as backward finishes them, off the step's critical path; an
        # in-place clip has them copied again (measured in one call on
        # nvidia-h200, 7B HF Trainer, compact, clipping in place: 0.398
        # s/iter against 0.408 with overlap=False).
        overlap = bool(delay) and stream and hooks
    early = Early.NONE
    if overlap and not dtensor and (stream or not gpu):
        early = Early.UPDATE if overlap == "update" else Early.VERDICT
    return StepMode(stream=stream, complete=complete, early=early)


class StepState(enum.Enum):
    IDLE = "idle"
    IN_FLIGHT = "in flight"
    HOOK_BEGUN = "begun by the overlap hooks, not yet claimed by step()"


# (state, event) -> next state; anything else is illegal.
_TRANSITIONS = {
    (StepState.IDLE, "begin"): StepState.IN_FLIGHT,
    (StepState.IDLE, "begin by hooks"): StepState.HOOK_BEGUN,
    (StepState.HOOK_BEGUN, "claim"): StepState.IN_FLIGHT,
    (StepState.IN_FLIGHT, "collect"): StepState.IDLE,
    (StepState.HOOK_BEGUN, "collect"): StepState.IDLE,
}


class StepMachine:
    __slots__ = ("state", "overlapped", "waited")

    def __init__(self):
        self.state = StepState.IDLE
        self.overlapped = False
        self.waited: Set[int] = set()

    def _go(self, event: str) -> None:
        new = _TRANSITIONS.get((self.state, event))
        if new is None:
            raise DosError(Status.INTERNAL,
                           f"dos.torch: illegal step transition: '{event}' in state "
                           f"{self.state.name}; this is a bug in the client, please report it")
        self.state = new

    @property
    def in_flight(self) -> bool:
        """A step was begun and its result is not collected yet."""
        return self.state is not StepState.IDLE

    @property
    def hook_begun(self) -> bool:
        return self.state is StepState.HOOK_BEGUN

    def begun(self, by_hooks: bool) -> None:
        """The daemon accepted a new step."""
        self._go("begin by hooks" if by_hooks else "begin")
        self.overlapped = by_hooks
        self.waited = set()

    def claim(self) -> None:
        """step() takes over the step the overlap hooks began."""
        self._go("claim")

    def collected(self) -> None:
        """The step's result was collected (or waiting for it failed)."""
        self._go("collect")
        self.overlapped = False
