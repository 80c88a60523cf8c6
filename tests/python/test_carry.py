"""The state a rebuild carries from one dosd session to the next
(add_param_group after steps, parameters moved or unfrozen: dos/_carry.py).

At 7B that state is 81 GB: held in the trainer's memory beside dosd's it
once had the OOM killer take the node's sessions. Here the memory check is
made to say "no room" (the host's real figure would keep a toy model in
memory), so the state goes through a file in DOS_SPILL_DIR; training must go
on exactly as torch's, and the file must be unnamed (nothing left behind).
With no disk either the rebuild is refused before anything changes.
"""

import os

import pytest

torch = pytest.importorskip("torch")
import dos  # noqa: E402
import dos.torch  # noqa: E402
from dos import _carry  # noqa: E402
from dos._state import merged_master  # noqa: E402
from test_dropin import DEVICES, HP, Net, assert_state_same, step_both  # noqa: E402
from test_equivalence import assert_same, make_data  # noqa: E402


class Spied(_carry.Carry):
    """Carry, each instance noted (where it spilled, how much it wrote)."""
    made = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        Spied.made.append(self)


@pytest.fixture
def no_memory(monkeypatch, tmp_path):
    """The host has no memory to spare; DOS_SPILL_DIR is a fresh directory."""
    monkeypatch.setattr(_carry, "available_memory", lambda: 0)
    monkeypatch.setattr(_carry, "_SMALL", 0)
    monkeypatch.setattr(_carry, "_DISK_MARGIN", 0)
    monkeypatch.setattr(_carry, "Carry", Spied)
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, "") if os.path.isdir(d)
                        else (0, "no such directory"))  # tmp_path may be on tmpfs here
    monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
    Spied.made = []
    return tmp_path


@pytest.mark.parametrize("dev", DEVICES)
def test_add_param_group_after_steps_carries_the_state_through_a_file(dos_socket, dev,
                                                                      no_memory):
    data = make_data(n=16)
    ref, mine = Net().to(dev), Net().to(dev)
    ref_opt = torch.optim.AdamW(ref.body.parameters(), **HP)
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data, 1):
            if i == 9:
                for m, o in ((ref, ref_opt), (mine, opt)):
                    o.add_param_group({"params": list(m.norm.parameters()) +
                                       list(m.heads.parameters()), "lr": 5e-3})
                spilled = [c for c in Spied.made if c.path is not None]
                assert [c.path for c in spilled] == [str(no_memory)]
                body = sum(p.numel() for p in mine.body.parameters())
                assert spilled[0].nbytes == 12 * body  # the stepped tensors only
                assert os.listdir(no_memory) == []  # unnamed: nothing left behind
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


def test_a_moved_parameter_carries_its_state_through_a_file(dos_socket, no_memory):
    data = make_data(n=10)
    ref, mine = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    with dos.torch.AdamW(mine.parameters(), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data, 1):
            if i == 5:
                with torch.no_grad():
                    for m in (ref, mine):
                        m.body.weight.data = m.body.weight.data.clone()
                with pytest.warns(RuntimeWarning, match="moved to new storage"):
                    step_both([(ref, ref_opt), (mine, opt)], x, y)
                assert any(c.path == str(no_memory) for c in Spied.made)
            else:
                step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


def test_with_no_room_anywhere_the_rebuild_is_refused_and_nothing_changes(dos_socket,
                                                                          no_memory,
                                                                          monkeypatch):
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (4096, ""))
    data = make_data(n=10)
    ref, mine = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.body.parameters(), **HP)
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data, 1):
            if i == 5:
                with pytest.raises(dos.DosError, match="DOS_SPILL_DIR") as err:
                    opt.add_param_group({"params": list(mine.heads.parameters())})
                assert err.value.code_name == "RESOURCE_EXHAUSTED"
                assert "add_param_group() after steps" in str(err.value)
                assert len(opt.param_groups) == 1
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


def test_memory_file_systems_are_no_spill_directories():
    assert _carry.fs_type("/proc/self") == "proc"
    if os.path.isdir("/dev/shm") and _carry.fs_type("/dev/shm") == "tmpfs":
        free, why = _carry._disk_room("/dev/shm")
        assert free == 0 and "memory" in why
    assert _carry._disk_room("/no/such/dir") == (0, "no such directory")


def test_a_nan_weight_is_not_taken_as_written():
    """A NaN parameter whose master is NaN: nothing to rewrite (it once
    always counted as written)."""
    master = torch.tensor([1.0, float("nan"), 3.0])
    assert merged_master(master, master.clone()) is None
    assert merged_master(master, master.to(torch.bfloat16)) is None
    written = torch.tensor([1.0, float("nan"), 4.0])
    assert torch.equal(merged_master(master, written)[2], torch.tensor(4.0))


def test_a_group_dosd_refuses_is_undone_from_the_file(dos_socket, no_memory):
    """dosd refuses the new session (a float64 parameter): the old groups
    are registered again from the same file, and training goes on."""
    data = make_data(n=10)
    ref, mine = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.body.parameters(), **HP)
    bad = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP) as opt:
        for i, (x, y) in enumerate(data, 1):
            if i == 5:
                with pytest.raises(dos.DosError):
                    opt.add_param_group({"params": [bad]})
                assert len(opt.param_groups) == 1
                assert any(c.path == str(no_memory) for c in Spied.made)
            step_both([(ref, ref_opt), (mine, opt)], x, y)
            assert_same(mine, ref, i)
        assert_state_same(opt, ref_opt, mine, ref)


def test_dos_spill_picks_memory_or_disk_and_refuses_a_typo(monkeypatch, tmp_path):
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, ""))
    monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
    monkeypatch.setenv("DOS_SPILL", "always")
    assert _carry.Carry(4096, "a test").path == str(tmp_path)
    assert _carry.Carry(0, "a test").path is None  # nothing stepped: nothing to spill
    monkeypatch.setattr(_carry, "available_memory", lambda: 0)
    monkeypatch.setenv("DOS_SPILL", "never")
    assert _carry.Carry(1 << 40, "a test").path is None
    monkeypatch.setenv("DOS_SPILL", "sometimes")
    with pytest.raises(dos.DosError, match="DOS_SPILL='sometimes'"):
        _carry.Carry(4096, "a test")
