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


# dos._step.decide_mode: the one place a step's mode is worked out.
from dos._step import Complete, Early, decide_mode  # noqa: E402

_BASE = dict(gpu=False, dtensor=False, stream_supported=False, model=False, async_step=None,
             overlap=False)


@pytest.mark.parametrize("given,stream,complete,early", [
    ({}, False, Complete.WAIT, Early.NONE),  # CPU: step() returns after the update
    ({"model": True}, False, Complete.WAIT, Early.NONE),  # CPU async only when asked
    ({"model": True, "async_step": True}, False, Complete.LAYERS, Early.NONE),
    ({"gpu": True}, False, Complete.WAIT, Early.NONE),  # no stream memory operations
    ({"gpu": True, "model": True}, False, Complete.LAYERS, Early.NONE),
    ({"gpu": True, "stream_supported": True}, True, Complete.STREAM, Early.NONE),
    ({"gpu": True, "stream_supported": True, "async_step": False}, True, Complete.WAIT,
     Early.NONE),
    ({"gpu": True, "stream_supported": True, "model": True}, True, Complete.LAYERS, Early.NONE),
    ({"gpu": True, "stream_supported": True, "dtensor": True, "overlap": True}, False,
     Complete.WAIT, Early.NONE),  # FSDP2: copied at step(), never early
    ({"overlap": True}, False, Complete.WAIT, Early.VERDICT),
    ({"overlap": "update"}, False, Complete.WAIT, Early.UPDATE),
    ({"gpu": True, "overlap": True}, False, Complete.WAIT, Early.NONE),  # no stream to mark on
    ({"gpu": True, "stream_supported": True, "overlap": "update"}, True, Complete.STREAM,
     Early.UPDATE),
    # overlap left out (None): early steps for the delayed update on CUDA only
    ({"gpu": True, "stream_supported": True, "model": True, "overlap": None, "delay": 1}, True,
     Complete.LAYERS, Early.VERDICT),
    ({"gpu": True, "stream_supported": True, "model": True, "overlap": None}, True,
     Complete.LAYERS, Early.NONE),
    ({"gpu": True, "stream_supported": True, "model": True, "overlap": None, "delay": 1,
      "hooks": False}, True, Complete.LAYERS, Early.NONE),  # torch < 2.1
    ({"gpu": True, "stream_supported": True, "model": True, "overlap": False, "delay": 1},
     True, Complete.LAYERS, Early.NONE),  # asked off
    ({"model": True, "overlap": None, "delay": 1}, False, Complete.WAIT, Early.NONE),  # CPU
    ({"gpu": True, "model": True, "overlap": None, "delay": 1}, False, Complete.LAYERS,
     Early.NONE),  # no stream to mark on
])
def test_decide_mode(given, stream, complete, early):
    mode = decide_mode(**{**_BASE, **given})
    assert (mode.stream, mode.complete, mode.early) == (stream, complete, early)


@pytest.mark.parametrize("given,why", [
    ({"async_step": True}, "without model="),
    ({"gpu": True, "async_step": True}, "without model="),
    ({"gpu": True, "stream_supported": True, "dtensor": True, "model": True,
      "async_step": True}, "FSDP2/DTensor"),
])
def test_decide_mode_refuses_an_async_step_nothing_orders(given, why):
    with pytest.raises(DosError) as e:
        decide_mode(**{**_BASE, **given})
    assert e.value.code_name == "INVALID_ARGUMENT" and why in e.value.message
