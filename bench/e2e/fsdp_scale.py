#!/usr/bin/env python3
"""One node, several GPUs, one dosd: a large GPT sharded with FSDP2, its Adam
state in dosd (issue 27: the paper's 20B model on two H200s).

Run under torchrun, one process per GPU. Every rank builds the GPT of
client/python/examples/gpt.py (pre-norm blocks, activation checkpointing per
block, untied head) on the meta device, shards it with FSDP2 (`fully_shard`
per block, then the root), materialises only its own shard and initialises it
(each parameter drawn whole on the device, one at a time, and this rank's
chunk kept: the same values whatever the world size), then trains with one of

  compact         dos.torch.AdamW(compact_state=True): dosd holds the fp32
                  master and bf16 exp_avg / exp_avg_sq, 8 bytes a parameter
  fp32            dos.torch.AdamW(): fp32 master and moments, 12 bytes
  reference       everything on the GPUs, as FSDP2 trains without DOS: fp32
                  sharded parameters (the masters), bf16 compute through
                  MixedPrecisionPolicy (fp32 gradient reduction), and
                  torch.optim.AdamW(fused=True); ~16 bytes a parameter on the
                  GPUs, so at 20B it does not fit two H200s: run it at a
                  smaller shape of the same width
  reference_bf16  bf16 parameters and bf16 Adam state all on the GPUs,
                  torch.optim.AdamW(fused=True) (~8 bytes a parameter: the
                  20B shape fits, with lower-precision optimizer state)

each rank attached to the same dosd (one session per rank, registering its
local shard). bf16 weights and gradients on CUDA (fp32 on the CPU: gloo in
torch 1.x has no bf16 collectives), clip_grad_norm_ 1.0, a learnable synthetic
corpus (counting sequences with a random start and stride over the first
--corpus-vocab token ids, each rank its own), --warmup synchronised
iterations, then --iters back to back.

Without fully_shard (torch < 2.4, e.g. torch 1.13 on the CPU CI machine)
--wrap auto falls back to DDP and says so (printed and in the record's
`wrap_reason`): every rank then holds and registers the whole model, so the
figures are not FSDP2's, but the rest (ranks, one dosd, measurement, JSON) is
the same code. --wrap fsdp2 refuses to fall back.

Rank 0 merges its record into bench/results/fsdp_<machine>_<date>[_<tag>].json
(one file per call of the driver; a run's record replaces the one of the same
name) and recomputes the figures from all records there (name = <label>_x<world>):

  e2e_iter_s_<name>          median of the back-to-back iterations' times (s)
  e2e_tokens_per_s_<name>    batch x seq x world / that median
  e2e_tflops_per_gpu_<name>  model FLOPs per iteration / median / world, where
                             model FLOPs = 6 N T + 12 L s d T (N: parameters
                             but the token and position embeddings, T: tokens
                             per iteration, L layers, s seq, d d_model; the
                             second term is attention's QK^T and AV, counted
                             whole as if not causal; recomputation from
                             checkpointing is not counted: model FLOPs)
  e2e_gpu_peak_gib_<name>    the largest device-wide peak over the GPUs (every
                             process on the device, dosd's staging included;
                             per device in the run's record)
  e2e_dosd_host_gib_<name>   dosd's VmHWM (from /proc/<pid>/status, --dosd-pid
                             or $DOS_DOSD_PID; VmRSS, RssShmem in the record)
  e2e_register_s_<name>      constructing the optimizer (registration), slowest rank
  e2e_{first,last}_loss_<name>  loss averaged over the ranks, first warm-up and
                             last timed iteration
  tflops_ratio_<dos>_to_<reference>  for every DOS run and reference run in the file
  largest_model_params_<fmt>_x<world>  runs labelled largest_<fmt> (the driver's
                             search), with the host-memory arithmetic that limits it

--plan-largest prints that arithmetic without training: for fp32 and compact
state, the most layers of --d-model whose state fits the node's MemAvailable
(dosd holds 12 or 8 bytes a parameter, plus its overhead, the trainers and a
margin) and whose bf16 weights and gradients (4 bytes a parameter, sharded)
and activations fit each GPU, as JSON.

  dosd --socket=/tmp/dos.sock & export DOS_SOCKET=/tmp/dos.sock DOS_DOSD_PID=$!
  torchrun --standalone --nproc_per_node=2 bench/e2e/fsdp_scale.py               # 20B, compact
  torchrun --standalone --nproc_per_node=2 bench/e2e/fsdp_scale.py --optimizer reference \\
      --layers 28 --label ref28
  python3 bench/e2e/fsdp_scale.py --plan-largest --world 2
  # CPU smoke (gloo, tiny shape):
  torchrun --standalone --nproc_per_node=2 bench/e2e/fsdp_scale.py --device cpu --layers 2 \\
      --d-model 64 --heads 4 --seq 32 --vocab 256 --batch 4 --machine vm-cpu

bench/e2e/run_fsdp_x2.sh runs the whole GPU call.
"""
import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import largest  # noqa: E402 (gpt_params, activation_bytes, mem_available)
import run as e2e  # noqa: E402 (REPO and the paths to gpt.py and dos; GpuSampler, git_commit)

GiB = 2**30
OPTIMIZERS = ("compact", "fp32", "reference", "reference_bf16")
STATE_BYTES = {"fp32": 12, "compact": 8}  # dosd's host bytes of state a parameter
DEFAULT_SHAPE = dict(layers=48, d_model=6144, heads=48, seq=2048, vocab=32000)  # 22.1B


# ------------------------------------------------------------ arithmetic ----

def model_flops(cfg, tokens):
    """Model FLOPs of one training iteration (forward and backward) over
    `tokens` tokens: 6 N T for the matrix multiplications of N parameters (all
    but the embedding lookups) and 12 L s d T for attention's two
    sequence-by-sequence products, counted whole (not halved for the causal
    mask), without recomputation."""
    L, d, s, v = cfg["layers"], cfg["d_model"], cfg["seq"], cfg["vocab"]
    n = largest.gpt_params(L, d, s, v) - v * d - s * d  # less the token and position embeddings
    return 6 * n * tokens + 12 * L * s * d * tokens


class HostPlan:
    """What a shape needs of the node: dosd's state (bytes_per_param x P) plus
    its overhead, the trainers' own host memory and a margin, against
    MemAvailable; each GPU holds its share of the bf16 weights and gradients
    (4 B x P / world), two unsharded blocks in flight (FSDP2's all-gather and
    prefetch) and the activations of one rank (largest.activation_bytes)."""

    def __init__(self, mem_available, world, gpu_bytes, dosd_overhead=3.5 * GiB,
                 trainer_host=3 * GiB, margin=4 * GiB, gpu_extra=8 * GiB):
        self.mem_available, self.world, self.gpu_bytes = mem_available, world, gpu_bytes
        self.dosd_overhead, self.trainer_host, self.margin = dosd_overhead, trainer_host, margin
        self.gpu_extra = gpu_extra  # allocator reserve, NCCL buffers, dosd's staging and context

    def host_need(self, fmt, params):
        return STATE_BYTES[fmt] * params + self.dosd_overhead + \
            self.world * self.trainer_host + self.margin

    def state_limit(self):
        """dosd's --host_memory_limit: the state the node allows."""
        return int(max(0, self.mem_available - self.dosd_overhead -
                       self.world * self.trainer_host - self.margin))

    def gpu_need(self, layers, d, seq, batch, vocab):
        p = largest.gpt_params(layers, d, seq, vocab)
        block = 12 * d * d * 2 * 2  # one unsharded block's bf16 weights and gradients
        return 4 * p / self.world + 2 * block + \
            largest.activation_bytes(layers, d, seq, batch, vocab) + self.gpu_extra

    def largest(self, fmt, d, seq, batch, vocab, max_layers=400):
        """(layers, what the next layer exceeds)."""
        for layers in range(1, max_layers + 1):
            p = largest.gpt_params(layers, d, seq, vocab)
            over = []
            if self.host_need(fmt, p) > self.mem_available:
                over.append("host memory")
            if self.gpu_bytes and self.gpu_need(layers, d, seq, batch, vocab) > self.gpu_bytes:
                over.append("GPU memory")
            if over:
                return layers - 1, over
        return max_layers, ["--max-layers"]

    def explain(self, fmt, layers, d, seq, batch, vocab):
        p = largest.gpt_params(layers, d, seq, vocab)
        return {"format": fmt, "layers": layers, "d_model": d, "params": p,
                "state_bytes_per_param": STATE_BYTES[fmt],
                "state_gib": round(STATE_BYTES[fmt] * p / GiB, 2),
                "host_need_gib": round(self.host_need(fmt, p) / GiB, 2),
                "mem_available_gib": round(self.mem_available / GiB, 2),
                "gpu_need_gib": round(self.gpu_need(layers, d, seq, batch, vocab) / GiB, 2),
                "gpu_gib": round(self.gpu_bytes / GiB, 2) if self.gpu_bytes else None}


def plan_largest(args):
    """--plan-largest: the arithmetic per state format, printed and as JSON."""
    avail = int(args.mem_available_gib * GiB) if args.mem_available_gib is not None \
        else largest.mem_available()
    gpu = int(args.gpu_gib * GiB) if args.gpu_gib is not None else gpu_total_bytes()
    plan = HostPlan(avail, args.world, gpu)
    out = {"mem_available_gib": round(avail / GiB, 2), "world": args.world,
           "gpu_gib": round(gpu / GiB, 2) if gpu else None,
           "state_limit_bytes": plan.state_limit(), "formats": {}}
    shape = (args.d_model, args.seq, args.batch, args.vocab)
    for fmt in ("fp32", "compact"):
        layers, over = plan.largest(fmt, *shape)
        fit, nxt = plan.explain(fmt, layers, *shape), plan.explain(fmt, layers + 1, *shape)
        out["formats"][fmt] = {"layers": layers, "params": fit["params"],
                               "limit": " and ".join(over), "fits": fit, "next": nxt}
        print(f"{fmt:8s}: {layers} x {args.d_model} = {fit['params'] / 1e9:.2f}B parameters: "
              f"{fit['state_bytes_per_param']} B x P = {fit['state_gib']} GiB of state in dosd "
              f"+ {plan.dosd_overhead / GiB:.1f} dosd + {args.world} x "
              f"{plan.trainer_host / GiB:.1f} trainers + {plan.margin / GiB:.1f} margin = "
              f"{fit['host_need_gib']} GiB <= MemAvailable {out['mem_available_gib']} GiB; "
              f"GPU {fit['gpu_need_gib']} GiB of {out['gpu_gib']} per device. "
              f"{layers + 1} layers ({nxt['params'] / 1e9:.2f}B) need {nxt['host_need_gib']} GiB "
              f"host, {nxt['gpu_need_gib']} GiB GPU: limit {' and '.join(over)}", flush=True)
    print(json.dumps(out))
    return 0


def gpu_total_bytes():
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    except ImportError:
        pass
    return 0


# ------------------------------------------------------------- the model ----

def fsdp2_api():
    """(fully_shard, MixedPrecisionPolicy or None, None), or (None, None,
    why not) where this torch has no FSDP2."""
    import torch
    for mod in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            m = __import__(mod, fromlist=["fully_shard"])
        except Exception:  # ImportError, or a broken import on this Python
            continue
        if hasattr(m, "fully_shard"):
            return m.fully_shard, getattr(m, "MixedPrecisionPolicy", None), None
    return None, None, (f"torch {torch.__version__} has no FSDP2 (fully_shard, torch >= 2.4)")


def local_of(p):
    """A DTensor's local shard (sharing its storage), else the tensor itself."""
    if hasattr(p, "device_mesh"):
        return p._local_tensor if hasattr(p, "_local_tensor") else p.to_local()
    return p


def init_weights(model, layers, seed, rank, world, device):
    """gpt.py's initialisation, drawn whole per parameter on `device` (fp32,
    a generator seeded per parameter) and this rank's dim-0 chunk kept, as
    FSDP2 shards (torch.chunk over the ranks): the values do not depend on the
    wrapping or the world size, and no rank ever holds more than one whole
    parameter beyond its shard."""
    import torch
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            local = local_of(p)
            if name.endswith("bias"):
                local.zero_()
                continue
            if ".ln" in name or name.startswith("ln"):
                local.fill_(1.0)
                continue
            # GPT-2's scaled init of the residual projections (gpt.GPT)
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) \
                else 0.02
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
            full = torch.randn(tuple(p.shape), generator=g, device=device).mul_(std)
            if local is not p:  # a shard: this rank's chunk of dim 0
                chunks = torch.chunk(full, world, dim=0)
                full = chunks[rank] if rank < len(chunks) else full[:0]
                if full.shape != local.shape:
                    raise RuntimeError(f"init {name}: shard {tuple(local.shape)} is not "
                                       f"torch.chunk's {tuple(full.shape)} (FSDP2 sharding "
                                       "changed?)")
            local.copy_(full)
            del full


def build_model(args, cfg, device, rank, world, wrap):
    """The GPT, wrapped: returns (model to train, the inner GPT)."""
    import torch
    import gpt
    ref32 = args.optimizer == "reference"  # fp32 masters as the parameters
    dtype = torch.float32 if (ref32 or args.device == "cpu") else torch.bfloat16
    if wrap == "fsdp2":
        fully_shard, mp_policy, _ = fsdp2_api()
        with torch.device("meta"):
            model = gpt.GPT(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["seq"],
                            cfg["vocab"], checkpoint=True)
        model.to(dtype)
        kw = {}
        if ref32 and args.device == "cuda":
            if mp_policy is None:
                raise SystemExit("reference: this torch's FSDP2 has no MixedPrecisionPolicy")
            kw["mp_policy"] = mp_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # The mesh on this run's device: fully_shard's default mesh is CUDA's
        # wherever CUDA exists, also for a CPU run.
        from torch.distributed.device_mesh import init_device_mesh
        kw["mesh"] = init_device_mesh(args.device, (world,))
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
        model.to_empty(device=device)
        init_weights(model, cfg["layers"], args.seed, rank, world, device)
        model.cfg = dict(cfg)
        return model, model
    model = gpt.build("tiny", cfg["layers"], cfg["d_model"], cfg["heads"], cfg["seq"],
                      cfg["vocab"], dtype=dtype, device=device, checkpoint=True,
                      seed=args.seed, init_in_dtype=True)
    init_weights(model, cfg["layers"], args.seed, 0, 1, device)
    if wrap == "ddp":
        ids = [torch.cuda.current_device()] if args.device == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids), model
    return model, model


def pick_wrap(requested, world):
    """(wrap, reason): FSDP2 where this torch has it; --wrap auto falls back
    to DDP with the reason; --wrap fsdp2 without it is an error."""
    fully_shard, _, why = fsdp2_api()
    if requested == "auto":
        if fully_shard is not None:
            return "fsdp2", "fully_shard available"
        return "ddp", f"{why}: fell back to DDP (every rank holds and registers the whole model)"
    if requested == "fsdp2" and fully_shard is None:
        raise SystemExit(f"--wrap fsdp2: {why}; use --wrap auto or ddp")
    return requested, "requested"


# ------------------------------------------------------------ measuring ----

def proc_status(pid):
    """dosd's memory from /proc/<pid>/status, in bytes (VmHWM, VmRSS,
    RssAnon, RssShmem), or {} where it cannot be read."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def dosctl_host_state(dosctl, sock):
    """dosd's own count of host state bytes (`dosctl --json stats`), or None."""
    if not dosctl or not sock:
        return None
    try:
        out = subprocess.run([dosctl, f"--socket={sock}", "--json", "stats"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(json.loads(out).get("host_state_bytes", 0))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def make_optimizer(args, inner, rank):
    """(optimizer, note); registration happens here for DOS."""
    import torch
    import gpt
    groups = gpt.param_groups(inner, 0.1)
    kw = dict(lr=args.lr, betas=(0.9, 0.95))
    if args.optimizer in STATE_BYTES:
        import dos.torch
        opt = dos.torch.AdamW(groups, socket=args.socket, compact_state=args.optimizer == "compact",
                              client_name=f"fsdp-{args.label}-{rank}",
                              subgroup_size=args.subgroup_size, **kw)
        return opt, f"dos.torch.AdamW(compact_state={args.optimizer == 'compact'})"
    fused = args.device == "cuda" and args.fused
    try:
        opt = torch.optim.AdamW(groups, fused=fused, **kw) if fused else \
            torch.optim.AdamW(groups, **kw)
    except (TypeError, RuntimeError) as e:  # no fused AdamW for these tensors
        opt = torch.optim.AdamW(groups, **kw)
        fused = f"no ({type(e).__name__}: {e})"[:200]
    return opt, f"torch.optim.AdamW(fused={fused})"


def corpus(steps, batch, seq, k, seed, device):
    """Batches of counting sequences over the first k token ids (random start
    and stride 1..4 a sequence: the next token follows from the previous two)
    (gpt.batches with k for its vocabulary). Over the whole
    32000-token vocabulary each token is a target a few times a batch and
    10-odd Adam steps at lr 3e-4 do not lower the loss (measured: it rises);
    over k = 256 the unigram alone is learnt within a few steps (9.0 -> 5.7 in
    12 steps at d_model 192 with the learning rate scaled by 6144/192), then
    the counting. The cost per token is the same: the head still scores the
    whole vocabulary."""
    import gpt
    return gpt.batches(steps, batch, seq, k, seed=seed, device=device)


def train(args, model, opt, cfg, device, rank):
    """Warm-up (synchronised), then --iters back to back; returns
    (per-iteration host times of the timed ones, losses as tensors)."""
    import torch
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    data = corpus(args.warmup + args.iters, args.batch, cfg["seq"],
                  min(cfg["vocab"], args.corpus_vocab), seed=1 + rank, device=device)
    losses, times = [], []

    def step(x, y):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.detach())

    data = list(data)
    for it, (x, y) in enumerate(data[:args.warmup]):
        t = time.perf_counter()
        step(x, y)
        sync()
        if rank == 0:
            print(f"  warm-up {it}: {time.perf_counter() - t:.2f} s, loss "
                  f"{losses[-1].item():.4f}", flush=True)
    # Back to back, as training runs: the host runs at most a step ahead, so
    # each iteration's time is taken at its end on the host, and the last one
    # also carries the drain (synchronised) at the end.
    prev = time.perf_counter()
    for x, y in data[args.warmup:]:
        step(x, y)
        now = time.perf_counter()
        times.append(now - prev)
        prev = now
    sync()
    times[-1] += time.perf_counter() - prev
    return times, losses


def run(args):
    import torch
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    wrap, wrap_reason = pick_wrap(args.wrap, world)
    if rank == 0 and wrap_reason != "requested":
        print(f"fsdp_scale: wrap {wrap} ({wrap_reason})", flush=True)
    cfg = {k: getattr(args, k) for k in DEFAULT_SHAPE}
    params = largest.gpt_params(cfg["layers"], cfg["d_model"], cfg["seq"], cfg["vocab"])
    if args.label is None:
        shape = "20b" if cfg == DEFAULT_SHAPE else f"{cfg['layers']}x{cfg['d_model']}"
        args.label = shape + ("" if args.optimizer == "compact" else f"_{args.optimizer}")
    mem_avail0 = largest.mem_available()  # before anything registers
    if rank == 0:
        print(f"fsdp_scale {args.label}: {cfg['layers']} x {cfg['d_model']} "
              f"({largest.billions(params)} parameters), {args.optimizer}, {wrap} over {world} "
              f"rank(s) on {args.device}, batch {args.batch} x seq {cfg['seq']} a rank", flush=True)
    sampler = e2e.GpuSampler(torch, local) if cuda else None
    t0 = time.perf_counter()
    model, inner = build_model(args, cfg, device, rank, world, wrap)
    if cuda:
        torch.cuda.synchronize()
    model_init_s = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    opt, note = make_optimizer(args, inner, rank)
    register_s = time.perf_counter() - t0
    if hasattr(opt, "_entries"):
        registered = sum(e.local.numel() for e in opt._entries)
    else:
        registered = sum(local_of(p).numel() for p in inner.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats(local)
    times, losses = train(args, model, opt, cfg, device, rank)
    loss = torch.stack([v.float() for v in losses])
    dist.all_reduce(loss)
    loss = (loss / world).tolist()
    rec = {"rank": rank, "registered_params": registered, "register_s": register_s,
           "model_init_s": model_init_s, "iter_times_s": [round(t, 4) for t in times],
           "host_peak_bytes": e2e.vm_hwm_bytes()}
    if cuda:
        sampler.close()
        rec.update(gpu_peak_device_bytes=sampler.peak,
                   gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(local),
                   gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(local),
                   gpu_name=torch.cuda.get_device_name(local))
    dosd = {}
    if rank == 0 and args.optimizer in STATE_BYTES:  # before close() frees the state
        dosd = proc_status(args.dosd_pid) if args.dosd_pid else {}
        state = dosctl_host_state(args.dosctl, args.socket)
        if state is not None:
            dosd["host_state_bytes"] = state
    recs = [None] * world
    dist.all_gather_object(recs, rec)
    if args.optimizer in STATE_BYTES:
        opt.close()
    if rank == 0:
        plan = HostPlan(mem_avail0, world, gpu_total_bytes())
        doc = record(args, cfg, params, world, wrap, wrap_reason, note, recs, loss, dosd, plan)
        path = merge(args, doc)
        print(f"wrote {path}", flush=True)
    # Every rank has everything it was sent before any leaves: a rank that
    # exits while a peer still waits for its last message would hang the peer.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def record(args, cfg, params, world, wrap, wrap_reason, note, recs, loss, dosd, plan):
    """This run's record (rank 0, from every rank's figures)."""
    per_iter = [max(ts) for ts in zip(*(r["iter_times_s"] for r in recs))]  # slowest rank
    med = statistics.median(per_iter)
    tokens = args.batch * cfg["seq"] * world
    flops = model_flops(cfg, tokens)
    k = 3 if len(loss) >= 6 else 1
    out = {"name": f"{args.label}_x{world}", "label": args.label, "optimizer": args.optimizer,
           "note": note, "wrap": wrap, "wrap_reason": wrap_reason, "world": world,
           "device": args.device, "params": params, **cfg, "batch_per_rank": args.batch,
           "tokens_per_iter": tokens, "warmup": args.warmup, "iters": args.iters,
           "lr": args.lr, "clip": args.clip, "corpus_vocab": min(cfg["vocab"], args.corpus_vocab),
           "iter_s_median": round(med, 6), "iter_s_mean": round(statistics.mean(per_iter), 6),
           "tokens_per_s": round(tokens / med, 1),
           "model_flops_per_iter": flops,
           "tflops_per_gpu": float(f"{flops / med / world / 1e12:.4g}"),
           "flops_formula": "6*N*T + 12*L*seq*d_model*T (N: params less token and position "
                            "embeddings; T: tokens per iteration over all ranks; per GPU: / world)",
           "register_s": round(max(r["register_s"] for r in recs), 3),
           "register_s_per_rank": [round(r["register_s"], 3) for r in recs],
           "model_init_s": round(max(r["model_init_s"] for r in recs), 2),
           "registered_params_per_rank": [r["registered_params"] for r in recs],
           "trainer_host_peak_gib_per_rank": [round(r["host_peak_bytes"] / GiB, 2) for r in recs],
           "losses": [round(v, 5) for v in loss], "first_loss": round(loss[0], 5),
           "last_loss": round(loss[-1], 5),
           "loss_first3_mean": round(statistics.mean(loss[:k]), 5),
           "loss_last3_mean": round(statistics.mean(loss[-k:]), 5),
           "iter_times_s": per_iter}
    out["loss_went_down"] = out["loss_last3_mean"] < out["loss_first3_mean"]
    if "gpu_peak_device_bytes" in recs[0]:
        out.update(gpu=recs[0]["gpu_name"],
                   gpu_peak_device_gib_per_rank=[round(r["gpu_peak_device_bytes"] / GiB, 2)
                                                 for r in recs],
                   gpu_peak_allocated_gib_per_rank=[round(r["gpu_peak_allocated_bytes"] / GiB, 2)
                                                    for r in recs],
                   gpu_peak_reserved_gib_per_rank=[round(r["gpu_peak_reserved_bytes"] / GiB, 2)
                                                   for r in recs])
    if args.optimizer in STATE_BYTES:
        out["dosd_gib"] = {k: round(v / GiB, 3) for k, v in dosd.items()}
        out["dosd_memory_source"] = (f"/proc/{args.dosd_pid}/status" if args.dosd_pid else
                                     "none (give --dosd-pid or $DOS_DOSD_PID)") + \
            (" and dosctl --json stats" if "host_state_bytes" in dosd else "")
        # What limits this size: the arithmetic at this shape and the next layer.
        shape = (cfg["d_model"], cfg["seq"], args.batch, cfg["vocab"])
        fmt = args.optimizer
        out["host_arithmetic"] = {"this": plan.explain(fmt, cfg["layers"], *shape),
                                  "next_layer": plan.explain(fmt, cfg["layers"] + 1, *shape),
                                  "largest_predicted": plan.largest(fmt, *shape)[0]}
    return out


def metrics_of(runs):
    """The figures of every run in the file, ratios and largest sizes included."""
    res = []
    for name, r in runs.items():
        res += [{"name": f"e2e_iter_s_{name}", "value": r["iter_s_median"], "unit": "s"},
                {"name": f"e2e_tokens_per_s_{name}", "value": r["tokens_per_s"],
                 "unit": "tokens/s"},
                {"name": f"e2e_tflops_per_gpu_{name}", "value": r["tflops_per_gpu"],
                 "unit": "TFLOP/s"},
                {"name": f"e2e_register_s_{name}", "value": r["register_s"], "unit": "s"},
                {"name": f"e2e_first_loss_{name}", "value": r["first_loss"], "unit": "loss"},
                {"name": f"e2e_last_loss_{name}", "value": r["last_loss"], "unit": "loss"}]
        if r.get("gpu_peak_device_gib_per_rank"):
            res.append({"name": f"e2e_gpu_peak_gib_{name}",
                        "value": max(r["gpu_peak_device_gib_per_rank"]), "unit": "GiB"})
        if r.get("dosd_gib", {}).get("VmHWM"):
            res.append({"name": f"e2e_dosd_host_gib_{name}", "value": r["dosd_gib"]["VmHWM"],
                        "unit": "GiB"})
        if r["label"].startswith("largest_") and r["optimizer"] in STATE_BYTES:
            res.append({"name": f"largest_model_params_{r['optimizer']}_x{r['world']}",
                        "value": r["params"], "unit": "params"})
    for dn, d in runs.items():
        for rn, ref in runs.items():
            if d["optimizer"] in STATE_BYTES and ref["optimizer"] not in STATE_BYTES:
                res.append({"name": f"tflops_ratio_{dn}_to_{rn}",
                            "value": round(d["tflops_per_gpu"] / ref["tflops_per_gpu"], 3),
                            "unit": "x"})
    return res


def merge(args, rec):
    """Adds `rec` to the call's result file (replacing a run of the same
    name), recomputes the figures, redraws the chart; returns the path."""
    date = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"fsdp_{args.machine}_{date}{suffix}.json")
    doc = {"runs": {}}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    doc["runs"][rec["name"]] = rec
    host = {"cpus": os.cpu_count(), "mem_total_gib": round(mem_total() / GiB, 1)}
    doc.update(machine=args.machine, date=date, commit=e2e.git_commit(), host=host,
               results=metrics_of(doc["runs"]))
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
    for m in doc["results"]:
        if rec["name"] in m["name"]:
            print(f"  {m['name']} = {m['value']} {m['unit']}")
    print(f"  loss {rec['first_loss']:.4f} -> {rec['last_loss']:.4f} (mean of first/last 3: "
          f"{rec['loss_first3_mean']:.4f} -> {rec['loss_last3_mean']:.4f})")
    chart(doc, os.path.splitext(path)[0] + ".png")
    return path


def mem_total():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def chart(doc, path):
    """Model TFLOPS per GPU per run, one bar each (where matplotlib is installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = list(doc["runs"].values())
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(runs) + 1.6))
    names = [r["name"] for r in runs]
    ax.barh(names, [r["tflops_per_gpu"] for r in runs],
            color=["#c44e52" if r["optimizer"] in STATE_BYTES else "#4c72b0" for r in runs])
    for i, r in enumerate(runs):
        ax.text(r["tflops_per_gpu"], i, f" {r['params'] / 1e9:.1f}B, {r['optimizer']}, "
                f"{r['iter_s_median']:.2f} s/iter, {r['tokens_per_s']:.0f} tok/s", va="center",
                fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("model TFLOP/s per GPU (6NT + 12LsdT)")
    ax.set_title(f"{doc['machine']} {doc['date']}: FSDP2, one dosd")
    ax.set_xlim(0, max(r["tflops_per_gpu"] for r in runs) * 1.8 or 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main ----

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"],
                    help="default cuda where there is one")
    ap.add_argument("--layers", type=int, default=DEFAULT_SHAPE["layers"])
    ap.add_argument("--d-model", type=int, default=DEFAULT_SHAPE["d_model"])
    ap.add_argument("--heads", type=int, default=None, help="default d_model / 128")
    ap.add_argument("--seq", type=int, default=DEFAULT_SHAPE["seq"])
    ap.add_argument("--vocab", type=int, default=DEFAULT_SHAPE["vocab"])
    ap.add_argument("--batch", type=int, default=2, help="sequences a rank per iteration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--corpus-vocab", type=int, default=256,
                    help="token ids the synthetic corpus uses (the model's vocabulary stays)")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", default="compact", choices=OPTIMIZERS)
    ap.add_argument("--wrap", default="auto", choices=["auto", "fsdp2", "ddp"],
                    help="auto: FSDP2 where torch has it, else DDP (said why)")
    ap.add_argument("--no-fused", dest="fused", action="store_false",
                    help="reference modes: torch.optim.AdamW without fused=True")
    ap.add_argument("--subgroup-size", type=int, default=0, help="dosd subgroup size (0: its own)")
    ap.add_argument("--socket", default=os.environ.get("DOS_SOCKET"))
    ap.add_argument("--dosd-pid", type=int, default=int(os.environ.get("DOS_DOSD_PID", "0")),
                    help="dosd's pid, to read its memory from /proc (default $DOS_DOSD_PID)")
    ap.add_argument("--dosctl", default=os.environ.get("DOS_DOSCTL") or shutil.which("dosctl"))
    ap.add_argument("--label", default=None,
                    help="run name before _x<world> (default 20b or <layers>x<d_model>, plus "
                         "_<optimizer> unless compact; largest_<fmt> marks a largest size)")
    ap.add_argument("--machine", default=os.environ.get("DOS_MACHINE"))
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--out", default=os.path.join(e2e.REPO, "bench", "results"))
    ap.add_argument("--plan-largest", action="store_true",
                    help="print the largest sizes' memory arithmetic (JSON last line); no training")
    ap.add_argument("--world", type=int, default=2, help="--plan-largest: GPUs")
    ap.add_argument("--mem-available-gib", type=float, default=None,
                    help="--plan-largest: host memory to plan with (default MemAvailable)")
    ap.add_argument("--gpu-gib", type=float, default=None,
                    help="--plan-largest: memory of one GPU (default this machine's)")
    args = ap.parse_args(argv)
    if args.heads is None:
        args.heads = max(1, args.d_model // 128)
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    return args


def main(argv=None):
    import faulthandler
    import signal
    try:
        faulthandler.register(signal.SIGUSR1)  # a hung rank shows where it waits
    except (AttributeError, ValueError, OSError):  # stderr without a descriptor (pytest)
        pass
    args = parse_args(argv)
    if args.plan_largest:
        return plan_largest(args)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.optimizer in STATE_BYTES and not args.socket:
        raise SystemExit("give --socket or $DOS_SOCKET (a running dosd)")
    if args.machine is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        args.machine = "vm-cpu" if args.device == "cpu" else \
            "nvidia-h200" + (f"-x{world}" if world > 1 else "")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
