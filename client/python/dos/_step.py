"""The life of one optimizer step, as an explicit state machine.

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

import enum
from typing import Set

from dos._errors import DosError
from dos._native import Status

__all__ = ["StepState", "StepMachine"]


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
