"""dos._step.StepMachine: the legal transitions of one optimizer step."""

import pytest

from dos import DosError
from dos._step import StepMachine, StepState


def test_step_then_collect():
    m = StepMachine()
    assert m.state is StepState.IDLE and not m.in_flight
    m.begun(by_hooks=False)
    assert m.state is StepState.IN_FLIGHT and m.in_flight and not m.overlapped
    m.collected()
    assert m.state is StepState.IDLE


def test_hooks_then_claim_then_collect():
    m = StepMachine()
    m.waited.add(3)
    m.begun(by_hooks=True)
    assert m.hook_begun and m.overlapped and m.waited == set()
    m.claim()
    assert m.state is StepState.IN_FLIGHT and m.overlapped
    m.collected()
    assert not m.in_flight and not m.overlapped


def test_hook_begun_step_collected_without_claim():
    m = StepMachine()
    m.begun(by_hooks=True)
    m.collected()
    assert m.state is StepState.IDLE


@pytest.mark.parametrize("setup,action", [
    ([], "collected"), ([], "claim"),
    (["begin"], "begin"), (["begin"], "claim"), (["hooks"], "hooks"),
])
def test_illegal_transitions_raise(setup, action):
    m = StepMachine()
    do = {"begin": lambda: m.begun(False), "hooks": lambda: m.begun(True),
          "claim": m.claim, "collected": m.collected}
    for s in setup:
        do[s]()
    before = m.state
    with pytest.raises(DosError) as e:
        do[action]()
    assert e.value.code_name == "INTERNAL" and "illegal step transition" in e.value.message
    assert m.state is before
