"""One registered parameter (`Entry`): the memory dosd uses for it and what
the client tracks about its gradient and its weights between steps; and how
a parameter's local tensor is found (a DTensor's shard). Thread-safety: none.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["Entry", "is_dtensor", "local_of"]


class Entry:
    """One registered parameter: its shared-memory param and grad views."""

    # param_shm / grad_shm: the registered memory (shared memory in CPU mode,
    # the parameter's own CUDA storage and its gradient in GPU mode).
    # local: the tensor the model computes with (p.data, or a DTensor's local
    # shard); copy_out: the registered param is a separate buffer whose new
    # values are copied into `local` after each step (DTensor on the CPU);
    # copy_grad: the gradient is copied into grad_shm at step() (DTensor);
    # grad_home: grad_shm's memory, never handed out (p.grad.data = x moves p.grad).
    # grad_none: the parameter counts as having no gradient (torch's grad
    # would be None): set by zero_grad(set_to_none=True), cleared when
    # backward reaches it; step() skips it unless something else wrote its
    # gradient since (zero_version: grad_shm's version counter when zeroed;
    # DDP writes the averaged gradient of a parameter this rank did not use).
    __slots__ = ("param", "name", "index", "group", "param_shm", "grad_shm", "grad_home",
                 "local", "copy_out", "copy_grad", "grad_none", "zero_version", "ready_version",
                 "seen_version", "__weakref__")

    def __init__(self, param, name, index, group):
        self.param = param
        self.name = name
        self.index = index  # registration order, the daemon's tensor index
        self.group = group  # daemon group index
        self.param_shm = None
        self.grad_shm = self.grad_home = None
        self.local = None
        self.copy_out = False
        self.copy_grad = False
        self.grad_none = param.grad is None or _untouched_elsewhere(param)
        self.zero_version = -1
        _entry_of_param[id(param)] = self
        # grad_shm's version when its subgroup was last marked ready (an
        # early step: dos/_early.py); -1: not since registration.
        self.ready_version = -1
        self.seen_version = -1  # the parameter's version when dosd last held its values

    def see(self) -> None:
        """dosd's master holds the parameter as it is now (registered,
        written from the master, or found equal to it)."""
        self.seen_version = self.param._version

    def written(self) -> bool:
        """Written in place since see() (DDP's broadcast, load_state_dict(),
        torch.nn.init, p.clamp_() under no_grad; not through .data). A
        DTensor's shard is FSDP's to write: not watched."""
        return not self.copy_grad and self.param._version != self.seen_version

    def untouched(self) -> bool:
        """p.grad is this entry's gradient buffer as zeroed for torch's None
        (grad_none), written since by nothing (backward, DDP, the trainer)."""
        g = self.param.grad
        if not self.grad_none or g is None or self.grad_shm is None:
            return False
        g = local_of(g)
        return (not g.is_sparse and g.data_ptr() == self.grad_shm.data_ptr()
                and g._version == self.zero_version)


# Each parameter's latest Entry (weakly): an optimizer built over a model
# another one still holds (a notebook cell run again) sees that one's zeroed,
# untouched gradient buffer as torch's None, not as a zero gradient.
# By id(param): the Entry holds its parameter, so the id is that parameter's.
_entry_of_param: "weakref.WeakValueDictionary[int, Entry]" = weakref.WeakValueDictionary()


def _untouched_elsewhere(param) -> bool:
    e = _entry_of_param.get(id(param))
    return e is not None and e.param is param and e.untouched()


def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local_of(t):
    """A DTensor's local shard (sharing its storage), else the tensor's data."""
    if t is None:
        return None
    if is_dtensor(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()
    return t.data if isinstance(t, torch.nn.Parameter) else t
