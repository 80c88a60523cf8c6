"""One run of the convergence benchmark (bench/convergence/run.py starts each
in its own process): the GPT example trained on byte tokens of a text corpus
with dos.torch.AdamW, writing its loss curve, the mean loss over the last
steps and the validation loss as JSON. Imports torch only inside train(), so
that the parent imports this file for RUNS and model_config() alone."""
import json
import math
import sys
import time

# run name: (compact_state, delay)
RUNS = {
    "fp32_exact": (False, 0),
    "fp32_delay": (False, 1),
    "compact_exact": (True, 0),
    "compact_delay": (True, 1),
    "fp32_exact_repeat": (False, 0),  # fp32_exact again: the GPU kernels' run-to-run noise
    # No DOS (reference.py): torch's AdamW on fp32 masters, the delay's
    # staleness simulated on the tail of the parameters.
    "torch_exact": (False, 0),
    "torch_delay": (False, 1),
}
VAL_FRACTION = 0.05  # the corpus's tail held out for validation
VOCAB = 256          # byte tokens


def lr_factor(step, steps, warmup, floor):
    """Linear warm-up over `warmup` steps, then a cosine from 1 down to `floor`
    at the last step (LambdaLR's factor of the base learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def model_config(args):
    """gpt.build's arguments. 350m's 24 x 1024 has 303M parameters with byte
    tokens (its 32000-token embedding and head are most of the rest), so the
    default takes 28 layers: 354M."""
    layers = args.layers
    if layers is None and args.size == "350m":
        layers = 28
    return dict(size=args.size, layers=layers, d_model=args.d_model, heads=args.heads,
                seq=args.seq, vocab=VOCAB)


def sim_fraction(args):
    """The share of the parameters the torch_delay run delays: static:<f>'s
    host path (1 - f of the subgroups, the tail), else a quarter."""
    if args.policy.startswith("static:"):
        return 1.0 - float(args.policy.split(":", 1)[1])
    return 0.25


def split_corpus(data):
    """(train, validation): the validation text is the last VAL_FRACTION."""
    cut = int(len(data) * (1 - VAL_FRACTION))
    return data[:cut], data[cut:]


class Batches:
    """Byte sequences at random offsets of the training text (the same in
    every run: a generator seeded with `seed`), and the validation batches at
    evenly spaced offsets of the held-out text. The text sits on the device;
    a batch is one gather there."""

    def __init__(self, torch, train, val, steps, batch, seq, seed, val_batches, device):
        if len(val) < seq + 2:
            raise ValueError(f"the validation text has {len(val)} bytes, a sequence needs "
                             f"{seq + 1}: give a larger --corpus")
        self.batch = batch
        self.train = torch.frombuffer(bytearray(train), dtype=torch.uint8).to(device)
        self.val = torch.frombuffer(bytearray(val), dtype=torch.uint8).to(device)
        g = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(train) - seq - 1, (steps, batch),
                                     generator=g).to(device)
        self.val_offsets = torch.linspace(0, len(val) - seq - 2,
                                          val_batches * batch).long().to(device)
        self.window = torch.arange(seq + 1, device=device)

    def _take(self, text, offs):
        xy = text[offs[:, None] + self.window].long()
        return xy[:, :-1], xy[:, 1:]

    def step(self, i):
        return self._take(self.train, self.offsets[i])

    def validation(self):
        for offs in self.val_offsets.split(self.batch):
            yield self._take(self.val, offs)


def optimizer_kwargs(args, torch, delay, device):
    """dos.torch.AdamW's keyword arguments that depend on the run."""
    kw = {}
    if delay:  # only then: delay=0 runs work with a client that lacks the option
        kw.update(delay=delay, delay_warmup=args.delay_warmup)
    if device.type != "cuda":
        return kw
    if args.policy == "cpu":
        kw["gpu_budget_bytes"] = 0  # lend dosd nothing: all state stays on the host path
    elif args.gpu_budget_gb:
        kw["gpu_budget_bytes"] = int(args.gpu_budget_gb * 2**30)
    else:
        # Runs sharing a GPU must not each lend what is free when they start.
        total = torch.cuda.get_device_properties(device).total_memory
        kw["gpu_budget_bytes"] = int(0.9 * total / max(1, args.gpu_share))
    return kw


def train(args):
    import torch
    import gpt
    import dos.torch
    run = args.child
    compact, delay = RUNS[run]
    device = torch.device(f"cuda:{args.gpu_index}" if args.device == "cuda" else "cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    res = {"run": run, "compact_state": compact, "delay": delay, "torch": torch.__version__,
           "device": str(device)}
    if cuda:
        res["gpu"] = torch.cuda.get_device_name(device)
    model = gpt.build(**model_config(args), dtype=torch.bfloat16, device=device,
                      checkpoint=args.checkpoint, seed=args.seed)
    nparams = sum(p.numel() for p in model.parameters())
    res.update(params=nparams, **model.cfg)
    with open(args.corpus, "rb") as f:
        train_text, val_text = split_corpus(f.read())
    data = Batches(torch, train_text, val_text, args.steps, args.batch, model.cfg["seq"],
                   args.seed + 1, args.val_batches, device)
    if run.startswith("torch_"):
        from reference import TorchReference
        opt = TorchReference(torch, gpt.param_groups(model, args.weight_decay), args.lr,
                             (0.9, 0.95), delay, args.delay_warmup, sim_fraction(args))
        res.update(delay_warmup=args.delay_warmup, sim_fraction=sim_fraction(args))
        scheduled = opt.inner
    else:
        kw = optimizer_kwargs(args, torch, delay, device)
        res.update({k: v for k, v in kw.items() if k != "delay"})
        opt = dos.torch.AdamW(gpt.param_groups(model, args.weight_decay), lr=args.lr,
                              betas=(0.9, 0.95), socket=args.socket,
                              client_name=f"convergence-{run}", compact_state=compact,
                              model=model, **kw)
        opt.set_policy(args.policy)
        scheduled = opt
    sched = torch.optim.lr_scheduler.LambdaLR(
        scheduled, lambda s: lr_factor(s, args.steps, args.lr_warmup, args.lr_floor))
    delayed_params = []  # per logged step: how many parameters were delayed
    print(f"[{run}] GPT {model.cfg}: {nparams / 1e6:.1f}M parameters, batch {args.batch}, "
          f"{device}, policy {args.policy}, compact_state={compact}, delay={delay}", flush=True)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    # Losses and gradient norms stay on the device until a log line reads
    # them (one synchronisation every --log-every steps).
    losses = torch.zeros(args.steps, device=device)
    norms = torch.zeros(args.steps, device=device)
    skip = min(args.time_skip, args.steps - 1)  # registration, allocator, first steps
    t0 = t_skip = time.perf_counter()
    for i in range(args.steps):
        if i == skip:
            sync()
            t_skip = time.perf_counter()
        x, y = data.step(i)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        losses[i] = loss.detach()
        norms[i] = norm.detach()
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            delayed_params.append((opt.last_step or {}).get("delayed_params", 0))
            done = i + 1 - skip
            rate = f"{(time.perf_counter() - t_skip) / done:.3f} s/step" if done > 0 else \
                f"timed from step {skip}"
            print(f"[{run}] step {i + 1:5d} loss {losses[i].item():.4f} "
                  f"lr {sched.get_last_lr()[0]:.2e} ({rate})", flush=True)
    sync()
    t_end = time.perf_counter()
    opt.synchronize()  # the last (possibly delayed) update is in the weights
    with torch.no_grad():
        val = torch.stack([model(x, y).float() for x, y in data.validation()])
    loss_list = [round(v, 4) for v in losses.tolist()]
    window = min(args.window, args.steps)
    res.update(
        losses=loss_list, grad_norms=[round(v, 4) for v in norms.tolist()],
        last_mean=sum(losses.tolist()[-window:]) / window, window=window,
        val_loss=val.mean().item(), val_tokens=val.numel() * args.batch * model.cfg["seq"],
        step_s=(t_end - t_skip) / max(1, args.steps - skip), train_s=t_end - t0,
        first_loss=loss_list[0], last_loss=loss_list[-1], delayed_params=delayed_params)
    if cuda:
        res["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    print(f"[{run}] mean loss over the last {window} steps {res['last_mean']:.4f}, "
          f"validation {res['val_loss']:.4f}, {res['step_s']:.3f} s/step", flush=True)
    opt.close()
    return res


def main(args):
    """train(), its record written to --child-out; an exception is written
    there as {"error"} (a client without the delay option fails with a
    TypeError that names it) before the traceback is printed and the exit
    status is 1."""
    try:
        res = train(args)
    except Exception as e:  # noqa: BLE001 (any failure is reported, then exit 1)
        import traceback
        text = traceback.format_exc()
        res = {"run": args.child, "error": f"{type(e).__name__}: {e}"[:4000],
               "traceback": text[-4000:]}
        sys.stderr.write(text)
    with open(args.child_out, "w") as f:
        json.dump(res, f)
    return 1 if "error" in res else 0
