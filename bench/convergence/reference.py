"""The convergence benchmark's control without DOS: torch.optim.AdamW on fp32
master copies of the model's parameters, on the model's device, the model's
weights (bf16 in the benchmark) rounded from the masters after each step, as
dosd does. With delay=1 the tail `fraction` of the parameters (registration
order: the decayed matrices, then norms, biases and embeddings; where dosd's
static:<f> policy puts its host path) holds the weights of the step before
from step `warmup` on: the delayed update's staleness alone, at the
benchmark's own scale, next to the DOS runs in the same call.

The object stands in for dos.torch.AdamW in train.py's loop: zero_grad(),
step(), synchronize(), close(), last_step, and `inner` for the lr schedule."""


class TorchReference:
    def __init__(self, torch, groups, lr, betas, delay, warmup, fraction):
        self.torch = torch
        self.params = [p for g in groups for p in g["params"]]
        self.masters = [p.detach().float().clone() for p in self.params]
        it = iter(self.masters)
        master_groups = [{"params": [next(it) for _ in g["params"]],
                          "weight_decay": g["weight_decay"]} for g in groups]
        self.inner = torch.optim.AdamW(master_groups, lr=lr, betas=betas)
        total = sum(p.numel() for p in self.params)
        self.delayed, acc = [], 0
        for p in self.params:
            self.delayed.append(bool(delay) and acc >= (1 - fraction) * total)
            acc += p.numel()
        self.delayed_params = sum(p.numel() for p, d in zip(self.params, self.delayed) if d)
        self.warmup = warmup
        self.steps = 0
        self.last_step = None

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self):
        torch = self.torch
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float() if p.grad is not None else None
            late = self.steps >= self.warmup
            before = [m.clone() if d and late else None
                      for m, d in zip(self.masters, self.delayed)]
            self.inner.step()
            for p, m, b in zip(self.params, self.masters, before):
                p.copy_(b if b is not None else m)
        self.steps += 1
        self.last_step = {"step": self.steps,
                          "delayed_params": self.delayed_params if late else 0}

    def synchronize(self):
        """The last step's weights for every parameter (a delayed run's
        model holds the step before's for the tail until then)."""
        with self.torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def close(self):
        pass
