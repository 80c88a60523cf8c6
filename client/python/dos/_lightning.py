"""Lightning's checkpoint save without a copy of the whole checkpoint in the
trainer.

Lightning (2.x; 2.6.6 on the GPU machine) saves every checkpoint through
`lightning.fabric.utilities.cloud_io._atomic_save`: torch.save into an
io.BytesIO, then `f.write(buffer.getvalue())`. That holds the whole
checkpoint twice in the trainer's private memory: the optimizer's state (12
bytes a parameter, 81 GB at 7B, beside dosd's own copy) and the weights. A
DOS state dict is views of dosd's memory, from which torch.save streams into
a file; the buffer copies them all the same.

`install()` (called when a DOS optimizer is built, with Lightning imported)
replaces `_atomic_save` in Lightning's modules that hold it (its checkpoint
IO imports it by name) with `save()` below: a checkpoint for a local path is
written by torch.save straight into a new file beside it, flushed, synced
and renamed over the path (atomic, as Lightning's is); any other destination
(an object store, another fsspec file system) goes to Lightning's own
function. DOS_LIGHTNING_STREAM_SAVE=0 switches it off.

Lightning's AsyncCheckpointIO hands each save to a thread. Since 2.5.4 it
first clones every tensor of the checkpoint on the calling thread (the
whole optimizer state into this process: the OOM killer at 7B); before, its
thread read the state dict's views while later steps changed them (a file
mixing steps). `install()` also wraps its save_checkpoint: a checkpoint that
holds views of dosd's memory (dos/_views.py over_dosd) is written on the
calling thread, after the saves queued before it, so that it holds one
step whole and nothing is copied; others go to the thread as before. The
state is most of such a checkpoint's bytes, so little overlap is lost.
"""

from __future__ import annotations

import functools
import os
import sys
import uuid

import torch

from dos import _views

__all__ = ["install"]

_PACKAGES = ("lightning.", "lightning_fabric.", "pytorch_lightning.")
# Where _atomic_save may be defined: the unified package's and the standalone ones'.
_CLOUD_IO = ("lightning.fabric.utilities.cloud_io", "lightning_fabric.utilities.cloud_io",
             "pytorch_lightning.utilities.cloud_io")
_ASYNC_IO = ("lightning.pytorch.plugins.io.async_plugin",
             "pytorch_lightning.plugins.io.async_plugin")


def install() -> None:
    """Wraps Lightning's `_atomic_save` where its modules hold it, and
    AsyncCheckpointIO.save_checkpoint (see above)."""
    for source in _ASYNC_IO:
        cls = getattr(sys.modules.get(source), "AsyncCheckpointIO", None)
        save = getattr(cls, "save_checkpoint", None)
        if callable(save) and not getattr(save, "_dos_inline", False):
            cls.save_checkpoint = _inline(save)
    if os.environ.get("DOS_LIGHTNING_STREAM_SAVE", "1") == "0":
        return
    for source in _CLOUD_IO:
        original = getattr(sys.modules.get(source), "_atomic_save", None)
        if not callable(original) or getattr(original, "_dos_streamed", False):
            continue
        streamed = _streamed(original)
        for name, module in list(sys.modules.items()):
            try:
                if name.startswith(_PACKAGES) and getattr(module, "_atomic_save", None) is original:
                    setattr(module, "_atomic_save", streamed)
            except Exception:  # a lazy module that fails on access: not Lightning's IO
                continue


def _streamed(original):
    @functools.wraps(original)
    def save(checkpoint, filepath, *args, **kwargs):
        path = _local_path(filepath)
        if path is None or args or kwargs:
            return original(checkpoint, filepath, *args, **kwargs)
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        # Owner-only, as fsspec's transaction (Lightning's) makes its file: a
        # checkpoint holds the weights and the optimizer state.
        tmp = os.path.join(folder, f".{os.path.basename(path)[:200]}.{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    save._dos_streamed = True
    return save


def _inline(original):
    @functools.wraps(original)
    def save_checkpoint(self, *args, **kwargs):
        checkpoint = kwargs["checkpoint"] if "checkpoint" in kwargs else (args[0] if args else None)
        inner = getattr(self, "checkpoint_io", None)
        if inner is None or not _holds_views(checkpoint):
            return original(self, *args, **kwargs)
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.submit(lambda: None).result()  # the saves queued before it, in order
        if getattr(self, "_error", None) is not None:
            raise self._error
        inner.save_checkpoint(*args, **kwargs)
    save_checkpoint._dos_inline = True
    return save_checkpoint


def _holds_views(obj) -> bool:
    """Whether `obj` (a checkpoint: dicts, lists, tuples) holds a tensor
    over dosd's memory."""
    return bool(_views.tensors_over_dosd(obj))


def _local_path(filepath):
    """`filepath` as a local path, or None for a URL (s3://, gs://, ...)."""
    try:
        path = os.fspath(filepath)
    except TypeError:
        return None
    if not isinstance(path, str):
        return None
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if "://" in path else path
