"""Hooks on the model for steps that overlap the next forward (`model=`):
per-layer waits (forward pre-hooks and gradient hooks), the module
state_dict() and load_state_dict() hooks that finish a step in flight before
anyone reads or overwrites the weights, a DataParallel guard, and deferred
zero_grad.

`LayerHooks` is one part of dos.torch's optimizer, owned by the LayerDriver
(dos/_drivers.py). It reads the flight's state and the registration's
subgroup ranges, waits through the flight, and owns its hook handles and the
set of entries whose zero_grad is deferred. Every hook holds its target
weakly: hooks live on the model and its parameters, and a strong reference
back would put the optimizer in reference cycles with them, so that only the
cyclic collector (at interpreter exit: after torch's module is torn down)
could finalize it. Dropping the optimizer closes it.
"""

from __future__ import annotations

import weakref
from typing import Callable, List

import torch

from dos import _grads

__all__ = ["LayerHooks", "weak_hook", "spans"]


def weak_hook(target, fn):
    """A hook that calls fn(target, *args) while `target` is alive."""
    ref = weakref.ref(target)

    def hook(*args, **kwargs):
        obj = ref()
        if obj is not None:
            return fn(obj, *args, **kwargs)
    return hook


def spans(ranges, ents):
    """The subgroup ranges `ents` occupy, overlapping and adjacent ones
    merged. Not one range from the lowest to the highest: a module's
    parameters often sit far apart (a Linear's weight in the weight-decay
    group, its bias in the no-decay group registered after every layer's
    weights), and one range would make the module wait for every subgroup
    between them, i.e. most of the step (measured at 6B on nvidia-h200:
    the next forward then overlapped nothing of the update)."""
    out = []
    for first, last in sorted(ranges[e.index] for e in ents):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def reader_hooks(module, finish):
    """module.state_dict() and module.load_state_dict() call `finish` first:
    every framework saves weights through state_dict() (Trainer, Accelerate,
    Lightning, torch.save(model.state_dict())), and a load must not be
    overwritten by the daemon's late writes. Installed on each module that
    owns registered parameters, so a state_dict() of any enclosing module
    (DDP, a wrapper, a submodule) passes one."""
    def call(*_args, **_kwargs):
        finish()
    if hasattr(module, "register_state_dict_pre_hook"):  # torch >= 2.0
        on_save = module.register_state_dict_pre_hook(call)
    else:
        # torch 1.13 has only the post-hook: state_dict() holds detached
        # aliases of the parameters, so finishing before it returns is
        # as good.
        on_save = module._register_state_dict_hook(call)
    if hasattr(module, "register_load_state_dict_pre_hook"):
        on_load = module.register_load_state_dict_pre_hook(call)
    else:
        on_load = module._register_load_state_dict_pre_hook(call)
    return [on_save, on_load]


def replicate_wait(finish):
    """torch.nn.DataParallel (which the Hugging Face Trainer uses on its
    own when a process sees several GPUs) copies every parameter to the
    other devices before any layer's pre-hook runs: a global forward
    pre-hook finishes the step in flight before a DataParallel forward,
    so the replicas never get half-updated weights."""
    def before_replicate(module, _inputs):
        if isinstance(module, torch.nn.DataParallel):
            finish()
    return torch.nn.modules.module.register_module_forward_pre_hook(before_replicate)


class LayerHooks:
    def __init__(self, reg, flight, stream: Callable[[], object], model,
                 finish: Callable[[], None]):
        """`stream()`: where the waits are queued (None: on the host);
        `finish`: collects the step in flight (a weak call: see above)."""
        self._reg = reg
        self._flight = flight
        self._stream = stream
        self._pending_zero = set()  # entry indices whose zero_grad is deferred
        self._handles: List = []
        self._install(model, finish)

    def _install(self, model, finish):
        """Forward pre-hooks: each module with registered parameters of its
        own waits for just their subgroups before it runs. Gradients are
        guarded too: a parameter's pre-accumulation hook waits for its
        subgroups (and applies a deferred zero_grad) if no forward did."""
        entries = self._reg.entries
        ranges = self._reg.ranges
        by_param = {id(e.param): e for e in entries}
        for module in model.modules():
            ents = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
            if not ents:
                continue
            sp = spans(ranges, ents)

            def pre_hook(hooks, _module, _inputs, ents=ents, sp=sp):
                hooks.wait_layer(ents, sp)
            self._handles.append(module.register_forward_pre_hook(weak_hook(self, pre_hook)))
            self._handles += reader_hooks(module, finish)
        self._handles.append(replicate_wait(finish))
        for e in entries:
            def grad_hook(hooks, _grad, e=weakref.ref(e), r=ranges[e.index]):
                if e() is not None:
                    hooks.wait_layer([e()], [r])
            self._handles.append(e.param.register_hook(weak_hook(self, grad_hook)))

    def wait_layer(self, ents, sp) -> None:
        if self._reg.ptr is None:
            return
        # An early step (begun by the overlap hooks) is this backward's own:
        # nothing to wait for (its weights change only once its gradients are
        # final).
        indices = [e.index for e in ents]
        if self._flight.needs_wait(indices):
            stream = self._stream()
            for first, last in sp:
                self._flight.wait_subgroups(first, last, stream)
            self._flight.waited(indices)
        if self._pending_zero:  # zero_grad() came after this layer's wait, or had no forward
            self.zero_pending(ents)

    def defer_zero(self, entries) -> None:
        """zero_grad() while the step is in flight: each entry is zeroed at
        its layer's wait (the daemon still reads the gradients of layers it
        has not reached)."""
        self._pending_zero.update(e.index for e in entries)

    def zero_pending(self, entries) -> None:
        """Applies a deferred zero_grad to `entries` (their new weights were
        waited for, so the daemon is done with their gradients)."""
        if not self._pending_zero:
            return
        with torch.no_grad():
            for e in entries:
                if e.index in self._pending_zero:
                    self._pending_zero.discard(e.index)
                    _grads.zero_entry(e)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
