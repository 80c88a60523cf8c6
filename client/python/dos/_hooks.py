"""Hooks on the model: per-layer waits for an asynchronous step (forward
pre-hooks and gradient hooks, `model=`), the module state_dict() and
load_state_dict() hooks that finish a step in flight before anyone reads or
overwrites the weights, deferred zero_grad, and the overlap hooks that begin a
step when the last gradient is final (`overlap=True`).

`_HooksMixin` is one part of dos.torch's optimizer class. It owns `_async`,
`_stream_sync`, `_ranges`, `_num_subgroups`, `_layer_waits` (forward and
state-dict hook handles), `_grad_hooks`, `_pending_zero`, `_ready`,
`ready_log`, `_sync_stream` and each entry's `hook`.
"""

from __future__ import annotations

import ctypes
import time
import weakref

import torch

from dos import _native
from dos._errors import DosError, call
from dos._native import Status
from dos._step import StepState

__all__ = []


class _HooksMixin:
    def _setup_async(self, model, async_step):
        if not self._entries:
            return
        dtensor = any(e.copy_grad or e.copy_out for e in self._entries)
        if self._device is not None and not dtensor:
            self._stream_sync = bool(_native.lib.dos_stream_sync_supported(self._session))
        first, last = ctypes.c_uint32(), ctypes.c_uint32()
        self._ranges = []
        for e in self._entries:
            call("dos_tensor_subgroups", self._session, ctypes.c_uint32(e.index),
                         ctypes.byref(first), ctypes.byref(last))
            self._ranges.append((int(first.value), int(last.value)))
        self._num_subgroups = max(r[1] for r in self._ranges) + 1
        possible = (self._stream_sync or model is not None) and not dtensor
        if async_step is None:
            # By default steps overlap the next forward only on CUDA, where the
            # trainer's stream orders every later reader (whole-step stream
            # wait), or model='s hooks and torch.cuda.synchronize() do. On the
            # CPU path step() returns after the update: a read of the shared
            # memory that passes through no hook (p.cpu(), parameters(),
            # torch.save of a parameter) could not be made to wait.
            async_step = possible and self._device is not None
        elif async_step and not possible:
            why = ("FSDP2/DTensor parameters are copied at step()" if dtensor else
                   "without model= nothing would order the next forward after the step on "
                   "this session (shared-memory tensors, or no CUDA stream memory operations)")
            raise DosError(Status.INVALID_ARGUMENT, f"async_step=True is not possible here: {why}")
        self._async = bool(async_step)
        if model is not None and self._async:
            self._install_layer_waits(model)

    def _install_layer_waits(self, model):
        """Forward pre-hooks: each module with registered parameters of its
        own waits for just their subgroups before it runs, so the next forward
        starts while later layers are still being updated. Gradients are
        guarded too: a parameter's pre-accumulation hook waits for its
        subgroups (and applies a deferred zero_grad) if no forward did."""
        by_param = {id(e.param): e for e in self._entries}
        for module in model.modules():
            ents = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
            if not ents:
                continue
            spans = self._spans(ents)

            def pre_hook(opt, _module, _inputs, ents=ents, spans=spans):
                opt._wait_layer(ents, spans)
            self._layer_waits.append(module.register_forward_pre_hook(self._weak(pre_hook)))
            self._layer_waits += self._install_reader_hooks(module)
        self._layer_waits.append(self._install_replicate_wait())
        for e in self._entries:
            def grad_hook(opt, _grad, i=e.index):
                opt._wait_layer([opt._entries[i]], [opt._ranges[i]])
            self._grad_hooks.append(e.param.register_hook(self._weak(grad_hook)))

    def _install_seen_hooks(self):
        """A gradient hook on each registered parameter notes that backward
        reached it (its gradient is not None in torch's terms), so that
        step() skips only the parameters torch would skip."""
        for e in self._entries:
            def seen(opt, _grad, i=e.index):
                opt._entries[i].grad_none = False
            self._seen_hooks.append(e.param.register_hook(self._weak(seen)))

    def _install_replicate_wait(self):
        """torch.nn.DataParallel (which the Hugging Face Trainer uses on its
        own when a process sees several GPUs) copies every parameter to the
        other devices before any layer's pre-hook runs: a global forward
        pre-hook finishes the step in flight before a DataParallel forward,
        so the replicas never get half-updated weights."""
        def before_replicate(opt, module, _inputs):
            if isinstance(module, torch.nn.DataParallel):
                opt._finish_inflight()
        return torch.nn.modules.module.register_module_forward_pre_hook(
            self._weak(before_replicate))

    def _weak(self, fn):
        """A hook that calls fn(optimizer, *args) through a weak reference:
        hooks live on the model and its parameters, and a strong reference
        back would put the optimizer in reference cycles with them, so that
        only the cyclic collector (at interpreter exit: after torch's module
        is torn down) could finalize it. Dropping the optimizer closes it."""
        ref = weakref.ref(self)

        def hook(*args, **kwargs):
            opt = ref()
            if opt is not None:
                return fn(opt, *args, **kwargs)
        return hook

    def _install_reader_hooks(self, module):
        """module.state_dict() and module.load_state_dict() finish the step in
        flight first: every framework saves weights through state_dict()
        (Trainer, Accelerate, Lightning, torch.save(model.state_dict())), and
        a load must not be overwritten by the daemon's late writes. Installed
        on each module that owns registered parameters, so a state_dict() of
        any enclosing module (DDP, a wrapper, a submodule) passes one."""
        finish = self._weak(lambda opt, *_args, **_kwargs: opt._finish_inflight())
        if hasattr(module, "register_state_dict_pre_hook"):  # torch >= 2.0
            on_save = module.register_state_dict_pre_hook(finish)
        else:
            # torch 1.13 has only the post-hook: state_dict() holds detached
            # aliases of the parameters, so finishing before it returns is
            # as good.
            on_save = module._register_state_dict_hook(finish)
        if hasattr(module, "register_load_state_dict_pre_hook"):
            on_load = module.register_load_state_dict_pre_hook(finish)
        else:
            on_load = module._register_load_state_dict_pre_hook(finish)
        return [on_save, on_load]

    def _spans(self, ents):
        """The subgroup ranges `ents` occupy, overlapping and adjacent ones
        merged. Not one range from the lowest to the highest: a module's
        parameters often sit far apart (a Linear's weight in the weight-decay
        group, its bias in the no-decay group registered after every layer's
        weights), and one range would make the module wait for every subgroup
        between them, i.e. most of the step (measured at 6B on nvidia-h200:
        the next forward then overlapped nothing of the update)."""
        spans = []
        for first, last in sorted(self._ranges[e.index] for e in ents):
            if spans and first <= spans[-1][1] + 1:
                spans[-1] = (spans[-1][0], max(spans[-1][1], last))
            else:
                spans.append((first, last))
        return spans

    def _wait_layer(self, ents, spans):
        if self._session is None:
            return
        # An early step (hook_begun) is this backward's own: nothing to wait
        # for (its weights change only once its gradients are final).
        if self._step_state.state is StepState.IN_FLIGHT and not all(e.index in self._step_state.waited for e in ents):
            stream = self._stream() if self._stream_sync else None
            for first, last in spans:
                call("dos_wait_subgroups", self._session, ctypes.c_uint32(first),
                     ctypes.c_uint32(last), stream, ctypes.c_int64(-1))
            self._step_state.waited.update(e.index for e in ents)
        if self._pending_zero:  # zero_grad() came after this layer's wait, or had no forward
            self._zero_pending(ents)

    def _zero_pending(self, entries) -> None:
        """Applies a deferred zero_grad to `entries` (their new weights were
        waited for, so the daemon is done with their gradients)."""
        with torch.no_grad():
            for e in entries:
                if e.index in self._pending_zero:
                    self._pending_zero.discard(e.index)
                    self._zero_entry(e)

    def _queue_wait_all(self, stream=None):
        """Stream-ordered session: everything queued on `stream` (default:
        the current one) from now on waits for the whole step."""
        if self._num_subgroups:
            call("dos_wait_subgroups", self._session, ctypes.c_uint32(0),
                 ctypes.c_uint32(self._num_subgroups - 1), stream or self._stream(),
                 ctypes.c_int64(-1))

    def _queue_device_wait(self):
        """With per-layer waits the current stream stays free to start the
        next forward; a stream of the optimizer's own waits for the whole
        step instead, so that torch.cuda.synchronize() (which waits for every
        stream of the device) returns only once the new weights are in."""
        stream = getattr(self, "_sync_stream", None)
        if stream is None:
            stream = self._sync_stream = torch.cuda.Stream(device=self._device)
        self._queue_wait_all(ctypes.c_void_p(stream.cuda_stream))

    def _install_hooks(self):
        for e in self._entries:
            if e.hook is not None:
                e.hook.remove()
            e.hook = e.param.register_post_accumulate_grad_hook(self._make_hook(e))

    def _make_hook(self, e):
        def hook(opt, _param, i=e.index):
            opt._on_ready(opt._entries[i])
        return self._weak(hook)

    def _early_possible(self) -> bool:
        """Whether this step can begin at the first gradient (early step):
        registered in place (no DTensor copies), stream-ordered on CUDA, and
        no parameter moved (re-registration happens at step())."""
        if any(e.copy_grad or e.copy_out for e in self._entries):
            return False
        if self._device is not None and not self._stream_sync:
            return False
        return not any(self._moved(e) for e in self._entries)

    def _on_ready(self, e):
        """Post-accumulate-grad hook: e's gradient is final for this backward.
        The first one begins an early step (dosd plans it, and with
        overlap="update" updates each subgroup as soon as it is marked ready);
        each subgroup is marked ready when all its tensors' gradients are
        final. Without early steps possible here, the step begins at step()."""
        if not self.overlap_armed or self._session is None or self._accumulating:
            return
        state = self._step_state
        if state.in_flight and not state.hook_begun:
            self._finish_inflight()  # the previous asynchronous step (already done)
        now = time.perf_counter()
        if not state.hook_begun:
            if not self._early_possible():
                return
            self._ready = set()
            self._ready_t0 = now
            self.ready_log = []
            self._early_error = None
            left = [0] * self._num_subgroups
            for first, last in self._ranges:
                for sg in range(first, last + 1):
                    left[sg] += 1
            self._ready_left = left
            with torch.no_grad():
                args, _groups = self._args(1.0, 1.0, gradients_checked=self._early_update)
                flags = _native.DOS_EARLY_NO_VERDICT if self._early_update else 0
                call("dos_step_begin_early", self._session, ctypes.byref(args),
                     ctypes.c_uint32(flags), self._stream())
            state.begun(by_hooks=True)
        if e.index in self._ready:
            # A second backward before step() (gradient accumulation with
            # overlap armed): with a verdict dosd reads the gradients only
            # after step(), so the sum is what it reads; without one it may
            # have updated with the first backward's gradients already.
            if self._early_update:
                self._early_error = (f"{e.name}'s gradient was accumulated twice before "
                                     "step() with overlap=\"update\", so dosd may have applied "
                                     "the first backward's gradients; set opt.overlap_armed = "
                                     "False during gradient-accumulation micro-steps")
            else:
                # Gradient accumulation with a verdict: the early step is
                # given up (nothing was applied) and step() begins an
                # ordinary one, so that dosd does not wait through every
                # micro-batch (holding the session, within
                # --early_step_ready_timeout).
                self._accumulating = True
                self._finish_inflight()
            return
        self._ready.add(e.index)
        self.ready_log.append((e.index, now - self._ready_t0))
        g = e.param.grad
        if g is not None and g.data_ptr() != e.grad_shm.data_ptr():
            # autograd made a new gradient (grads were set to None): it goes
            # into the registered buffer before the subgroup is announced.
            if g.dtype != e.grad_shm.dtype or g.shape != e.grad_shm.shape:
                self._early_error = (f"{e.name}'s gradient is {g.dtype} {tuple(g.shape)}; the "
                                     f"registered one is {e.grad_shm.dtype} "
                                     f"{tuple(e.grad_shm.shape)}")
                return
            with torch.no_grad():
                e.grad_shm.copy_(g)
                e.param.grad = e.grad_shm
        first, last = self._ranges[e.index]
        run = None
        for sg in range(first, last + 1):
            self._ready_left[sg] -= 1
            if self._ready_left[sg] == 0:
                run = (run[0], sg) if run is not None and run[1] == sg - 1 else (
                    self._mark_ready(run) or (sg, sg))
        self._mark_ready(run)

    def _mark_ready(self, run):
        if run is not None:
            call("dos_mark_ready", self._session, ctypes.c_uint32(run[0]),
                 ctypes.c_uint32(run[1]), self._stream())
