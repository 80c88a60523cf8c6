"""torch.load of a large optimizer file maps the file instead of reading it.

The Hugging Face Trainer resumes with `torch.load(<checkpoint>/optimizer.pt)`,
Accelerate's `load_state` with `torch.load(<folder>/optimizer.bin)` (and
`optimizer_<i>.bin`), and each hands the result to the optimizer's
load_state_dict(). Read whole, that file is the optimizer state in the
trainer's private memory, 12 bytes a parameter (81 GB at 7B), beside dosd's
own copy of it: on a node sized for one copy the kernel's OOM killer ends
the run. Mapped (torch >= 2.1's `mmap=True`), its pages come from the page
cache as load_state_dict() streams them into dosd and can be dropped again,
so resuming needs no more private memory than training.

`install()` (called when a DOS optimizer is built) wraps `torch.load` once so
that such a call maps the file, and only such a call: an argument that is a
path (not a file object), whose name is an optimizer file's as those
frameworks write it, of at least _MIN_BYTES, in torch's zip format, with no
`mmap=` given and torch's own default (`torch.utils.serialization.config
.load.mmap`) not set. Everything else goes to torch.load untouched. The
tensors of a mapped load are copy-on-write (MAP_PRIVATE): writing to them
never writes the file. DOS_TORCH_LOAD_MMAP=0 switches this off; torch < 2.1
has no mmap and is left alone. With several ranks the HF Trainer loads onto
each rank's GPU (map_location=args.device): mapping then spares the host only.
"""

from __future__ import annotations

import functools
import inspect
import os
import re

import torch

__all__ = ["install", "maps"]

_NAME = re.compile(r"optimizer(_\d+)?\.(pt|bin)")
_MIN_BYTES = 256 << 20
_ZIP_MAGIC = b"PK\x03\x04"


def maps(f) -> bool:
    """Whether a torch.load of `f` (no mmap= given) should map it."""
    if not isinstance(f, (str, os.PathLike)):
        return False
    try:
        path = os.fspath(f)
        if not isinstance(path, str) or not _NAME.fullmatch(os.path.basename(path)):
            return False
        if os.path.getsize(path) < _MIN_BYTES:
            return False
        with open(path, "rb") as fh:
            return fh.read(4) == _ZIP_MAGIC
    except (OSError, TypeError, ValueError):
        return False  # torch.load reports what is wrong with it


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
        if "mmap" not in kwargs and not (config is not None and config.load.mmap) and maps(f):
            kwargs["mmap"] = True
        return original(f, *args, **kwargs)

    load._dos_mmap_wrapped = True
    torch.load = load
