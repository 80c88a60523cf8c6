"""A framework's resume maps the optimizer file (dos/_mmapload.py): the HF
Trainer's torch.load(optimizer.pt) and Accelerate's torch.load(optimizer.bin)
get mmap=True, so the trainer never holds a private copy of the whole state
beside dosd's; every other torch.load is left as it was."""

import io
import sys
import types

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402
from dos import _mmapload  # noqa: E402

HAS_MMAP = hasattr(torch, "__version__") and tuple(
    int(x) for x in torch.__version__.split(".")[:2]) >= (2, 1)


def zip_file(path, obj=None):
    torch.save(obj if obj is not None else {"state": {0: torch.ones(4)}}, path)
    return path


@pytest.mark.parametrize("name,size_floor,expect", [
    ("optimizer.pt", 0, True),          # the HF Trainer's
    ("optimizer.bin", 0, True),         # Accelerate's
    ("optimizer_2.bin", 0, True),       # Accelerate's further optimizers
    ("optimizer.pt", 1 << 40, False),   # small files are read as before
    ("model.pt", 0, False),
    ("optimizer.pt.bak", 0, False),
    ("scheduler.pt", 0, False),
])
def test_only_large_optimizer_files_in_zip_format_are_mapped(tmp_path, monkeypatch, name,
                                                             size_floor, expect):
    monkeypatch.setattr(_mmapload, "_MIN_BYTES", size_floor)
    path = zip_file(tmp_path / name)
    assert _mmapload.maps(path) is expect
    assert _mmapload.maps(str(path)) is expect


def test_file_objects_legacy_files_and_missing_files_are_not_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(_mmapload, "_MIN_BYTES", 0)
    path = zip_file(tmp_path / "optimizer.pt")
    with open(path, "rb") as f:
        assert not _mmapload.maps(f)  # torch maps paths only
    assert not _mmapload.maps(io.BytesIO(path.read_bytes()))
    legacy = tmp_path / "legacy" / "optimizer.pt"
    legacy.parent.mkdir()
    torch.save({"x": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert not _mmapload.maps(legacy)  # torch refuses mmap for the old format
    assert not _mmapload.maps(tmp_path / "gone" / "optimizer.pt")
    assert not _mmapload.maps(b"optimizer.pt")


@pytest.fixture
def fake_torch_load(monkeypatch):
    """torch.load replaced by a recorder and torch's mmap default (torch >=
    2.5's config, or a stand-in on older torch) set to False, both restored
    afterwards. Yields (calls, set_default)."""
    calls = []

    def recorder(f, *args, mmap=None, **kwargs):  # torch >= 2.1's signature
        calls.append(mmap)
        return "loaded"

    try:
        from torch.utils.serialization import config
    except ImportError:
        config = types.SimpleNamespace(load=types.SimpleNamespace(mmap=False))
        monkeypatch.setitem(sys.modules, "torch.utils.serialization",
                            types.SimpleNamespace(config=config))

    def set_default(value):
        monkeypatch.setattr(config.load, "mmap", value)

    set_default(False)
    monkeypatch.setattr(torch, "load", recorder)
    monkeypatch.delenv("DOS_TORCH_LOAD_MMAP", raising=False)
    monkeypatch.setattr(_mmapload, "_MIN_BYTES", 0)
    return calls, set_default


def test_the_wrapper_maps_only_what_maps_says_and_only_without_mmap_given(tmp_path,
                                                                          fake_torch_load):
    calls, set_default = fake_torch_load
    opt_file = zip_file(tmp_path / "optimizer.pt")
    model_file = zip_file(tmp_path / "model.pt")
    _mmapload.install()
    _mmapload.install()  # once: not wrapped twice
    assert torch.load._dos_mmap_wrapped
    assert torch.load(opt_file, map_location="cpu") == "loaded"
    torch.load(model_file)
    torch.load(opt_file, mmap=False)       # the caller's choice stands
    set_default(True)
    torch.load(opt_file)                   # torch's own default set: left to it
    assert calls == [True, None, False, None]


def test_switched_off_by_the_environment(tmp_path, fake_torch_load, monkeypatch):
    calls, _ = fake_torch_load
    monkeypatch.setenv("DOS_TORCH_LOAD_MMAP", "0")
    _mmapload.install()
    assert not getattr(torch.load, "_dos_mmap_wrapped", False)
    torch.load(zip_file(tmp_path / "optimizer.pt"))
    assert calls == [None]


def mapped_files():
    with open("/proc/self/maps") as f:
        return f.read()


@pytest.mark.skipif(not HAS_MMAP, reason="torch < 2.1 has no torch.load(mmap=True)")
def test_a_resume_through_torch_load_maps_the_saved_state(dos_socket, tmp_path, monkeypatch):
    monkeypatch.setattr(_mmapload, "_MIN_BYTES", 1 << 20)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    x, y = torch.randn(8, 512), torch.randn(8, 4)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket) as opt:
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        path = tmp_path / "checkpoint-2" / "optimizer.pt"
        path.parent.mkdir()
        torch.save(opt.state_dict(), path)
        saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()
                 if torch.is_tensor(v)}
        # What the HF Trainer does on resume_from_checkpoint:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        assert str(path) in mapped_files()  # mapped, not read into private memory
        for k, v in saved.items():
            assert torch.equal(loaded["state"][0][k], v), k
        opt.load_state_dict(loaded)
        del loaded
        after = opt.state_dict()["state"][0]
        for k, v in saved.items():
            assert torch.equal(after[k], v), k


def test_a_torch_load_without_mmap_is_left_alone(monkeypatch):
    """torch < 2.1 (no mmap= in torch.load): nothing is wrapped."""
    monkeypatch.setattr(torch, "load", lambda f, map_location=None: "loaded")
    monkeypatch.delenv("DOS_TORCH_LOAD_MMAP", raising=False)
    _mmapload.install()
    assert not getattr(torch.load, "_dos_mmap_wrapped", False)
