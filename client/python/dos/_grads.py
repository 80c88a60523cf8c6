"""Gradients and the registered buffers dosd reads them from.

Every registered parameter's gradient must be in its registered buffer
(`Entry.grad_shm`) when dosd reads it. Autograd accumulates straight into it
while `p.grad` is that buffer; a gradient that was replaced (set to None, a
new tensor, an FSDP2 shard) is copied in at step(). A parameter counts as
having no gradient, as torch's would be None, after zero_grad(set_to_none=
True) until backward reaches it (a hook on each parameter notes that), or
something writes its gradient in place (DDP's averaged gradient of a
parameter only other ranks used). Plain functions over entries: no state of
their own.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, List, Optional, Tuple

import torch

from dos import _native
from dos._errors import DosError
from dos._native import Status
from dos._register import Entry, is_dtensor, local_of

__all__ = ["SPARSE", "sparse_seen", "no_gradient", "zero_entry", "unusable", "bind", "take",
           "thawed", "install_seen_hooks", "install_take_hooks", "zero_unregistered", "clip_coefficient",
           "Clip", "clip_grads", "clip_shardings"]


# Entries whose backward brought a sparse gradient since their last zeroing:
# autograd added it into the registered dense buffer, where step() could not
# tell it from a dense one (install_seen_hooks notes it; bind() refuses it).
_sparse = weakref.WeakSet()


def sparse_seen(e: Entry) -> bool:
    """Whether backward brought e a sparse gradient since it was zeroed."""
    return e in _sparse


def zero_entry(e: Entry) -> None:
    """Zeroes e's registered gradient in place and binds it as p.grad."""
    _sparse.discard(e)
    e.grad_shm.zero_()
    e.zero_version = e.grad_shm._version
    if e.param.grad is not e.grad_shm:
        e.param.grad = e.grad_shm


def no_gradient(e: Entry) -> bool:
    """Whether torch would see no gradient for e this step: grad None, or
    zeroed by zero_grad(set_to_none=True), not reached by backward and not
    written since (DDP writes the averaged gradient into a parameter that
    only other ranks used: torch updates it, so must we)."""
    return e.param.grad is None or e.untouched()


def _skipped(e: Entry, bound: bool) -> None:
    """e has no gradient: dosd skips it, as torch does. The buffer dosd
    still reads must hold finite values (zeros)."""
    if e.index >= _native.MAX_SKIP_TENSORS:
        raise DosError(
            Status.FAILED_PRECONDITION,
            f"step: {e.name} has no gradient (grad is None or backward did "
            f"not reach it since zero_grad(set_to_none=True)), and dosd can "
            f"skip only the first {_native.MAX_SKIP_TENSORS} registered "
            "parameters; give it a zero gradient (zero_grad(set_to_none=False)) "
            "or register it among the first (a group of its own first)")
    if not bound:
        e.grad_shm.zero_()


SPARSE = ("has a sparse gradient (nn.Embedding or EmbeddingBag with sparse=True?); "
          "dos.torch.AdamW, like torch.optim.AdamW, does not support sparse gradients: "
          "build that module with sparse=False")


def rehome(e: Entry) -> None:
    """`p.grad.data = x` moved the registered gradient tensor itself (p.grad
    is e.grad_shm) to x's memory, which dosd never reads: it points at the
    registered memory again with x's values in it (they once stayed out,
    and every later step read the gradient of the step before the move)."""
    home = e.grad_home
    if home is None or e.grad_shm is None or e.grad_shm.data_ptr() == home.data_ptr():
        return
    if e.param_shm is not None and local_of(e.param).data_ptr() != e.param_shm.data_ptr():
        return  # the parameter moved too (model.to(dtype), .cuda()): step() re-registers both
    g = e.grad_shm.data
    with torch.no_grad():
        e.grad_shm.data = home
        why = unusable(e, local_of(g))
        if why:
            raise DosError(Status.INVALID_ARGUMENT, f"step: {why}")
        e.grad_shm.copy_(g)


def unusable(e: Entry, g: torch.Tensor) -> Optional[str]:
    """Why gradient `g` (local) cannot be copied into e's registered buffer,
    or None: another dtype or shape, or sparse."""
    if g.dtype != e.grad_shm.dtype or g.shape != e.grad_shm.shape:
        return (f"{e.name} is {e.param.dtype} {tuple(e.grad_shm.shape)} but its grad is "
                f"{g.dtype} {tuple(g.shape)}; gradients must have the parameter's dtype and "
                "shape")
    if g.is_sparse:
        return f"{e.name} {SPARSE}"
    return None


def bind(entries: List[Entry]) -> List[int]:
    """Brings every gradient into its registered buffer; returns the
    indices of the tensors without a gradient (skipped by this step)."""
    skip = []
    with torch.no_grad():
        for e in entries:
            if e in _sparse:
                raise DosError(Status.INVALID_ARGUMENT, f"step: {e.name} {SPARSE}")
            rehome(e)
            p = e.param
            g = p.grad
            bound = g is not None and not local_of(g).is_sparse and \
                local_of(g).data_ptr() == e.grad_shm.data_ptr()
            if no_gradient(e):
                _skipped(e, bound)
                skip.append(e.index)
                continue
            e.grad_none = False
            g = local_of(g)
            why = unusable(e, g)  # first: a sparse tensor has no data pointer
            if why:
                raise DosError(Status.INVALID_ARGUMENT, f"step: {why}")
            if g.data_ptr() == e.grad_shm.data_ptr():
                continue
            e.grad_shm.copy_(g)
            if not e.copy_grad:
                p.grad = e.grad_shm
    return skip


def take(e: Entry) -> bool:
    """A gradient autograd made anew (p.grad was None: a model's
    zero_grad(), a framework's `p.grad = None`) goes into e's registered
    buffer and p.grad becomes that buffer again. False, and nothing done,
    for a gradient that cannot go there (`unusable`; bind() at step() raises
    naming it)."""
    rehome(e)
    g = e.param.grad
    if g is None or e.copy_grad:
        return True
    if unusable(e, g):  # first: a sparse tensor has no data pointer
        return False
    if g.data_ptr() == e.grad_shm.data_ptr():
        return True
    with torch.no_grad():
        e.grad_shm.copy_(g)
        e.param.grad = e.grad_shm
    return True


def install_take_hooks(entries: List[Entry], before: Callable[[], None]) -> list:
    """A post-accumulate-grad hook on each registered parameter (torch >=
    2.1; none before) takes a gradient autograd made anew into the registered
    buffer as soon as backward finished it: the new tensor goes back to the
    allocator at once, so backward never holds a second copy of the
    gradients (13.5 GB for a 7B bf16 model, which the GPU lease would lose)
    and step() copies nothing. `before()` runs first, once a gradient is to
    be taken: it collects a step still in flight from before this backward
    (one that may read the buffer). The hooks hold their entry weakly."""
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        return []
    handles = []
    for e in entries:
        if e.copy_grad:
            continue

        def hook(param, ref=weakref.ref(e)):
            entry = ref()
            if entry is not None:
                rehome(entry)
            g = param.grad
            if entry is None or g is None or (not g.is_sparse and
                                              g.data_ptr() == entry.grad_shm.data_ptr()):
                return
            before()
            take(entry)
        handles.append(e.param.register_post_accumulate_grad_hook(hook))
    return handles


def thawed(param_groups, entries: List[Entry]) -> List[torch.Tensor]:
    """Parameters frozen at construction (not registered) that now
    require grad and have a gradient: torch would update them."""
    registered = {id(e.param) for e in entries}
    return [p for g in param_groups for p in g["params"]
            if p.requires_grad and p.grad is not None and id(p) not in registered
            and local_of(p).numel() > 0]


def install_seen_hooks(entries: List[Entry]) -> list:
    """A gradient hook on each registered parameter notes that backward
    reached it (its gradient is not None in torch's terms), so that step()
    skips only the parameters torch would skip, and whether it was sparse
    (step() refuses it as torch's AdamW does: autograd adds it into the
    registered dense buffer, where it would pass for a dense one). The hooks
    hold their entry weakly (the entry holds the parameter, which holds the
    hooks)."""
    handles = []
    for e in entries:
        def seen(grad, ref=weakref.ref(e)):
            entry = ref()
            if entry is None:
                return
            if grad.layout != torch.strided:
                _sparse.add(entry)
            entry.grad_none = False
        handles.append(e.param.register_hook(seen))
    return handles


def zero_unregistered(param_groups, entries: List[Entry], set_to_none: bool) -> None:
    """zero_grad() for parameters dosd does not read the gradient of
    (frozen ones, DTensors whose gradient is FSDP's), as torch does."""
    registered = {id(e.param) for e in entries if not e.copy_grad}
    for group in param_groups:
        for p in group["params"]:
            if id(p) in registered or p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()


def _present_grads(param_groups):
    """Every parameter's gradient that is not None, in param_groups' order."""
    return [p.grad for g in param_groups for p in g["params"] if p.grad is not None]


def clip_grads(param_groups) -> List[torch.Tensor]:
    """The gradients clip_grad_norm_ covers: every parameter's that has one
    (a DTensor's local shard)."""
    return [local_of(t) for t in _present_grads(param_groups)]


def clip_shardings(param_groups) -> List[Optional[tuple]]:
    """For each of clip_grads' gradients, None, or for a DTensor gradient
    (FSDP2) the process groups of the mesh dimensions it is not replicated on:
    those over which the other ranks' shards add to its norm."""
    out = []
    for t in _present_grads(param_groups):
        if not is_dtensor(t):
            out.append(None)
            continue
        out.append(tuple(t.device_mesh.get_group(i) for i, pl in enumerate(t.placements)
                         if not getattr(pl, "is_replicate", lambda: False)()))
    return out


def _sharded_total(norms: List[torch.Tensor], shardings: List[Optional[tuple]],
                   norm_type: float) -> torch.Tensor:
    """The total norm over every rank's shards of each DTensor gradient and
    this rank's other gradients (whole on every rank, as DDP's), from this
    rank's per-tensor norms: the shards' p-th powers summed (their maximum for
    inf, minimum for -inf, their counts for 0) over the process groups of the
    dimensions each is sharded on, as torch's clip_grad_norm_ reduces a
    DTensor total norm (full_tensor())."""
    import torch.distributed as dist
    if norm_type == math.inf:
        op, combine, powered = dist.ReduceOp.MAX, torch.max, False
    elif norm_type == -math.inf:
        op, combine, powered = dist.ReduceOp.MIN, torch.min, False
    else:
        op, combine, powered = dist.ReduceOp.SUM, torch.sum, norm_type != 0
    dev = norms[0].device
    parts, groups = [], {}
    for n, spec in zip(norms, shardings):
        v = (n ** norm_type if powered else n).reshape(1)
        if spec is None:
            parts.append(v.to(dev))
        else:
            groups.setdefault(spec, []).append(v)
    for pgs, vs in groups.items():
        part = combine(torch.cat(vs)).reshape(1)
        for pg in pgs:
            dist.all_reduce(part, op=op, group=pg)
        parts.append(part.to(dev))
    total = combine(torch.cat(parts))
    return total ** (1.0 / norm_type) if powered else total


def _versions(grads: List[torch.Tensor]) -> Tuple[Tuple[int, int], ...]:
    return tuple((g.data_ptr(), g._version) for g in grads)


class Clip:
    """What clip_grad_norm_ leaves for the next step(): the coefficient, and
    whether its norm proved every gradient finite. A finite norm of order > 0
    (a NaN or inf anywhere makes it NaN or inf; order 0 counts non-zeros) over
    the gradients that step() finds unchanged (the same tensors, none written
    in place since: torch's version counters) lets dosd skip its own scan for
    non-finite gradients (kStepGradientsChecked), a pass over every gradient
    on the step's critical path. A gradient written behind autograd's back
    (through .data or a raw pointer) after the clip is not seen: dosd then
    applies it as torch's AdamW would."""

    def __init__(self, coef: float, grads: List[torch.Tensor], finite: bool):
        self.coef = coef
        self._versions = _versions(grads) if finite else None

    def checked(self, param_groups) -> bool:
        """Whether the gradients are those whose norm was finite."""
        return self._versions is not None and _versions(clip_grads(param_groups)) == self._versions


def clip_coefficient(grads: List[torch.Tensor], max_norm: float, norm_type: float,
                     error_if_nonfinite: bool,
                     shardings: Optional[List[Optional[tuple]]] = None
                     ) -> Tuple[torch.Tensor, Clip]:
    """(total norm, Clip) of torch.nn.utils.clip_grad_norm_ over `grads`,
    without touching them: the coefficient min(1, max_norm / (norm + 1e-6))
    goes to dosd with the next step. Reads the norm on the host. With
    `shardings` (clip_shardings) naming a DTensor's shard, the norm covers
    every rank's shards (one collective per mesh group, on every rank)."""
    norm_type = float(norm_type)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    dev = norms[0].device
    if shardings and any(s is not None for s in shardings):
        total = _sharded_total(norms, shardings, norm_type)
    else:
        total = torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), norm_type)
    value = float(total)
    if error_if_nonfinite and not math.isfinite(value):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    # torch's clip_coef_clamped, in fp32. A non-finite norm is not clipped:
    # dosd's non-finite scan skips such a step (torch would apply NaN updates).
    coef = torch.clamp(torch.tensor(float(max_norm), dtype=torch.float32) /
                       (torch.tensor(value, dtype=torch.float32) + 1e-6), max=1.0)
    finite = math.isfinite(value)
    return total, Clip(float(coef) if finite else 1.0, grads, finite and norm_type > 0)
