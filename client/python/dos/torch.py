"""torch.optim optimizers whose fp32 state lives in the node's dosd daemon.

    import dos.torch
    opt = dos.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

How it works: at construction the optimizer attaches a session to dosd,
allocates one shared-memory arena (dos_buffer_alloc) holding every trainable
parameter and its gradient, copies each parameter into it and rebinds
`p.data` and `p.grad` to tensors over that memory. Autograd then accumulates
gradients straight into shared memory, and the daemon writes the updated
weights straight into the model's parameters. `step()` only publishes the
per-group hyperparameters (so lr schedulers work) and waits for the daemon.

Rules that follow from the shared binding:
- `zero_grad()` always zeroes in place so the binding survives. With
  set_to_none=True (torch 2.x's default; `zero_grad()` follows the running
  torch's default) `p.grad` stays a zero tensor, but the parameter counts as
  having no gradient until backward reaches it (a hook on each parameter
  notes that), as torch's would be None. If something else sets `p.grad` to
  None or to a new tensor (e.g. `model.zero_grad()` in torch 2.x), `step()`
  copies a new gradient into shared memory and rebinds.
- A parameter without a gradient at `step()` (grad None, or not reached by
  backward since a set_to_none zero_grad: an unused branch or MoE expert, a
  parameter frozen mid-training) is skipped as torch.optim skips it: dosd
  leaves its weights, exp_avg, exp_avg_sq and step count untouched. A
  gradient written in place into a zeroed `p.grad` without backward reaching
  the parameter counts as a gradient, as it does for torch (DDP with
  find_unused_parameters writes the averaged gradient into a parameter only
  other ranks used). With overlap="update" too: dosd updates no subgroup
  before all its tensors' gradients are final, and step() tells it which
  were never reached. Only the first 4096 registered parameters can be
  skipped; step() raises for a later one without a gradient (with
  overlap="update" it is updated with a zero gradient). With
  overlap="update", parameters unfrozen after construction are not picked
  up.
- Replacing `p.data` after construction (`model.to(dtype)`, `model.cuda()`,
  assigning a new tensor of the same shape) re-registers the optimizer at the
  next `step()` with a warning (a full copy of the state, below); in-place
  writes such as `model.load_state_dict()` are fine, but call
  `opt.load_state_dict()` (or construct the optimizer) afterwards so the
  daemon's master weights follow.
- `add_param_group()` after construction works the same way (a new session
  with every tensor's state carried over): fine now and then (unfreezing
  layers), costly every step.
- `close()` (also run by `__del__`, and at interpreter exit for optimizers
  still open) finishes the step in flight, copies parameters and gradients
  back into ordinary memory, then detaches; a tensor kept from before that
  which aliases the arena keeps the shared memory mapped (the session is
  detached when the last such tensor goes; dos/_session.py). close() works
  also after dosd stopped or died. Frameworks' wrapper objects of the
  optimizer's class (LightningOptimizer) share its session and never close
  it when they are collected.

CUDA parameters (GPU mode): if every trainable parameter is on one CUDA
device, nothing is copied: the parameters and their gradients are registered
where they are (the client library exports their CUDA allocations by CUDA
IPC) and the daemon updates them in place on that GPU. Gradients are
allocated at construction (`p.grad = torch.zeros_like(p)` where missing) and
must stay where they are: `zero_grad()` zeroes them in place, and a gradient
that autograd or the user replaced is copied back into the registered one at
`step()`. The parameters must be contiguous, and the memory must come from
PyTorch's default CUDA allocator (not `expandable_segments`).

Asynchronous steps (GPU mode, by default): `step()` never blocks the
trainer's CPU thread. It records an interprocess CUDA event on the current
stream (dosd's streams wait for it on the GPU before reading a gradient),
rings the daemon and returns; the current stream then waits, on the GPU, until
the daemon has written every subgroup's new weights (cuStreamWaitValue32 on
the control block), so whatever is queued next (zero_grad, the next forward)
sees them. With `model=` (the module whose forward uses the parameters) the
stream waits per layer instead: a forward pre-hook on each module with
registered parameters waits for just the subgroups holding them, so the next
forward starts while later layers are still being updated (`zero_grad()`
then defers each gradient's zeroing to its layer's wait, and each
parameter's gradient hook waits too, so backward never writes a gradient
the daemon still reads). On the CPU (shared memory) `step()` returns after
the update by default; `model=` with `async_step=True` gives the same
per-layer waits on the host. The daemon's result (found_inf, errors) is
collected at the next `step()`, or when `found_inf`, `last_step`, `state` or
`state_dict()` is read or `synchronize()` is called; `async_step=False`
restores a `step()` that returns after the update everywhere. FSDP2
(DTensor) parameters always step synchronously.

Reading the weights after step(): every reader must see the finished step,
never weights the daemon is still writing. What guarantees it:
- CPU path, default: step() returns after the update, so any read does.
- CUDA without model=: the current stream waits for the whole step, so any
  read queued on it (`p.cpu()`, `torch.save`, evaluation) does.
- With overlap (model= on CUDA; async_step=True on the CPU) reads go through
  hooks: the model's forward waits per layer; `state_dict()` and
  `load_state_dict()` of any module owning registered parameters (hence of
  the model, a wrapper such as DDP, or a submodule) finish the step first,
  and that is how the Hugging Face Trainer, Accelerate's save_state and
  Lightning's ModelCheckpoint save weights; reading `opt.state` or
  `opt.state_dict()` finishes it (Lightning's teardown reads the optimizer's
  state before it moves the model to the CPU); on CUDA a stream of the
  optimizer's own waits for the whole step, so `torch.cuda.synchronize()`
  returns only once the weights are in. `opt.synchronize()` finishes it
  explicitly. Not covered: a read that passes through none of these while
  the step is in flight, e.g. `p.detach().cpu()`, `model.cpu()`, iterating
  `parameters()` into an EMA, or another CUDA stream: call `opt.synchronize()`
  (or `torch.cuda.synchronize()`) first, or build the optimizer without
  model= (whose gain is the next forward's first layers; 1.412 vs 1.413
  s/iter at 6B, bench/results/e2e_nvidia-h200_2026-11-29_6b_80g.json).

GPU memory (GPU mode): dosd keeps as many subgroups' state resident on the
GPU as this trainer lends it, computed at every step from the trainer's
budget and measured peak (dos/_lease.py): `gpu_budget_bytes=` (or
$DOS_GPU_BUDGET, e.g. "80G"), else torch.cuda's per-process memory fraction,
else the memory free when it first lends; 0 lends nothing. When the peak
grows the lease shrinks and step() returns once dosd has freed the memory, so
the next forward never finds it taken. `opt.gpu_lease` shows the last lease.

Crash survival: `opt.session_info()` gives the session id and token (keep
them private to the job); a restarted trainer builds its optimizer with
`resume=info` within dosd's --session_lease, and the daemon rewrites the new
process's weights from its fp32 masters, so training continues exactly.

Several ranks (DDP, FSDP2): each rank's optimizer attaches its own session
to the node's one dosd, tagged with its rank/local_rank/world_size (arguments,
else torch.distributed when initialised, else $RANK/$LOCAL_RANK/$WORLD_SIZE).
DDP: build the optimizer after wrapping the model; DDP copies the reduced
gradients into p.grad in place (keep gradient_as_bucket_view=False, the
default). FSDP2 (`fully_shard`): parameters are DTensors; each rank registers
its local shard (`to_local()`). On CUDA the shard is registered in place and
the sharded gradient is copied into a registered buffer at `step()`; on the
CPU both go through shared memory and the new weights are copied back into
the shard after the step.

AMP: `GradScaler` works. The class sets `_step_supports_amp_scaling`, so
`scaler.step(opt)` hands the loss scale to the daemon, which divides the
gradients by it while it reads them and skips the whole step if any is not
finite (nothing is unscaled in place on the trainer's side; 16-bit fp16
gradients are fine). If `scaler.unscale_(opt)` was called first (for
clipping), the gradients are already unscaled and the scaler's own inf check
decides. `found_inf_per_device` is filled for `scaler.update()`. Without a
scaler, `step(grad_scale=S, clip_coef=c)` does the same by hand.

A parameter whose storage moved (its `.data` replaced by a tensor of the same
dtype, shape and device) is re-registered with a warning at the next `step()`:
a new session is attached, the fp32 state (master, exp_avg, exp_avg_sq, step)
carried over, and the master taken from the new tensor where its values
differ from the old weights.

Early steps, `overlap=` (torch >= 2.1; bench/e2e/README.md "Overlap"): a
post-accumulate-grad hook on every registered parameter begins the step at
the first final gradient of backward and marks each subgroup ready once all
its tensors' gradients are final (on CUDA the mark is enqueued on the
current stream after the gradient kernels; on the CPU a store).
- overlap=True: dosd plans the step (and grows the resident tier) during
  backward and applies nothing before step(), which brings the verdict: the
  loss scale, the clip coefficient and the final learning rates. Everything
  that works without overlap works: clipping (`opt.clip_grad_norm_(max_norm)`
  computes the norm and passes the coefficient with step() without touching
  the gradients; torch.nn.utils.clip_grad_norm_ in place works too, as dosd
  reads the gradients only after step()), GradScaler, gradient accumulation,
  and results are bitwise those of overlap=False. A reader between backward
  and step() (state_dict(), zero_grad(), synchronize()) gives the early step
  up; step() then begins an ordinary one. So does a second backward before
  step() (gradient accumulation: the step then begins at step(), and dosd
  never waits through the micro-batches); dosd waits for a verdict at most
  --early_step_ready_timeout (10 minutes) from the first gradient.
- overlap="update": nothing global may come after backward (no clipping, no
  loss scale, no GradScaler, one backward per step: set
  `opt.overlap_armed = False` around gradient-accumulation micro-steps), and
  dosd updates each subgroup during backward as soon as it is ready, the last
  layers first; non-finite gradients are not scanned for (as torch's AdamW
  without a scaler). step(clip_coef=..), a GradScaler or a second backward
  then raise FAILED_PRECONDITION after the step (it was applied without
  them). A parameter's new weights may land before step() returns: read
  weights only after step(). Crash survival is weaker for such a step: a
  trainer that dies during backward leaves the subgroups dosd had updated
  one update ahead of the others (their step counts unchanged); resume=
  continues from there. So does a backward that leaves a subgroup unmarked
  for longer than dosd's --early_step_ready_timeout (10 minutes; step()
  raises DEADLINE_EXCEEDED): the GPU engine, held while dosd waits, is
  shared by every trainer on that GPU.
Per-layer waits (model=) never wait for the backward's own early step. The
ready order and times of the last step are in `opt.ready_log`; `last_step`
reports `early`, `before_verdict_us` and `after_verdict_us` (dosd's time from
the begin to the verdict and from the verdict to the end of the update).
Not early (the step begins at step()): DTensor (FSDP2) parameters, CUDA
without stream memory operations, and a step after a parameter moved.

State: `state_dict()` has torch.optim.AdamW's format with CPU tensors
(DTensors over CPU shards for FSDP2 parameters), streamed from the daemon
after any step in flight; `load_state_dict()` accepts it, or torch's AdamW
state on any device, in bounded pieces (dos/_state.py has the details).

Compact state: `compact_state=True` has dosd keep exp_avg and exp_avg_sq as
bf16 (exp_avg rounded to nearest even, exp_avg_sq stochastically) beside the
fp32 master weights: 8 bytes of state a parameter instead of 12, less host
memory, PCIe and CPU traffic, and a small loss effect (README "Compact
state"). The default is fp32 state. `state_dict()` still returns fp32 tensors
(the bf16 moments widened exactly) and `load_state_dict()` rounds fp32
moments to nearest even, so state moves freely between the two formats and
torch.optim.AdamW. A resumed session (resume=) must pass the same choice.

Parameters with requires_grad=False at construction are not registered; one
that later has requires_grad and a gradient at step() is registered then (a
new session, as for add_param_group, with a warning).
`opt.state` is empty (the state lives in dosd), but `opt.state[p]` and
`opt.state.get(p)` give a registered parameter's state ('step', 'exp_avg',
'exp_avg_sq', 'master_param' for 16-bit) read from dosd: a copy, so writes
into it change nothing (use load_state_dict()).
torch's keyword arguments foreach, fused and capturable are accepted and kept
in param_groups (dosd's kernels are used whatever they say);
differentiable=True, maximize=True and amsgrad=True raise NotImplementedError.
Threads: like torch optimizers, use one optimizer from one thread at a time.
"""

from __future__ import annotations

import ctypes
import inspect
import math
import sys
import warnings
import weakref
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

from dos import _native
from dos import _views
from dos._errors import DosError, call
from dos._hooks import _HooksMixin
from dos._lease import GpuLease
from dos._native import Status
from dos._register import Entry, _RegisterMixin, is_dtensor, local_of
from dos._session import SessionHandle, track, untrack
from dos._state import _StateMixin, torch_defaults
from dos._step import StepMachine, StepState

__all__ = ["AdamW", "Adam", "DosError"]

# zero_grad()'s set_to_none default of the running torch (False in 1.x,
# True from 2.0): DOS's zero_grad() without an argument follows it.
_SET_TO_NONE_DEFAULT = bool(inspect.signature(torch.optim.Optimizer.zero_grad)
                            .parameters["set_to_none"].default)


class _DaemonState(defaultdict):
    """`opt.state`: torch's per-parameter state mapping, empty (the state
    lives in dosd, and frameworks that iterate it to move or save the state
    find nothing to copy), except that `state[p]` and `state.get(p)` of a
    registered parameter read its state from dosd ({} before its first step,
    as torch's): not kept here (writes into it change nothing), on the
    parameter's device as torch's (the step count stays a CPU scalar, as
    torch keeps it)."""

    def __init__(self, opt):
        super().__init__(dict)
        self._opt = weakref.ref(opt)

    def _entry(self, key):
        opt = self._opt()
        if opt is None or opt._session is None or not isinstance(key, torch.Tensor):
            return None
        return next((e for e in opt._entries if e.param is key), None)

    def __missing__(self, key):
        e = self._entry(key)
        if e is None:
            return super().__missing__(key)
        return self._read(e)

    def get(self, key, default=None):
        if key in self:
            return self[key]
        e = self._entry(key)
        return default if e is None else self._read(e)

    def _read(self, e):
        s = self._opt()._state_of(e)  # {} before the parameter's first step
        dev = e.param.device
        if dev.type != "cpu" and not is_dtensor(e.param):
            s = {k: v if k == "step" else v.to(dev) for k, v in s.items()}
        return s

    def __reduce__(self):  # copies and pickles are plain (torch's own type)
        return (defaultdict, (dict, dict(self)))


class _DosAdamBase(_RegisterMixin, _HooksMixin, _StateMixin, torch.optim.Optimizer):
    """The optimizer: construction, step(), zero_grad(), close(). Registration
    (dos/_register.py), hooks and per-layer waits (dos/_hooks.py) and state
    I/O (dos/_state.py) are mixed in; the step's state is a StepMachine
    (dos/_step.py)."""

    _decoupled = True  # AdamW; Adam (L2) overrides
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """GradScaler hands the loss scale to step() instead of unscaling in
        place (no pass over the gradients). Lightning reads the same flag to
        refuse gradient_clip_val ("performs unscaling of gradients
        internally"): to Lightning the answer is False, so it unscales in
        place (16-mixed), clips the gradients itself, and its scaler.step()
        then hands step() no scale (grad_scale None: already unscaled)."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return not caller.startswith(("lightning.", "pytorch_lightning.", "lightning_fabric."))

    # close() waits this long for the step in flight before detaching anyway.
    _CLOSE_WAIT_MS = 120_000
    # torch 2.x's GradScaler sets `grad_scale` (a tensor, or None after
    # unscale_) and `found_inf` around step() and deletes them after; it
    # multiplies by a grad_scale it finds, so there is no class default.

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, socket: Optional[str] = None, subgroup_size: int = 0,
                 client_name: Optional[str] = None, maximize: bool = False,
                 rank: Optional[int] = None, local_rank: Optional[int] = None,
                 world_size: Optional[int] = None, overlap: bool = False,
                 model: Optional[torch.nn.Module] = None, async_step: Optional[bool] = None,
                 resume: Optional[Dict[str, Any]] = None, compact_state: bool = False,
                 gpu_budget_bytes=None, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False):
        if amsgrad:
            raise NotImplementedError("dos.torch: amsgrad=True is not supported by dosd")
        if maximize:
            raise NotImplementedError(
                "dos.torch: maximize=True is not supported by dosd; minimise the negated loss "
                "instead (the same updates)")
        if differentiable:
            raise NotImplementedError("dos.torch: differentiable=True is not supported (dosd "
                                      "updates the weights outside autograd)")
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self._owner_id = id(self)  # __del__ closes only for this object, not for wrappers
        self._handle = None  # SessionHandle (dos/_session.py); set by _attach via _session
        self._step_state = StepMachine()  # the step in flight, if any (dos/_step.py)
        self._entries: List[Entry] = []
        self._arena = None
        self._device = None  # torch.device of the parameters in GPU mode, else None
        self._registering = True
        # torch's own optimizer's keys (foreach, fused, capturable, ...) too,
        # so that state dicts move between the two without losing them.
        defaults = torch_defaults(torch.optim.AdamW if self._decoupled else torch.optim.Adam)
        defaults.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False)
        # torch's implementation choices: kept as given (they travel with
        # state dicts), without effect on dosd's kernels.
        for key, value in (("foreach", foreach), ("fused", fused)):
            if value is not None or key in defaults:
                defaults[key] = value
        if capturable or "capturable" in defaults:
            defaults["capturable"] = capturable
        if "differentiable" in defaults:
            defaults["differentiable"] = False
        super().__init__(params, defaults)
        self._torch_state = _DaemonState(self)
        self._registering = False
        self._found_inf = False
        self._amp_found_inf = None
        self._last_step = None  # dict of the daemon's report on the last step
        self._async = False       # step() returns once the step is queued
        self._stream_sync = False # the trainer's CUDA stream orders steps (no host waits)
        self._layer_waits = []    # forward pre-hook handles (model=)
        self._grad_hooks = []
        self._seen_hooks = []     # per-parameter "backward reached it" hooks
        self._pending_zero = set()  # entry indices whose zero_grad is deferred
        self._num_subgroups = 0
        self._subgroup_size = subgroup_size
        # dosd keeps exp_avg / exp_avg_sq as bf16 (8 bytes of state a
        # parameter instead of 12); state_dict() still returns fp32 tensors.
        self._compact_state = bool(compact_state)
        self._attach_args = (socket, client_name, rank, local_rank, world_size)
        self._resume = resume
        self._ready = set()
        self.ready_log: List[Any] = []  # (tensor index, seconds since the first ready) last step
        self._ready_t0 = None
        self.overlap_armed = True
        # overlap=True saw a second backward before step() (gradient
        # accumulation): early begins wait for the next step().
        self._accumulating = False
        if overlap not in (False, True, "update"):
            raise ValueError(f"overlap={overlap!r}: use False, True or \"update\"")
        # overlap="update": no verdict after backward; dosd updates each
        # subgroup during backward as soon as its gradients are final.
        self._early_update = overlap == "update"
        self._early_error = None
        self._ready_left = []
        self._clip_coef = None  # from clip_grad_norm_(), for the next step()
        self.overlap = bool(overlap)
        if self.overlap and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            warnings.warn(f"dos.torch: overlap=True needs torch >= 2.1 "
                          f"(register_post_accumulate_grad_hook); torch {torch.__version__} "
                          "has none, so steps start at step() as usual")
            self.overlap = False
            self._early_update = False
        self._attach(*self._attach_args)
        try:
            self._register(subgroup_size)
        except BaseException:
            self.close()
            raise
        self._install_seen_hooks()
        # GPU mode: the memory this trainer lends dosd's resident tier
        # (dos/_lease.py); None on the CPU path.
        self._lease = None if self._device is None else GpuLease(self._device, gpu_budget_bytes)
        if self.overlap:
            self._install_hooks()
        # The model only weakly: it holds this optimizer's hooks (no cycle).
        self._async_args = (None if model is None else weakref.ref(model), async_step)
        self._setup_async(model, async_step)

    # found_inf: the daemon's verdict on the last step (a bool). torch 2.x's
    # GradScaler sets and deletes an attribute of the same name around
    # step() (its inf-check tensor); the property keeps the two apart.
    @property
    def found_inf(self) -> bool:
        self._finish_inflight()  # an asynchronous step's verdict is known once it is done
        return self._found_inf

    @found_inf.setter
    def found_inf(self, value) -> None:
        if isinstance(value, torch.Tensor):
            self._amp_found_inf = value
        else:
            self._found_inf = bool(value)

    @found_inf.deleter
    def found_inf(self) -> None:
        self._amp_found_inf = None

    @property
    def last_step(self) -> Optional[Dict[str, Any]]:
        """The daemon's report on the last step (waits for a step in flight)."""
        self._finish_inflight()
        return self._last_step

    @last_step.setter
    def last_step(self, value) -> None:
        self._last_step = value

    @property
    def gpu_lease(self) -> Optional[Dict[str, Any]]:
        """GPU mode: the lease last sent to dosd (lease_bytes, budget_bytes,
        peak_bytes, headroom_bytes, budget_source); None before the first
        step, on the CPU path, or with lending off (gpu_budget_bytes=0)."""
        return None if self._lease is None else self._lease.last

    @property
    def session_id(self) -> int:
        """This optimizer's dosd session (with session_token: what a restarted
        trainer passes as `resume=` to continue from the daemon's state)."""
        self._check_open("session_id")
        return int(_native.lib.dos_session_id(self._session))

    @property
    def session_token(self) -> str:
        self._check_open("session_token")
        return _native.lib.dos_session_token(self._session).decode()

    def session_info(self) -> Dict[str, Any]:
        """{'session_id', 'token'}: save it (privately: the token is the
        session's credential) so that a restarted process can build its
        optimizer with `resume=info` after a crash; dosd keeps a dead
        trainer's state for its --session_lease."""
        return {"session_id": self.session_id, "token": self.session_token}

    @property
    def resumed(self) -> bool:
        """True when this optimizer continued a dead trainer's session."""
        return self._session is not None and bool(_native.lib.dos_session_resumed(self._session))

    @property
    def _session(self):
        """The dos_session* (ctypes.c_void_p), or None once closed."""
        h = self._handle
        return None if h is None or h.closed else h.ptr

    @_session.setter
    def _session(self, ptr) -> None:
        self._handle = None if ptr is None else SessionHandle(ptr)
        if ptr is not None:
            track(self)  # closed at interpreter exit if still open (also after re-registration)

    @property
    def state(self):
        """torch.optim's per-parameter state (empty here: the state lives in
        dosd; state_dict() pulls it). Reading it finishes the step in flight,
        as frameworks read it to move or save the optimizer (Lightning's
        teardown, for one, then moves the model to the CPU)."""
        if self._inflight:
            self._finish_inflight()
        return self._torch_state

    @state.setter
    def state(self, value) -> None:
        self._torch_state = value

    def synchronize(self) -> None:
        """Waits until the step in flight, if any, is finished: once it
        returns, the new weights are in the parameters for every reader (this
        thread, another thread, and any work queued from now on on any CUDA
        stream), and the step's result is collected (`last_step`; a step the
        daemon failed raises here). A no-op without a step in flight.

        Needed only for reads that pass through none of the optimizer's
        hooks while steps overlap the next forward (`model=` on CUDA, or
        `async_step=True` on the CPU): a tensor read directly (`p.cpu()`,
        `parameters()`, `model.to()`); module state_dict()/load_state_dict(),
        the model's forward, and the optimizer's state wait by themselves."""
        self._finish_inflight()

    @property
    def _inflight(self) -> bool:
        """A step was begun and its result is not collected yet."""
        machine = getattr(self, "_step_state", None)
        return machine is not None and machine.in_flight

    # ---- setup ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As torch's. After construction dosd's session is rebuilt (its
        tensors are registered once): every tensor's state is read out, the
        group added, and a new session registered with the state written
        back (a full copy of the state: fine for unfreezing layers now and
        then)."""
        if getattr(self, "_registering", True):
            super().add_param_group(param_group)
            return
        self._check_open("add_param_group")
        self._sync_device()
        saved = self._saved_state()
        super().add_param_group(param_group)
        self._rebuild(saved)

    def _sync_device(self):
        """Makes the trainer's pending work on the device visible to the
        daemon (and the daemon's state writes to later trainer work)."""
        if self._device is not None:
            torch.cuda.current_stream(self._device).synchronize()

    def _check_open(self, what):
        if self._session is None:
            raise DosError(Status.FAILED_PRECONDITION, f"{what}: the optimizer is closed")

    # ---- training ----

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips like torch.nn.utils.clip_grad_norm_ over this optimizer's
        parameters, without touching the gradients: the total norm (returned,
        as torch's) is computed here, and the coefficient
        min(1, max_norm / (norm + 1e-6)) goes to dosd with the next step(),
        which multiplies each gradient by it as it reads it. The result is
        bitwise that of step(clip_coef=c), and it works with overlap=True,
        where dosd may read gradients before step(). Reads the norm on the host
        (one device synchronisation)."""
        grads = [local_of(p.grad) for g in self.param_groups for p in g["params"]
                 if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
        dev = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), norm_type)
        value = float(total)
        if error_if_nonfinite and not math.isfinite(value):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped. To disable "
                               "this error and scale the gradients by the non-finite norm anyway, "
                               "set `error_if_nonfinite=False`")
        # torch's clip_coef_clamped, in fp32. A non-finite norm is not
        # clipped: dosd's non-finite scan skips such a step (torch would apply
        # NaN updates).
        coef = torch.clamp(torch.tensor(float(max_norm), dtype=torch.float32) /
                           (torch.tensor(value, dtype=torch.float32) + 1e-6), max=1.0)
        self._clip_coef = float(coef) if math.isfinite(value) else 1.0
        return total

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Zeroes every gradient in place (registered gradients must stay
        where dosd reads them). set_to_none (default: the running torch's)
        makes each parameter count as having no gradient until backward
        reaches it: step() then skips it as torch skips a None grad.
        With a step in flight: on a stream-ordered GPU session the zeroing is
        queued behind the step's completion on the current stream; with
        per-layer waits (model=) it is deferred to each layer's wait, so that
        the daemon still reads the gradients of layers it has not reached.
        Between backward and step() with overlap (an early step not claimed
        by step() yet), the early step is given up first (overlap=True) or
        completed (overlap="update"), as step() would never see these
        gradients."""
        if self._step_state.hook_begun:
            self._finish_inflight()
        if self._inflight and self._layer_waits:
            self._pending_zero.update(e.index for e in self._entries if not e.copy_grad)
            entries = [e for e in self._entries if e.copy_grad]
        else:
            if not (self._step_state.state is StepState.IN_FLIGHT and self._stream_sync):
                self._finish_inflight()
            entries = self._entries
        registered = {id(e.param) for e in self._entries if not e.copy_grad}
        if set_to_none is None:
            set_to_none = _SET_TO_NONE_DEFAULT
        if set_to_none:  # otherwise a gradient that was None stays None, as in torch
            for e in self._entries:
                e.grad_none = True
        with torch.no_grad():
            for e in entries:
                if not e.copy_grad:  # DTensor: the gradient is FSDP's, handled below
                    self._zero_entry(e)
            for group in self.param_groups:
                for p in group["params"]:
                    if id(p) in registered or p.grad is None:
                        continue
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()
        self._ready.clear()

    @staticmethod
    def _zero_entry(e: Entry) -> None:
        """Zeroes e's registered gradient in place and binds it as p.grad."""
        e.grad_shm.zero_()
        e.zero_version = e.grad_shm._version
        if e.param.grad is not e.grad_shm:
            e.param.grad = e.grad_shm

    @staticmethod
    def _no_gradient(e: Entry) -> bool:
        """Whether torch would see no gradient for e this step: grad None, or
        zeroed by zero_grad(set_to_none=True), not reached by backward and not
        written since (DDP writes the averaged gradient into a parameter that
        only other ranks used: torch updates it, so must we)."""
        g = e.param.grad
        if g is None:
            return True
        g = local_of(g)
        return (e.grad_none and g.data_ptr() == e.grad_shm.data_ptr()
                and g._version == e.zero_version)

    def _bind_grads(self) -> List[int]:
        """Brings every gradient into its registered buffer; returns the
        indices of the tensors without a gradient (skipped by this step)."""
        moved = [e for e in self._entries if self._moved(e)]
        if moved:
            self._reregister(moved)
        thawed = self._thawed()
        if thawed:
            # Frozen at construction (not registered), trainable now: torch
            # would start updating them, so they are registered (afresh).
            warnings.warn(f"dos.torch: {len(thawed)} parameter(s) frozen when the optimizer was "
                          "built now have gradients; re-registering with dosd to train them "
                          "(a full copy of the state)", RuntimeWarning, stacklevel=3)
            self._sync_device()
            self._rebuild(self._saved_state())
        skip = []
        with torch.no_grad():
            for e in self._entries:
                p = e.param
                g = p.grad
                bound = g is not None and local_of(g).data_ptr() == e.grad_shm.data_ptr()
                if self._no_gradient(e):
                    # No gradient: skipped as torch skips it. The buffer dosd
                    # still reads must hold finite values (zeros).
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
                    skip.append(e.index)
                    continue
                e.grad_none = False
                g = local_of(g)
                if g.data_ptr() == e.grad_shm.data_ptr() and g.dtype == e.local.dtype:
                    continue
                if g.dtype != e.local.dtype or g.shape != e.local.shape:
                    raise DosError(
                        Status.INVALID_ARGUMENT,
                        f"step: {e.name} is {p.dtype} {tuple(e.local.shape)} but its grad is "
                        f"{g.dtype} {tuple(g.shape)}; gradients must have the parameter's "
                        "dtype and shape")
                if g.is_sparse:
                    raise DosError(Status.INVALID_ARGUMENT, f"step: {e.name} has a sparse gradient")
                e.grad_shm.copy_(g)
                if not e.copy_grad:
                    p.grad = e.grad_shm
        return skip

    def _thawed(self) -> List[torch.Tensor]:
        """Parameters frozen at construction (not registered) that now
        require grad and have a gradient: torch would update them."""
        registered = {id(e.param) for e in self._entries}
        return [p for g in self.param_groups for p in g["params"]
                if p.requires_grad and p.grad is not None and id(p) not in registered
                and local_of(p).numel() > 0]

    def _copy_out(self):
        if any(e.copy_out for e in self._entries):
            with torch.no_grad():
                for e in self._entries:
                    if e.copy_out:
                        e.local.copy_(e.param_shm)

    def _amp_args(self, grad_scaler):
        """(grad_scale, skip) from a GradScaler driving this step: torch 1.x
        passes itself as `grad_scaler`; torch 2.x sets self.grad_scale and
        self.found_inf (after its own inf check) instead."""
        if grad_scaler is not None:  # torch 1.x protocol
            state = grad_scaler._per_optimizer_states[id(self)]
            stage = getattr(state.get("stage"), "name", "READY")
            found = state.get("found_inf_per_device") or {}
            if stage == "UNSCALED":  # the user unscaled (and checked) already
                return 1.0, any(float(v) != 0 for v in found.values())
            return float(grad_scaler._get_scale_async()), False
        skip = False
        if self._amp_found_inf is not None:
            skip = float(self._amp_found_inf) != 0
        amp = getattr(self, "grad_scale", None)
        scale = 1.0 if amp is None else float(amp)
        return scale, skip

    def _record_amp(self, grad_scaler):
        """Fills GradScaler's found_inf_per_device from the daemon's verdict
        (torch 1.x protocol, where the scaler did not check itself)."""
        if grad_scaler is None:
            return
        state = grad_scaler._per_optimizer_states[id(self)]
        if state.get("found_inf_per_device"):
            return
        scale = grad_scaler._get_scale_async()
        state["found_inf_per_device"][scale.device] = torch.full(
            (1,), 1.0 if self._found_inf else 0.0, dtype=torch.float32, device=scale.device)

    def _args(self, grad_scale, clip_coef, gradients_checked=False, skip=()):
        groups = self._hparams()
        args = _native.StepArgs()
        _native.lib.dos_step_args_init(ctypes.byref(args))
        args.groups = groups
        args.num_groups = len(groups)
        args.grad_scale = float(grad_scale)
        args.clip_coef = float(clip_coef)
        args.gradients_checked = 1 if gradients_checked else 0
        if skip:
            # ctypes keeps the array alive with `args` (its _objects).
            args.skip_tensors = (ctypes.c_uint32 * len(skip))(*skip)
            args.num_skip_tensors = len(skip)
        return args, groups

    def _wait(self, timeout_ms: int = -1):
        res = _native.StepResult()
        overlapped = self._step_state.overlapped
        try:
            call("dos_step_wait", self._session, ctypes.c_int64(timeout_ms), ctypes.byref(res))
        finally:
            self._step_state.collected()
        self._found_inf = bool(res.found_inf)
        early = ctypes.c_int32()
        before, after = ctypes.c_double(), ctypes.c_double()
        prefetched = ctypes.c_uint64()
        call("dos_last_step_early", self._session, ctypes.byref(early), ctypes.byref(before),
             ctypes.byref(after), ctypes.byref(prefetched))
        self._last_step = {"found_inf": self._found_inf, "step": int(res.step),
                           "wall_us": float(res.wall_us), "update_us": float(res.update_us),
                           "overlapped": overlapped, "early": bool(early.value),
                           "before_verdict_us": float(before.value),
                           "after_verdict_us": float(after.value),
                           "prefetched_bytes": int(prefetched.value)}
        self._copy_out()
        if self._pending_zero:  # nothing reads the gradients any more
            self._zero_pending(self._entries)

    def _finish_inflight(self):
        """Collects the step in flight (waits on the host for its result and
        raises its error, if any). An early step that step() has not claimed
        yet is given up when it awaits a verdict (nothing was applied), and
        completed with its begin-time hyperparameters without one (overlap=
        "update": dosd applied part of it already)."""
        if self._step_state.hook_begun:
            self._step_state.claim()
            if self._early_update:
                call("dos_step_verdict", self._session, None, self._stream())
            else:
                self._abandon_early()
                return
        if self._inflight:
            self._wait()

    def _abandon_early(self):
        """Gives up the claimed early step (before its verdict): dosd applies
        nothing and answers ABORTED, which is what we asked for."""
        call("dos_step_abandon", self._session)
        try:
            self._wait()
        except DosError as e:
            if getattr(e, "code", None) != Status.ABORTED:
                raise
        self._ready = set()

    def _stream(self):
        """The current CUDA stream as a cudaStream_t (GPU mode), else None."""
        if self._device is None:
            return None
        return ctypes.c_void_p(torch.cuda.current_stream(self._device).cuda_stream)

    def _begin(self, args, by_hooks: bool = False):
        """Begins a step: stream-ordered on a GPU session with stream sync
        (the daemon waits for this stream's work on the GPU), else after
        synchronising the device. `by_hooks`: begun by the overlap hooks.
        GPU mode: the lease goes first (a lowered one is given back by dosd
        before the step call returns)."""
        lease = getattr(self, "_lease", None)
        if lease is not None:
            lease.update(self._session)
        if self._stream_sync:
            call("dos_step_begin_on_stream", self._session, ctypes.byref(args),
                         self._stream())
        else:
            self._sync_device()
            call("dos_step_begin", self._session, ctypes.byref(args))
        self._step_state.begun(by_hooks)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, clip_coef: float = 1.0, **kwargs):
        """One Adam(W) step in the daemon. `grad_scale` divides the gradients
        (an AMP loss scale), `clip_coef` then multiplies them. Sets
        `self.found_inf` (non-finite gradients: nothing was applied).
        Driven by a GradScaler (`scaler.step(opt)`), the scaler's scale is
        used as grad_scale."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(kwargs)}")
        self._accumulating = False
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open("step")
        if not self._entries:
            return loss
        if self._step_state.state is StepState.IN_FLIGHT:
            self._finish_inflight()  # the previous asynchronous step
        if self._step_state.hook_begun and not self._early_update and self._thawed():
            self._finish_inflight()  # gives the early step up: an ordinary one registers them
        clip = self._clip_coef
        self._clip_coef = None
        if clip is not None:
            clip_coef = float(clip_coef) * clip
        if self._step_state.hook_begun:  # an early step, begun at the first gradient
            self._step_state.claim()
            if self._lease is not None:
                self._lease.update(self._session)  # goes with the next step (peak after backward)
            if self._early_update:
                # Parameters backward did not reach: dosd has not updated
                # their subgroups yet and leaves them as torch would.
                skip = [e.index for e in self._entries
                        if e.index < _native.MAX_SKIP_TENSORS and self._no_gradient(e)]
                args, _groups = self._args(1.0, 1.0, skip=skip)
                call("dos_step_verdict", self._session, ctypes.byref(args), self._stream())
                late = (grad_scale != 1.0 or clip_coef != 1.0 or grad_scaler is not None
                        or getattr(self, "grad_scale", None) is not None)
                if late or self._early_error:
                    self._wait()
                    why = self._early_error or (
                        "with overlap=\"update\" dosd updates each subgroup during backward, so "
                        "a grad scale or clip coefficient given at step() comes too late (the "
                        "step was applied without it); use overlap=True (a verdict at step(): "
                        "clipping and GradScaler work) or overlap=False")
                    raise DosError(Status.FAILED_PRECONDITION, f"step: {why}")
            else:
                amp_scale, skip = self._amp_args(grad_scaler)
                if skip:  # the scaler found inf/nan: nothing is applied
                    self._abandon_early()
                    self._found_inf = True
                    return loss
                if self._early_error:
                    self._abandon_early()
                    raise DosError(Status.FAILED_PRECONDITION, f"step: {self._early_error}")
                try:
                    skip = self._bind_grads()
                    args, _groups = self._args(float(grad_scale) * amp_scale, clip_coef,
                                               skip=skip)
                except BaseException:
                    self._abandon_early()
                    raise
                call("dos_step_verdict", self._session, ctypes.byref(args), self._stream())
        else:
            amp_scale, skip = self._amp_args(grad_scaler)
            if skip:  # the scaler found inf/nan: torch optimizers skip the step
                self._found_inf = True
                self._last_step = {"found_inf": True, "step": self._last_step["step"]
                                   if self._last_step else 0, "wall_us": 0.0, "update_us": 0.0,
                                   "overlapped": False}
                return loss
            skip = self._bind_grads()
            args, _groups = self._args(float(grad_scale) * amp_scale, clip_coef, skip=skip)
            self._begin(args)
        self._ready.clear()
        if self._async and grad_scaler is None and not _views.live():
            # Queued: the result is collected at the next step() (or by
            # found_inf, last_step, state access, synchronize()); the next
            # forward waits per layer (model=) or behind the whole step on the
            # stream; module state_dict()/load_state_dict() finish it.
            if not self._layer_waits:
                self._queue_wait_all()
            elif self._stream_sync:
                self._queue_device_wait()
            return loss
        # Synchronous also while a state dict's views of dosd's memory are
        # alive (dos/_views.py): whoever holds one never sees a half step.
        self._wait()
        self._record_amp(grad_scaler)
        return loss

    def set_policy(self, policy: str) -> None:
        """Scheduling policy of this session: "cpu", "static:<f>",
        "interleave:<k>" or "auto"."""
        self._check_open("set_policy")
        call("dos_set_policy", self._session, policy.encode())

    # ---- teardown ----

    def close(self) -> None:
        """Finishes the step in flight, moves parameters and gradients back to
        ordinary memory and detaches (the daemon frees this session's state).
        Idempotent; also after dosd stopped. The shared memory itself is
        released once no tensor over it is left (dos/_session.py)."""
        handle = getattr(self, "_handle", None)
        if handle is None or handle.closed:
            return
        if self._inflight:
            # Bounded: close() also runs from the atexit handler and from
            # finalizers, where a daemon that is alive but stuck must not keep
            # the process from exiting (a daemon that is gone or closed the
            # session is noticed at once, within the library's liveness slice).
            try:
                if self._step_state.hook_begun:  # an early step step() never claimed
                    self._step_state.claim()
                    if self._early_update:
                        call("dos_step_verdict", self._session, None, self._stream())
                    else:
                        call("dos_step_abandon", self._session)
                self._wait(timeout_ms=self._CLOSE_WAIT_MS)
            except Exception as e:  # dosd gone, stuck, or the step failed
                if getattr(e, "code", None) == Status.DEADLINE_EXCEEDED:
                    warnings.warn(f"dos.torch: close(): the step in flight did not finish within "
                                  f"{self._CLOSE_WAIT_MS // 1000} s; detaching without it",
                                  RuntimeWarning)
        for h in (getattr(self, "_layer_waits", []) + getattr(self, "_grad_hooks", [])
                  + getattr(self, "_seen_hooks", [])):
            h.remove()
        self._layer_waits, self._grad_hooks, self._seen_hooks = [], [], []
        with torch.no_grad():
            for e in getattr(self, "_entries", []):
                p = e.param
                if e.hook is not None:
                    e.hook.remove()
                    e.hook = None
                if self._device is not None or e.copy_out:  # the memory is the model's own
                    e.param_shm = e.grad_shm = None
                    continue
                if p.data_ptr() == e.param_shm.data_ptr():
                    p.data = e.param_shm.clone()
                if p.grad is not None and p.grad.data_ptr() == e.grad_shm.data_ptr():
                    p.grad = e.grad_shm.clone()
                e.param_shm = e.grad_shm = e.local = None
        handle.closed = True  # every view of this optimizer sees it closed
        self._handle = None
        self._arena = None
        untrack(self)
        # Detach now unless tensors over the arena are still alive (they keep
        # the handle, which detaches when they go): 2 = `handle` + the argument.
        if sys.getrefcount(handle) <= 2:
            handle.detach()

    def __del__(self):
        # Frameworks make objects of the optimizer's class that share its
        # state (LightningOptimizer): only the optimizer itself closes.
        if self.__dict__.get("_owner_id") != id(self):
            return
        try:
            self.close()
        except Exception:  # interpreter shutdown or daemon gone: nothing to do
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AdamW(_DosAdamBase):
    """torch.optim.AdamW (decoupled weight decay) with its state in dosd."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class Adam(_DosAdamBase):
    """torch.optim.Adam (L2 weight decay: g += wd * p) with its state in dosd."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
