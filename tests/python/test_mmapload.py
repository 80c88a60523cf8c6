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
    ("epoch=0-step=100.ckpt", 0, True),  # Lightning's ModelCheckpoint
    ("last.ckpt", 0, True),
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


def test_other_file_objects_legacy_files_and_missing_files_are_not_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(_mmapload, "_MIN_BYTES", 0)
    path = zip_file(tmp_path / "optimizer.pt")
    with open(path, "rb") as f:
        assert _mmapload.maps(f)  # a local file's object at its start: mapped by its path
        f.read(1)
        assert not _mmapload.maps(f)  # read from elsewhere: the caller's position
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
    calls, locations, files = [], [], []
    monkeypatch.setattr(_mmapload, "locations", locations, raising=False)
    monkeypatch.setattr(_mmapload, "files", files, raising=False)

    def recorder(f, map_location=None, *args, mmap=None, **kwargs):  # torch >= 2.1's
        calls.append(mmap)
        files.append(f)
        locations.append(map_location)
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


def test_a_load_onto_a_gpu_is_mapped_onto_the_host(tmp_path, fake_torch_load):
    """The HF Trainer with several ranks: torch.load(optimizer.pt,
    map_location=args.device) would put the whole state (81 GB at 7B) on each
    rank's GPU; the mapped load goes to the host, which load_state_dict()
    streams into dosd. Other files and other locations are left alone."""
    calls, _ = fake_torch_load
    locations = _mmapload.locations
    opt_file = zip_file(tmp_path / "optimizer.pt")
    model_file = zip_file(tmp_path / "model.pt")
    _mmapload.install()
    torch.load(opt_file, map_location="cuda:1")
    torch.load(opt_file, torch.device("cuda", 0))  # positional
    torch.load(opt_file, map_location=torch.device("cpu"))
    remap = {"cuda:0": "cpu"}
    torch.load(opt_file, map_location=remap)       # a mapping or callable: the caller's
    torch.load(model_file, map_location="cuda:0")  # not an optimizer file: untouched
    torch.load(opt_file, map_location="cuda:0", mmap=False)  # the caller's choice
    ckpt = zip_file(tmp_path / "last.ckpt")  # more than an optimizer's: the caller's device
    torch.load(ckpt, map_location="cuda:0")
    assert calls == [True, True, True, True, None, False, True]
    assert locations == ["cpu", "cpu", torch.device("cpu"), remap, "cuda:0", "cuda:0", "cuda:0"]


def test_lightnings_load_through_a_file_object_maps_the_file(tmp_path, fake_torch_load):
    """Lightning's fit(ckpt_path=...) opens the .ckpt through fsspec and
    hands torch.load the file object: the file is mapped by its path."""
    calls, _ = fake_torch_load
    ckpt = zip_file(tmp_path / "epoch=1-step=20.ckpt")
    _mmapload.install()
    with open(ckpt, "rb") as f:
        torch.load(f, map_location="cpu")
    stream = io.BytesIO(ckpt.read_bytes())
    torch.load(stream)
    assert calls == [True, None]
    assert _mmapload.files == [str(ckpt), stream]


def test_switched_off_by_the_environment(tmp_path, fake_torch_load, monkeypatch):
    calls, _ = fake_torch_load
    monkeypatch.setenv("DOS_TORCH_LOAD_MMAP", "0")
    _mmapload.install()
    assert not getattr(torch.load, "_dos_mmap_wrapped", False)
    torch.load(zip_file(tmp_path / "optimizer.pt"))
    assert calls == [None]


def mapped_at(path, address):
    """Whether `address` lies in a mapping of `path` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if start <= address < end:
                    return True
    return False


def test_small_tensors_of_a_mapped_checkpoint_are_copied():
    big, small = torch.zeros(1 << 18), torch.zeros(4)  # 1 MiB and 16 bytes
    ckpt = {"state_dict": {"w": big, "b": small}, "callbacks": [{"best": small}],
            "pair": (small, big), "step": 3}
    out = _mmapload._unpinned(ckpt)
    assert out["state_dict"]["w"] is big and out["pair"][1] is big
    for t in (out["state_dict"]["b"], out["callbacks"][0]["best"], out["pair"][0]):
        assert t is not small and torch.equal(t, small)
    assert out["step"] == 3


def mapped_files():
    with open("/proc/self/maps") as f:
        return f.read()


@pytest.mark.skipif(not HAS_MMAP, reason="torch < 2.1 has no torch.load(mmap=True)")
@pytest.mark.parametrize("how", ["hf", "lightning"])
def test_a_resume_through_torch_load_maps_the_saved_state(dos_socket, tmp_path, monkeypatch,
                                                          how):
    """The HF Trainer loads checkpoint-N/optimizer.pt by path (onto a GPU with
    several ranks), Lightning its .ckpt through an fsspec file object."""
    monkeypatch.setattr(_mmapload, "_MIN_BYTES", 1 << 20)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    x, y = torch.randn(8, 512), torch.randn(8, 4)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket) as opt:
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        name = "optimizer.pt" if how == "hf" else "epoch=0-step=2.ckpt"
        path = tmp_path / "checkpoint-2" / name
        path.parent.mkdir()
        torch.save(opt.state_dict(), path)
        saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()
                 if torch.is_tensor(v)}
        gpu = "cuda:0" if torch.cuda.is_available() else "cpu"
        if how == "hf":  # resume_from_checkpoint, with several ranks onto args.device
            loaded = torch.load(path, map_location=gpu, weights_only=True)
        else:  # lightning.fabric.utilities.cloud_io._load: fsspec's local file object
            with open(path, "rb") as f:
                loaded = torch.load(f, map_location="cpu", weights_only=True)
        assert str(path) in mapped_files()  # mapped, not read into private memory
        assert loaded["state"][0]["exp_avg"].device.type == "cpu"  # not onto the GPU
        # A Lightning checkpoint's small tensors (a bias here; a callback's best
        # score) are copies: one kept would keep the whole file mapped.
        small, large = loaded["state"][1]["exp_avg"], loaded["state"][0]["exp_avg"]
        assert mapped_at(path, large.data_ptr())
        assert mapped_at(path, small.data_ptr()) == (how == "hf")
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
