"""The two non-DOS optimizers of the end-to-end benchmark.

HybridOffloadAdamW: an in-process CPU-offload AdamW written the way
Megatron-Core's HybridDeviceOptimizer works: fp32 master weights (and fp32
gradients, exp_avg, exp_avg_sq) in host memory, DMA through pinned buffers, torch's fused CPU
AdamW on them (foreach on torch < 2.4, which has no fused CPU AdamW), the
parameters split into buckets so that copies overlap compute: every bucket's
16-bit gradients go device->host on one side stream at the start of the
step, the CPU updates bucket i as soon as its gradients have landed, and its
new 16-bit weights go host->device on a second side stream while the CPU
updates bucket i+1. (Megatron copies fp32 gradients; this copies the 16-bit
ones and widens them on the host, half the PCIe bytes: a stronger baseline.)

GpuMasterAdamW: everything on the GPU, standard mixed precision: fp32
masters, fp32 copies of the gradients, torch.optim.AdamW(fused=True)
(foreach where fused is unsupported), 16-bit weights rounded from the
masters: the speed limit, where it fits (about 20 bytes per parameter).
"""

import torch


def _adamw(params, fused_ok, **kw):
    if fused_ok:
        try:
            return torch.optim.AdamW(params, fused=True, **kw), "fused"
        except (TypeError, RuntimeError, ValueError):
            pass
    try:
        return torch.optim.AdamW(params, foreach=True, **kw), "foreach"
    except TypeError:
        return torch.optim.AdamW(params, **kw), "single-tensor"


def _version():
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def _pinned(numel, dtype, pin):
    """A flat host buffer the DMA engines can read and write. Pinned with
    cudaHostRegister where torch exposes it (torch's pin_memory() rounds the
    allocation up to a power of two), else with pin_memory()."""
    t = torch.empty(numel, dtype=dtype)
    if not pin:
        return t
    try:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(getattr(rc, "value", rc)) == 0:
            _pinned.keep.append(t)
            return t
    except Exception:
        pass
    return t.pin_memory()


_pinned.keep = []


class HybridOffloadAdamW:
    """Host memory per parameter: fp32 master + exp_avg + exp_avg_sq (12 B,
    pageable: only the CPU touches them), 16-bit gradient staging (2 B,
    pinned), plus one bucket of fp32 gradient scratch and two buckets of
    16-bit weight staging (pinned, rotating)."""

    def __init__(self, groups, lr, betas=(0.9, 0.999), eps=1e-8, buckets=8):
        params = [p for g in groups for p in g["params"] if p.requires_grad]
        self.device = params[0].device
        self.cuda = self.device.type == "cuda"
        dtype = params[0].dtype
        wd_of = {id(p): g.get("weight_decay", 0.0) for g in groups for p in g["params"]}
        total = sum(p.numel() for p in params)
        per = max(1, total // buckets)
        self.buckets = []
        cur, n = [], 0
        for p in params:
            cur.append(p)
            n += p.numel()
            if n >= per:
                self.buckets.append(cur)
                cur, n = [], 0
        if cur:
            self.buckets.append(cur)
        biggest = max(sum(p.numel() for p in b) for b in self.buckets)
        self.grad_stage = _pinned(total, dtype, self.cuda)
        self.w_stage = [_pinned(biggest, dtype, self.cuda) for _ in range(2)]
        scratch = torch.empty(biggest, dtype=torch.float32)
        self.master, self.gview, self.wview = {}, {}, {}
        off = 0
        with torch.no_grad():
            for b in self.buckets:
                boff = 0
                for p in b:
                    k = p.numel()
                    m = p.detach().to(device="cpu", dtype=torch.float32).clone()
                    m.grad = scratch[boff:boff + k].view(p.shape)
                    self.master[id(p)] = m
                    self.gview[id(p)] = self.grad_stage[off:off + k].view(p.shape)
                    self.wview[id(p)] = [w[boff:boff + k].view(p.shape) for w in self.w_stage]
                    off += k
                    boff += k
        fused_ok = _version() >= (2, 4)
        self.opts = []
        for b in self.buckets:
            gs = {}
            for p in b:
                gs.setdefault(wd_of[id(p)], []).append(self.master[id(p)])
            opt, self.kind = _adamw([{"params": v, "weight_decay": wd} for wd, v in gs.items()],
                                    fused_ok, lr=lr, betas=betas, eps=eps)
            self.opts.append(opt)
        self.note = (f"CPU AdamW {self.kind}, {len(self.buckets)} buckets" +
                     ("" if self.kind == "fused" else " (torch < 2.4 has no fused CPU AdamW)"))
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)

    def zero_grad(self):
        for b in self.buckets:
            for p in b:
                p.grad = None

    @torch.no_grad()
    def step(self):
        if not self.cuda:
            for b, opt in zip(self.buckets, self.opts):
                for p in b:
                    self.master[id(p)].grad.copy_(p.grad)
                opt.step()
                for p in b:
                    p.copy_(self.master[id(p)])
            return
        main = torch.cuda.current_stream(self.device)
        # 1. every bucket's 16-bit gradients to the host, in order, on a side stream
        self.d2h.wait_stream(main)
        arrived = []
        with torch.cuda.stream(self.d2h):
            for b in self.buckets:
                for p in b:
                    self.gview[id(p)].copy_(p.grad, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.d2h)
                arrived.append(ev)
        self.h2d.wait_stream(main)
        sent = []
        for i, (b, opt) in enumerate(zip(self.buckets, self.opts)):
            # 2. the CPU updates bucket i once its gradients have landed
            arrived[i].synchronize()
            for p in b:
                self.master[id(p)].grad.copy_(self.gview[id(p)])
            opt.step()
            # 3. its new weights go back on a second side stream while the CPU
            #    goes on with bucket i+1 (staging buffers rotate: wait for i-2)
            if i >= 2:
                sent[i - 2].synchronize()
            for p in b:
                self.wview[id(p)][i % 2].copy_(self.master[id(p)])
            with torch.cuda.stream(self.h2d):
                for p in b:
                    p.data.copy_(self.wview[id(p)][i % 2], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.h2d)
            sent.append(ev)
        main.wait_stream(self.h2d)
        # The gradients were read on d2h: keep the caching allocator from
        # handing their memory out before those copies are done.
        main.wait_stream(self.d2h)
        self.h2d.synchronize()


class GpuMasterAdamW:
    def __init__(self, groups, lr, betas=(0.9, 0.999), eps=1e-8):
        self.pairs = []
        mgroups = []
        with torch.no_grad():
            for g in groups:
                ms = []
                for p in g["params"]:
                    m = p.detach().float().clone()
                    self.pairs.append((p, m))
                    ms.append(m)
                mgroups.append({"params": ms, "weight_decay": g.get("weight_decay", 0.0)})
        dev = self.pairs[0][0].device
        self.opt, self.kind = _adamw(mgroups, dev.type == "cuda" or _version() >= (2, 4),
                                     lr=lr, betas=betas, eps=eps)
        self.note = f"AdamW {self.kind} on fp32 masters"

    def zero_grad(self):
        for p, _ in self.pairs:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, m in self.pairs:
            m.grad = p.grad.float()
        self.opt.step()
        for p, m in self.pairs:
            p.copy_(m)
            m.grad = None
