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


# lightning/pytorch/plugins/io/async_plugin.py's AsyncCheckpointIO as Lightning
# 2.5.4-2.6 behaves: every tensor cloned on the calling thread, then the
# wrapped IO's save on a one-thread executor.
ASYNC_IO = '''
from concurrent.futures import ThreadPoolExecutor

import torch

cloned = []


def _clone_tensor(t):
    cloned.append(t.numel())
    return t.detach().clone() if t.is_cpu else t.detach().cpu()


def _cloned(obj):
    if isinstance(obj, torch.Tensor):
        return _clone_tensor(obj)
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


class AsyncCheckpointIO:
    def __init__(self, checkpoint_io):
        self.checkpoint_io = checkpoint_io
        self._executor = None
        self._error = None

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1)
        checkpoint = _cloned(checkpoint)

        def _save(*args):
            try:
                self.checkpoint_io.save_checkpoint(*args)
            except BaseException as ex:
                self._error = ex
        self._executor.submit(_save, checkpoint, path, storage_options)
        if self._error:
            raise self._error

    def teardown(self):
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
'''


class RecordingIO:
    """The wrapped checkpoint IO: torch.save, noting the thread and order."""

    def __init__(self):
        self.saves = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        import threading
        import time
        if checkpoint.get("slow"):
            time.sleep(0.3)
        torch.save(checkpoint, path)
        self.saves.append((os.path.basename(path), threading.current_thread().name))


def test_async_checkpoint_io_saves_dos_state_whole_without_a_copy(dos_socket, tmp_path,
                                                                  monkeypatch):
    """A checkpoint holding a DOS optimizer's state dict (views of dosd's
    memory) is written on the calling thread after the saves queued before
    it: nothing of the state cloned (81 GB at 7B), and the file holds that
    step, not the later steps the thread would read into it. A checkpoint
    without DOS state still goes to the thread."""
    plugin = types.ModuleType("lightning.pytorch.plugins.io.async_plugin")
    exec(compile(ASYNC_IO, "lightning/pytorch/plugins/io/async_plugin.py", "exec"),
         plugin.__dict__)
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    x, y = torch.randn(8, 1024), torch.randn(8, 1024)
    inner = RecordingIO()
    aio = plugin.AsyncCheckpointIO(inner)
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket) as opt:
        assert plugin.AsyncCheckpointIO.save_checkpoint._dos_inline
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        aio.save_checkpoint({"slow": True, "w": torch.ones(3)}, str(tmp_path / "before.ckpt"))
        state = opt.state_dict()
        assert any(_lightning._holds_views(s) for s in state["state"].values())
        assert not _lightning._holds_views({"sparse": torch.eye(3).to_sparse(),
                                            "meta": torch.empty(3, device="meta")})
        expected = {i: {k: torch.as_tensor(v).clone() for k, v in s.items()}
                    for i, s in state["state"].items()}
        plugin.cloned.clear()
        aio.save_checkpoint({"optimizer_states": [state]}, str(tmp_path / "dos.ckpt"))
        assert plugin.cloned == []  # nothing cloned
        assert [n for n, _ in inner.saves] == ["before.ckpt", "dos.ckpt"]
        assert inner.saves[1][1] == __import__("threading").current_thread().name
        for _ in range(2):  # later steps change the views, not the file
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        loaded = torch.load(tmp_path / "dos.ckpt")["optimizer_states"][0]["state"]
        for i, s in expected.items():
            for k, v in s.items():
                assert torch.equal(torch.as_tensor(loaded[i][k]), v), (i, k)
        aio.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "plain.ckpt"))
        aio.teardown()
        assert inner.saves[2][0] == "plain.ckpt" and inner.saves[2][1] != inner.saves[1][1]


def test_lightnings_own_async_checkpoint_io_clones_no_dos_state(dos_socket, tmp_path,
                                                                monkeypatch):
    """The same with the installed Lightning's AsyncCheckpointIO and
    TorchCheckpointIO (skipped where Lightning is not installed)."""
    plugin = pytest.importorskip("lightning.pytorch.plugins.io.async_plugin")
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    clones = []
    original = getattr(plugin, "_clone_tensor", None)
    if original is not None:  # Lightning >= 2.5.4
        monkeypatch.setattr(plugin, "_clone_tensor", lambda t: clones.append(t) or original(t))
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    x, y = torch.randn(8, 1024), torch.randn(8, 1024)
    aio = plugin.AsyncCheckpointIO(TorchCheckpointIO())
    with dos.torch.AdamW(model.parameters(), lr=1e-3, socket=dos_socket) as opt:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        state = opt.state_dict()
        expected = torch.as_tensor(state["state"][0]["exp_avg"]).clone()
        aio.save_checkpoint({"optimizer_states": [state]}, str(tmp_path / "dos.ckpt"))
        assert not any(_lightning._holds_views(t) for t in clones)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        aio.teardown()
        loaded = torch.load(tmp_path / "dos.ckpt")["optimizer_states"][0]["state"]
        assert torch.equal(torch.as_tensor(loaded[0]["exp_avg"]), expected)
