"""torch.load of a large optimizer file maps the file instead of reading it.

The Hugging Face Trainer resumes with `torch.load(<checkpoint>/optimizer.pt)`,
Accelerate's `load_state` with `torch.load(<folder>/optimizer.bin)` (and
`optimizer_<i>.bin`), Lightning's `fit(ckpt_path=...)` with torch.load of the
`.ckpt` file opened through fsspec (a file object), and each hands the
optimizer's part to its load_state_dict(). Read whole, that file is the optimizer state in the
trainer's private memory, 12 bytes a parameter (81 GB at 7B), beside dosd's
own copy of it: on a node sized for one copy the kernel's OOM killer ends
the run. Mapped (torch >= 2.1's `mmap=True`), its pages come from the page
cache as load_state_dict() streams them into dosd and can be dropped again,
so resuming needs no more private memory than training.

`install()` (called when a DOS optimizer is built) wraps `torch.load` once so
that such a call maps the file, and only such a call: an argument that is a
path, or a local file's object at its start (then mapped by its path), whose
name is an optimizer file's or a Lightning checkpoint's as those frameworks
write it, of at least _MIN_BYTES, in torch's zip format, with no
`mmap=` given and torch's own default (`torch.utils.serialization.config
.load.mmap`) not set. Everything else goes to torch.load untouched. The
tensors of a mapped load are copy-on-write (MAP_PRIVATE): writing to them
never writes the file. DOS_TORCH_LOAD_MMAP=0 switches this off; torch < 2.1
has no mmap and is left alone.

With several ranks the HF Trainer loads onto each rank's GPU
(map_location=args.device): the whole state, 81 GB at 7B, on a device where
dosd's state never lives. A mapped optimizer file (not a Lightning
checkpoint, which holds more than the optimizer's state) loads onto the host instead
(map_location="cpu"): load_state_dict() streams the state into dosd from
there, and torch's own optimizers move their state to each parameter's device
themselves.
"""

from __future__ import annotations

import functools
import inspect
import os
import re

import torch

__all__ = ["install", "maps"]

_OPTIMIZER_FILE = re.compile(r"optimizer(_\d+)?\.(pt|bin)")
_NAME = re.compile(_OPTIMIZER_FILE.pattern + r"|.+\.ckpt")
_MIN_BYTES = 256 << 20
_ZIP_MAGIC = b"PK\x03\x04"


def maps(f) -> bool:
    """Whether a torch.load of `f` (no mmap= given) should map it."""
    return _mapped_path(f) is not None


def _mapped_path(f):
    """The path to map for a torch.load of `f`, or None (see the docstring)."""
    try:
        if isinstance(f, (str, os.PathLike)):
            path = os.fspath(f)
        else:
            path = _file_object_path(f)
        if not isinstance(path, str) or not _NAME.fullmatch(os.path.basename(path)):
            return None
        if os.path.getsize(path) < _MIN_BYTES:
            return None
        with open(path, "rb") as fh:
            return path if fh.read(4) == _ZIP_MAGIC else None
    except Exception:  # best effort: torch.load reports what is wrong with it
        return None


def _file_object_path(f):
    """A file object's path, where it is a local file's (its descriptor the
    file at that path) read from its start; else None."""
    path = getattr(f, "name", None)
    if not isinstance(path, str) or not _NAME.fullmatch(os.path.basename(path)):
        return None
    if f.tell() != 0:
        return None
    st, at = os.fstat(f.fileno()), os.stat(path)
    return path if (st.st_dev, st.st_ino) == (at.st_dev, at.st_ino) else None


def install() -> None:
    """Wraps torch.load once (see the module's docstring)."""
    if getattr(torch.load, "_dos_mmap_wrapped", False):
        return
    if os.environ.get("DOS_TORCH_LOAD_MMAP", "1") == "0":
        return
    original = torch.load
    try:
        if "mmap" not in inspect.signature(original).parameters:
            return  # torch < 2.1
    except (TypeError, ValueError):
        return
    try:
        from torch.utils.serialization import config  # torch >= 2.5: torch's own default
    except ImportError:
        config = None

    @functools.wraps(original)
    def load(f, *args, **kwargs):
        if "mmap" not in kwargs and not (config is not None and config.load.mmap):
            path = _mapped_path(f)
            if path is not None:
                f, kwargs["mmap"] = path, True  # a file object's path: torch maps paths
                if _OPTIMIZER_FILE.fullmatch(os.path.basename(path)):
                    args, kwargs = _on_host(args, kwargs)  # all of it goes to the optimizer
                else:
                    return _unpinned(original(f, *args, **kwargs))
        return original(f, *args, **kwargs)

    load._dos_mmap_wrapped = True
    torch.load = load


_SMALL = 1 << 20


def _unpinned(obj, depth: int = 0):
    """A mapped checkpoint's tensors under 1 MiB cloned: each mapped tensor
    keeps the whole file mapped, and Lightning's callbacks keep small ones
    (ModelCheckpoint's best score) for the run; the large ones go to
    load_state_dict() and are let go with the checkpoint."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.numel() * obj.element_size() < _SMALL else obj
    if depth < 16 and isinstance(obj, dict):
        for k in list(obj):
            obj[k] = _unpinned(obj[k], depth + 1)
    elif depth < 16 and isinstance(obj, list):
        obj[:] = [_unpinned(v, depth + 1) for v in obj]
    elif depth < 16 and type(obj) is tuple:
        return tuple(_unpinned(v, depth + 1) for v in obj)
    return obj


def _on_host(args, kwargs):
    """torch.load's map_location (its first argument after the file), a
    CUDA device named by a string or torch.device, made "cpu"."""
    loc = args[0] if args else kwargs.get("map_location")
    try:
        cuda = isinstance(loc, (str, torch.device)) and torch.device(loc).type == "cuda"
    except (RuntimeError, TypeError, ValueError):
        cuda = False  # torch.load reports what is wrong with it
    if not cuda:
        return args, kwargs
    if args:
        return ("cpu",) + tuple(args[1:]), kwargs
    return args, dict(kwargs, map_location="cpu")
