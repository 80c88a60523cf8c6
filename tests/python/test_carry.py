"""The state a rebuild carries from one dosd session to the next
(add_param_group after steps, parameters moved or unfrozen: dos/_carry.py).

At 7B that state is 81 GB: held in the trainer's memory beside dosd's it
once had the OOM killer take the node's sessions. Here the memory check is
made to say "no room" (the host's real figure would keep a toy model in
memory), so the state goes through a file in DOS_SPILL_DIR; training must go
on exactly as torch's, and the file must be unnamed (nothing left behind).
With no disk either the rebuild is refused before anything changes.
"""

import io
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
    """Told by statfs, not by parsing mountinfo (two mounts on one point,
    escaped names)."""
    assert _carry.fs_type("/proc/self") == "proc"
    if os.path.isdir("/dev/shm") and _carry.fs_type("/dev/shm") == "tmpfs":
        free, why = _carry._disk_room("/dev/shm")
        assert free == 0 and "memory" in why
    assert _carry._disk_room("/no/such/dir") == (0, "no such directory")


def test_the_nodes_ranks_share_the_memory_a_rebuild_may_take(monkeypatch):
    """Every rank rebuilds at once (add_param_group on each): 4 ranks of 30
    GB each with 100 GB free would each see room for themselves alone."""
    monkeypatch.setattr(_carry, "_meminfo", lambda key: 100 << 30)
    monkeypatch.setattr(_carry, "_cgroup_room", lambda: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _carry.available_memory() == 25 << 30
    monkeypatch.setattr(_carry, "_cgroup_room", lambda: 40 << 30)
    assert _carry.available_memory() == 10 << 30


def test_the_tightest_cgroup_above_the_process_counts(monkeypatch, tmp_path):
    """A limit on an ancestor (Slurm's job, a systemd slice) with "max" on
    the process's own cgroup; cgroup v1's memory controller as well."""
    leaf = tmp_path / "v2" / "job_1" / "step_0" / "task_0"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text("100\n")
    (leaf.parent.parent / "memory.max").write_text(str(8 << 30))
    (leaf.parent.parent / "memory.current").write_text(str(3 << 30))
    v1 = tmp_path / "v1" / "batch"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(16 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(10 << 30))
    lines = "0::/job_1/step_0/task_0\n4:memory:/batch\n"
    real_open = open

    def fake_open(path, *a, **kw):
        path = str(path)
        if path == "/proc/self/cgroup":
            return io.StringIO(lines)
        for root, where in (("/sys/fs/cgroup/memory", "v1"), ("/sys/fs/cgroup", "v2")):
            if path.startswith(root + "/") or path == root:
                return real_open(str(tmp_path / where) + path[len(root):], *a, **kw)
        return real_open(path, *a, **kw)
    monkeypatch.setattr("builtins.open", fake_open)
    assert _carry._cgroup_room() == 5 << 30
    lines = "4:memory:/batch\n"
    assert _carry._cgroup_room() == 6 << 30


def test_the_spill_file_is_given_back_when_the_rebuild_is_refused(dos_socket, no_memory,
                                                                  monkeypatch):
    """A group dosd refuses: the file is closed at once, not when a
    traceback lets go of it (81 GB of disk at 7B)."""
    bad = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    mine = Net()
    x, y = make_data(n=1)[0]
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP) as opt:
        torch.nn.functional.mse_loss(mine(x), y).backward()
        opt.step()
        with pytest.raises(dos.DosError):
            opt.add_param_group({"params": [bad]})
        assert all(c._file is None or c._file.closed for c in Spied.made)
        assert Spied.made  # it did spill


def test_a_bad_group_reads_no_state(dos_socket, no_memory):
    """amsgrad=True is refused before the state is read (minutes at 7B)."""
    mine = Net()
    x, y = make_data(n=1)[0]
    with dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP) as opt:
        torch.nn.functional.mse_loss(mine(x), y).backward()
        opt.step()
        with pytest.raises(NotImplementedError):
            opt.add_param_group({"params": list(mine.heads.parameters()), "amsgrad": True})
        assert Spied.made == [] and len(opt.param_groups) == 1


def test_a_spill_that_cannot_be_read_back_says_the_state_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, ""))
    monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
    monkeypatch.setenv("DOS_SPILL", "always")
    c = _carry.Carry(12 * 4, "a test")
    s = c.keep(torch.ones(4), torch.ones(4), torch.ones(4), step=1)
    assert torch.equal(_carry.restored(s)["exp_avg"], torch.ones(4))
    c.close()
    with pytest.raises(dos.DosError, match="state of the steps so far is lost"):
        _carry.restored(s)


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


@pytest.mark.parametrize("spill", ["never", "always"])
def test_a_rebuild_dosd_refuses_twice_writes_the_state_where_the_error_says(
        dos_socket, no_memory, monkeypatch, tmp_path, spill):
    """dosd refuses the new session and then the old groups' again (its
    host memory taken meanwhile): the optimizer is closed, but the state of
    the steps so far is in the folder the error names, and an optimizer
    built again from it trains on exactly as torch's (it once was lost)."""
    monkeypatch.setenv("DOS_SPILL", spill)
    monkeypatch.chdir(tmp_path)
    data = make_data(n=10)
    ref, mine = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.body.parameters(), **HP)
    opt = dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP)
    for i, (x, y) in enumerate(data[:5], 1):
        step_both([(ref, ref_opt), (mine, opt)], x, y)
    from dos import _assembly
    real = _assembly.Assembly.register
    monkeypatch.setattr(_assembly.Assembly, "register", lambda self: (_ for _ in ()).throw(
        dos.DosError(8, "host memory: none left (a test)")))
    with pytest.raises(dos.DosError, match="rescued_state_dict") as err:
        opt.add_param_group({"params": list(mine.heads.parameters())})
    assert "none left (a test)" in str(err.value)
    monkeypatch.setattr(_assembly.Assembly, "register", real)
    folder = str(err.value).split("written to ", 1)[1].split(":", 1)[0]
    assert folder.startswith(str(tmp_path))
    with pytest.raises(dos.DosError, match="closed"):
        opt.step()
    opt = dos.torch.AdamW(mine.body.parameters(), socket=dos_socket, **HP)
    opt.load_state_dict(dos.torch.rescued_state_dict(folder))
    for i, (x, y) in enumerate(data[5:], 6):
        step_both([(ref, ref_opt), (mine, opt)], x, y)
        assert_same(mine, ref, i)
    assert_state_same(opt, ref_opt, mine, ref)
    opt.close()


def test_memory_must_hold_the_carried_state_beside_the_new_session(monkeypatch, tmp_path):
    """Twice the carried bytes, the new session's added share and a margin:
    a large group added to a small stepped one spills (dosd once refused the
    new session for the memory the carried state held, and the optimizer was
    closed with its state)."""
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, ""))
    monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
    monkeypatch.setattr(_carry, "_SMALL", 0)
    monkeypatch.setattr(_carry, "_MARGIN", 2 << 20)
    monkeypatch.setattr(_carry, "available_memory", lambda: 10 << 20)
    assert _carry.Carry(3 << 20, "a test").path is None  # 6 + 2 MiB of 10
    assert _carry.Carry(3 << 20, "a test", adding=3 << 20).path == str(tmp_path)


@pytest.mark.parametrize("spill", ["never", "always"])
def test_a_rescued_shard_keeps_its_local_shape(monkeypatch, tmp_path, spill):
    """An FSDP2 parameter (a DTensor) is rescued as its rank's shard:
    reshaped to the global shape the rescue once raised and called the
    state lost. A world of one with a shard claimed as half of [8, 4]."""
    dist = pytest.importorskip("torch.distributed")
    dt = pytest.importorskip("torch.distributed.tensor")
    mesh_mod = pytest.importorskip("torch.distributed.device_mesh")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, ""))
    monkeypatch.setenv("DOS_SPILL_DIR", str(tmp_path))
    monkeypatch.setenv("DOS_SPILL", spill)
    monkeypatch.chdir(tmp_path)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        mesh = mesh_mod.DeviceMesh("cpu", [0])
        local = torch.randn(4, 4)
        p = torch.nn.Parameter(dt.DTensor.from_local(local, mesh, [dt.Shard(0)], run_check=False,
                                                     shape=torch.Size([8, 4]), stride=(4, 1)))
        assert tuple(p.shape) == (8, 4)
        saved = _carry.Saved(_carry.Carry(12 * 16, "a test"))
        arrays = [torch.randn(16) for _ in range(3)]
        saved[id(p)] = saved.carry.keep(*arrays, step=3)
        folder, why = _carry.rescue(saved, [{"params": [p], "lr": 1e-3}])
        saved.close()
        assert folder, why
        sd = dos.torch.rescued_state_dict(folder)
        s = sd["state"][0]
        assert tuple(s["exp_avg"].shape) == (4, 4) and "master_param" not in s
        assert torch.equal(s["exp_avg"].reshape(-1), arrays[1])
        assert torch.equal(s["exp_avg_sq"].reshape(-1), arrays[2])
        assert float(s["step"]) == 3 and sd["param_groups"][0]["params"] == [0]
    finally:
        dist.destroy_process_group()


def test_a_directory_that_cannot_make_the_file_passes_to_the_next(monkeypatch, tmp_path):
    """No inodes left in the first directory (the file's creation fails):
    the next one takes the spill, as a full disk's would."""
    import errno
    import tempfile
    full, ok = tmp_path / "full", tmp_path / "ok"
    full.mkdir()
    ok.mkdir()
    monkeypatch.setattr(_carry, "_candidates", lambda: [str(full), str(ok)])
    monkeypatch.setattr(_carry, "_disk_room", lambda d: (1 << 40, ""))
    real = tempfile.TemporaryFile

    def made(dir=None, **kw):
        if dir == str(full):
            raise OSError(errno.ENOSPC, "No space left on device (inodes)")
        return real(dir=dir, **kw)
    monkeypatch.setattr(tempfile, "TemporaryFile", made)
    f, d, tried = _carry.reserve(1 << 16)
    assert f is not None and d == str(ok) and tried == ""
    f.close()
