"""The framework functions dos.torch wraps, installed together: when an
optimizer is built and again at each state_dict() (a framework imported
after the optimizer was built). Each install is idempotent and imports
nothing the process has not imported itself.

- torch.load maps a resumed optimizer.pt (dos/_mmapload.py);
- Lightning's saves stream the state, whole steps (dos/_lightning.py);
- torch.distributed.checkpoint's load writes no copy of the state into the
  trainer's memory (dos/_dcp.py).
"""

from dos import _dcp, _lightning, _mmapload

__all__ = ["install"]


def install() -> None:
    _mmapload.install()
    _lightning.install()
    _dcp.install()
