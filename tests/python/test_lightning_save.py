"""Lightning's checkpoint save (dos/_lightning.py): `_atomic_save` as
Lightning writes it (torch.save into a BytesIO, then the buffer's copy to
the file: the whole checkpoint twice in the trainer, 81 GB of optimizer
state each at 7B) is replaced, once a DOS optimizer exists, by a save that
streams into a file beside the path and renames it; URLs go to Lightning's."""

import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402
from dos import _lightning  # noqa: E402

# lightning/fabric/utilities/cloud_io.py's save, as Lightning 2.6 writes it
# for a local file system (the buffer is what costs the memory).
CLOUD_IO = '''
import io

import torch

buffered = []


def _atomic_save(checkpoint, filepath):
    bytesbuffer = io.BytesIO()
    torch.save(checkpoint, bytesbuffer)
    buffered.append(len(bytesbuffer.getvalue()))
    with open(filepath, "wb") as f:
        f.write(bytesbuffer.getvalue())
'''


@pytest.fixture
def fake_lightning(monkeypatch):
    """lightning.fabric.utilities.cloud_io and the checkpoint IO module that
    imports its _atomic_save by name, as in Lightning."""
    cloud_io = types.ModuleType("lightning.fabric.utilities.cloud_io")
    exec(compile(CLOUD_IO, "lightning/fabric/utilities/cloud_io.py", "exec"), cloud_io.__dict__)
    torch_io = types.ModuleType("lightning.fabric.plugins.io.torch_io")
    torch_io._atomic_save = cloud_io._atomic_save
    monkeypatch.setitem(sys.modules, cloud_io.__name__, cloud_io)
    monkeypatch.setitem(sys.modules, torch_io.__name__, torch_io)
    monkeypatch.delenv("DOS_LIGHTNING_STREAM_SAVE", raising=False)
    return cloud_io, torch_io


def test_a_lightning_checkpoint_of_a_dos_optimizer_is_streamed_to_its_file(
        dos_socket, tmp_path, fake_lightning):
    cloud_io, torch_io = fake_lightning
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    x, y = torch.randn(8, 512), torch.randn(8, 4)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket) as opt:
        assert torch_io._atomic_save._dos_streamed  # installed when the optimizer was built
        assert cloud_io._atomic_save._dos_streamed
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        ckpt = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                "global_step": 2}
        path = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
        path.parent.mkdir()
        path.write_bytes(b"an older checkpoint")
        torch_io._atomic_save(ckpt, path)
        assert cloud_io.buffered == []  # no copy of the checkpoint in the trainer
        assert os.listdir(path.parent) == [path.name]  # renamed over it, nothing left beside
        assert os.stat(path).st_mode & 0o777 == 0o600  # owner-only, as fsspec's transaction
        loaded = torch.load(path)
        saved = opt.state_dict()["state"]
        for i, s in saved.items():
            for k, v in s.items():
                assert torch.equal(torch.as_tensor(loaded["optimizer_states"][0]["state"][i][k]),
                                   torch.as_tensor(v)), (i, k)
        assert loaded["global_step"] == 2
        # Another destination goes to Lightning's own save.
        with pytest.raises(OSError):
            torch_io._atomic_save(ckpt, "s3://bucket/epoch=0-step=2.ckpt")
        assert len(cloud_io.buffered) == 1


def test_a_failed_save_leaves_the_old_checkpoint_and_nothing_beside_it(tmp_path,
                                                                        fake_lightning):
    _, torch_io = fake_lightning
    _lightning.install()
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"the last good checkpoint")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        torch_io._atomic_save({"x": Unpicklable()}, path)
    assert path.read_bytes() == b"the last good checkpoint"
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_switched_off_by_the_environment(fake_lightning, monkeypatch):
    cloud_io, torch_io = fake_lightning
    monkeypatch.setenv("DOS_LIGHTNING_STREAM_SAVE", "0")
    _lightning.install()
    assert not getattr(torch_io._atomic_save, "_dos_streamed", False)


def test_lightning_imported_after_the_optimizer_is_streamed_at_its_first_state_dict(
        dos_socket, monkeypatch):
    """Lightning dumps the optimizer's state_dict() right before it saves:
    a Lightning imported after the optimizer was built is wrapped then."""
    model = torch.nn.Linear(8, 4)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket) as opt:
        cloud_io = types.ModuleType("lightning.fabric.utilities.cloud_io")
        exec(compile(CLOUD_IO, "lightning/fabric/utilities/cloud_io.py", "exec"),
             cloud_io.__dict__)
        monkeypatch.setitem(sys.modules, cloud_io.__name__, cloud_io)
        monkeypatch.delenv("DOS_LIGHTNING_STREAM_SAVE", raising=False)
        assert not getattr(cloud_io._atomic_save, "_dos_streamed", False)
        opt.state_dict()
        assert cloud_io._atomic_save._dos_streamed
