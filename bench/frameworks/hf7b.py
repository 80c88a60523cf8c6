#!/usr/bin/env python3
"""A real job at the scale users bring: the Hugging Face Trainer fine-tuning a
Llama-2-7B-shaped model (issue 22), with the optimizer state never copied
into the trainer.

One process per run (a fresh dosd session each, and a clean host-memory
reading):

  hf7b.py --mode dos|dos_compact|all_gpu --size 7b --steps 12 --sink --out R.json
      trains `steps` steps through Trainer.train() (accelerate's prepare, the
      trainer's own loop, max_grad_norm=1.0, gradient checkpointing, batch
      1 x 2048, bf16 weights), then streams torch.save(opt.state_dict()) into
      /dev/null (the disk cannot hold a 7B checkpoint); samples the trainer's
      RssAnon, dosd's RSS and the device's used memory throughout; records
      where the launch thread spent each steady step (phases_s: forward and
      backward to the Trainer's on_pre_optimizer_step, step(), the rest of
      the step, the Trainer's work between steps; medians).
  hf7b.py --mode dos --size 2b --roundtrip save|resume --workdir W --out R.json
      the full round trip: save_steps mid-run, then a new process with
      resume_from_checkpoint; the resumed losses must equal the first run's.
  hf7b.py --mode dos|dos_compact --delay 1 [--delay-warmup 2] ...
      the one-step delayed update (issue 23: dos.torch.AdamW(delay=1), the
      host path's subgroups updated during the next forward and backward);
      dosd's report on each step, read without waiting where the Clock
      callback times the step, gives the planner's predicted iteration time
      (predicted_iter_s, median of the timed steps) beside the measured one.

The DOS modes cap the trainer at --gpu-cap-gib (74 GiB) of the GPU: DOS's
state lives in dosd's host memory and its GPU lease comes out of that cap.
all_gpu is torch.optim.AdamW(fused=True) with its state on the GPU and no cap.
Resuming needs no extra line: a DOS optimizer makes HF's torch.load of
optimizer.pt map the file (dos/_mmapload.py); the all-GPU run maps it too
(mmap_loads), so both read the file the same way.
"""
import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

# dosd's report on a step with delay= (issue 23) and its medians: the e2e
# benchmark's (bench/e2e/run.py), one definition for both.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from run import DELAY_KEYS, delay_figures  # noqa: E402

SIZES = {  # layers, hidden, intermediate, heads
    "7b": (32, 4096, 11008, 32),
    "3b": (26, 3200, 8640, 25),
    "2b": (28, 2560, 6912, 20),
    "tiny": (2, 256, 688, 4),
}
GiB = 2**30


def status_kb(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """Peaks of the trainer's RssAnon, dosd's VmRSS and the GPU's used memory
    (cudaMemGetInfo: every process on the device), every 0.2 s."""

    def __init__(self, dosd_pid):
        self.dosd_pid = dosd_pid
        self.peak = {"trainer_rss_anon": 0, "dosd_rss": 0, "gpu_used": 0}
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def sample(self):
        p = self.peak
        p["trainer_rss_anon"] = max(p["trainer_rss_anon"], status_kb("self", "RssAnon"))
        if self.dosd_pid:
            p["dosd_rss"] = max(p["dosd_rss"], status_kb(self.dosd_pid, "VmRSS"))
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            p["gpu_used"] = max(p["gpu_used"], total - free)

    def run(self):
        while not self.stop.wait(0.2):
            self.sample()

    def mark(self):
        self.sample()
        return dict(self.peak)

    def close(self):
        self.stop.set()
        self.t.join()
        return self.mark()


def cpu_seconds(pid):
    """CPU time (user and system) of a process so far, from /proc/PID/stat; None: unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            u, s = f.read().rsplit(")", 1)[1].split()[11:13]
        return (int(u) + int(s)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def dosd_pid_of(socket):
    if os.environ.get("DOS_DOSD_PID"):
        return int(os.environ["DOS_DOSD_PID"])
    try:
        out = subprocess.run(["pgrep", "-f", "--", f"--socket={socket}"], capture_output=True,
                             text=True).stdout.split()
        return int(out[0]) if out else 0
    except (OSError, ValueError):
        return 0


def mmap_loads():
    """torch.load maps checkpoint files instead of reading them whole (for
    the all-GPU run; a DOS optimizer maps optimizer.pt by itself)."""
    try:
        import torch.utils.serialization  # torch >= 2.5
        torch.utils.serialization.config.load.mmap = True
    except (ImportError, AttributeError):  # older torch: the same through a wrapper
        import functools
        torch.load = functools.partial(torch.load, mmap=True)


def no_optimizer_placement():
    """accelerate's AcceleratedOptimizer round-trips state_dict() to move the
    state to the device unless device_placement is False: force it off."""
    import accelerate.optimizer as ao
    init = ao.AcceleratedOptimizer.__init__

    def patched(self, optimizer, device_placement=True, *a, **kw):
        init(self, optimizer, False, *a, **kw)

    ao.AcceleratedOptimizer.__init__ = patched


def takes_delay(cls):
    """Whether the dos.torch optimizer class takes delay= (issue 23): an
    __init__ of its own classes names it (AdamW's passes **kwargs on)."""
    return any("delay" in inspect.signature(c.__init__).parameters
               for c in cls.__mro__ if c.__module__.startswith("dos."))


def peek_report(opt):
    """dosd's report on the last step the optimizer collected, read without
    waiting: opt.last_step collects the step in flight, waiting on the host
    for it (the overlap with the next forward being measured). The report sits on the optimizer's Flight (dos/_flight.py), which is
    private: None where it moved. accelerate's AcceleratedOptimizer (what
    the Trainer steps) is unwrapped."""
    while not hasattr(opt, "_parts") and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    flight = getattr(getattr(opt, "_parts", None), "flight", None)
    return getattr(flight, "last_step", None)


def step_phases(phase_marks, skip, profile_step=0):
    """Median seconds of each part of the steady steps (Clock's marks):
    forward_backward (begin to the Trainer's on_pre_optimizer_step: forward,
    backward, its loss check and clip), step (optimizer.step()), after (to
    on_step_end), between (to the next step's begin). Parts a framework
    without those callbacks lacks are left out."""
    parts = {"forward_backward": ("begin", "pre_optimizer"), "step": ("pre_optimizer", "optimizer"),
             "after": ("optimizer", "end")}
    out = {}
    steady = [(i, m) for i, m in enumerate(phase_marks) if i >= skip and i + 1 != profile_step]
    for name, (a, b) in parts.items():
        xs = [m[b] - m[a] for _, m in steady if a in m and b in m]
        if xs:
            out[name] = statistics.median(xs)
    xs = [phase_marks[i + 1]["begin"] - m["end"] for i, m in steady
          if i + 1 < len(phase_marks) and "end" in m]
    if xs:
        out["between"] = statistics.median(xs)
    return out


def make_model(size, device, attn=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    layers, hidden, inter, heads = SIZES[size]
    extra = {"attn_implementation": attn} if attn else {}
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=2048,
                         tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 32000, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def steady_from(args) -> int:
    """How many steps the timing skips: steady steps from the third on; with
    --delay from the first that waits for a delayed update (step
    delay_warmup + 2)."""
    return max(2, args.delay_warmup + 1) if args.delay else 2


def throughput_from(args) -> int:
    """--step-sync end's mean starts at this step index (0-based), three past
    the steady ones: past the delay's first steps (its buffers' allocation
    takes seconds)."""
    return steady_from(args) + 3


def train_accelerate(args, model, opt, times, losses, marks, on_step):
    """The same job through Accelerate's own loop: prepare, backward,
    clip_grad_norm_ and the prepared optimizer's step; returns the prepared
    optimizer (its state_dict() is what accelerator.save_state saves)."""
    from accelerate import Accelerator
    acc = Accelerator()
    data = torch.utils.data.DataLoader(RandomTokens(max(64, args.steps), args.seq), batch_size=1)
    model, opt, data = acc.prepare(model, opt, data)
    model.train()
    for i, batch in enumerate(data):
        if i >= args.steps:
            break
        t = time.perf_counter()
        marks.setdefault("first_step", t)
        loss = model(**batch).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        on_step(opt)
        losses[i + 1] = loss.item()
    return opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["dos", "dos_compact", "all_gpu"], default="dos")
    ap.add_argument("--framework", choices=["hf", "accelerate"], default="hf",
                    help="the Hugging Face Trainer, or Accelerate's own loop (no --roundtrip)")
    ap.add_argument("--size", choices=sorted(SIZES), default="7b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gpu-cap-gib", type=float, default=74.0)
    ap.add_argument("--sink", action="store_true", help="stream the optimizer state to /dev/null")
    ap.add_argument("--roundtrip", choices=["save", "resume"])
    ap.add_argument("--save-at", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/hf7b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True) and eager attention (cuDNN's "
                         "attention backward has no deterministic algorithm): the round trip's "
                         "losses then cannot differ through CUDA's atomics")
    ap.add_argument("--delay", type=int, default=0,
                    help="DOS modes: dos.torch.AdamW(delay=N), the host path's subgroups "
                         "updated N steps late (issue 23; 0: off)")
    ap.add_argument("--delay-warmup", type=int, default=2,
                    help="with --delay: AdamW(delay_warmup=), undelayed steps first (they and "
                         "the first delayed step are left out of iter_s)")
    ap.add_argument("--overlap", choices=["on", "off"],
                    help="DOS modes: dos.torch.AdamW(overlap=True or False), steps begun during "
                         "backward (with --delay: the delayed gradients copied as backward marks "
                         "them ready); left out: dos.torch's default")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="the Trainer's max_grad_norm (0: no clipping)")
    ap.add_argument("--profile-step", type=int, default=0,
                    help="torch.profiler around this step: a summary of where the trainer's GPU "
                         "time went (bench/frameworks/gpu_profile.py) in the result's 'profile'")
    ap.add_argument("--step-sync", choices=["each", "end"], default="each",
                    help="each: torch.cuda.synchronize() after every step, iter_s the median "
                         "step; end: no synchronize between steps (as a Trainer runs: only the "
                         "loss's .item() waits, on the current stream), one after the last, "
                         "iter_s the mean time of the steps from the steady ones' fourth on "
                         "(throughput)")
    ap.add_argument("--no-placement", action="store_true",
                    help="switch accelerate's optimizer placement off (the workaround the issue's "
                         "baseline was measured with: a build without lazy state copies the whole "
                         "state into the trainer in accelerator.prepare otherwise)")
    ap.add_argument("--build-on-cpu", action="store_true",
                    help="build the model on the CPU and the optimizer over it; the Trainer then "
                         "moves the model to the GPU (its _move_model_to_device), which "
                         "re-registers every parameter at the first step: a rebuild before any "
                         "step reads no state (once 12 bytes a parameter in the trainer)")
    args = ap.parse_args()
    if args.step_sync == "end" and (args.framework != "hf" or args.profile_step):
        ap.error("--step-sync end times the HF Trainer's loop without --profile-step")
    if args.step_sync == "end" and args.steps < throughput_from(args) + 2:
        ap.error(f"--step-sync end needs --steps {throughput_from(args) + 2} or more (its mean "
                 f"starts at step {throughput_from(args) + 1})")
    if args.roundtrip and args.framework != "hf":
        ap.error("--roundtrip runs the HF Trainer's save_steps/resume_from_checkpoint: --framework hf")
    if (args.delay or args.overlap) and args.mode == "all_gpu":
        ap.error("--delay and --overlap are dos.torch.AdamW's: --mode dos or dos_compact")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.no_placement:
        no_optimizer_placement()

    from transformers import Trainer, TrainerCallback, TrainingArguments
    import dos.torch
    if args.delay and not takes_delay(dos.torch.AdamW):
        # Before the model is built: a 7B model takes a while.
        raise SystemExit(f"hf7b.py: --delay needs dos.torch.AdamW(delay=, delay_warmup=) (issue "
                         f"23); the AdamW of {dos.torch.__file__} takes no delay=")

    socket = os.environ.get("DOS_SOCKET", "")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sampler = Sampler(dosd_pid_of(socket) if args.mode != "all_gpu" else 0)
    res = {"mode": args.mode, "framework": args.framework, "size": args.size, "steps": args.steps, "seq": args.seq,
           "torch": torch.__version__, "optimizer_placement": not args.no_placement,
           "delay": args.delay, "overlap": args.overlap or "default",
           "max_grad_norm": args.max_grad_norm, "built_on_cpu": args.build_on_cpu}
    t0 = time.time()
    model = make_model(args.size, "cpu" if args.build_on_cpu else device,
                       "eager" if args.deterministic else None)
    res["params"] = sum(p.numel() for p in model.parameters())
    if args.mode == "all_gpu":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    else:
        if device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * GiB / total))
        t = time.time()
        opt = dos.torch.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, model=model,
                              compact_state=args.mode == "dos_compact",
                              **(dict(overlap=args.overlap == "on") if args.overlap else {}),
                              # only where asked: a dos.torch without the delay lacks them
                              **(dict(delay=args.delay, delay_warmup=args.delay_warmup)
                                 if args.delay else {}))
        res["register_s"] = time.time() - t
    res["setup_s"] = time.time() - t0
    res["peaks_after_setup"] = sampler.mark()

    times, losses = [], {}
    # Each step's marks on the launch thread's clock (no synchronize added):
    # begin (begin to begin includes the Trainer's work between steps) ->
    # pre_optimizer (forward, backward, the Trainer's NaN check of the loss
    # and clip), -> optimizer (step()), -> end (scheduler, zero_grad; the
    # per-step synchronize with --step-sync each), end -> next begin
    # (logging: its loss .item() waits on the GPU).
    phase_marks = []
    reports = {}  # --delay: dosd's reports by step number

    def keep_report(o):
        r = peek_report(o) if args.delay else None
        if r is not None and "step" in r:
            reports[r["step"]] = dict(r)

    marks = {}

    class NoFinalSave(TrainerCallback):
        """The disk holds one checkpoint of the round trip's model: the
        save_steps one is kept, the Trainer's save at the last step skipped."""

        def on_step_end(self, a, state, control, **kw):
            if state.global_step >= args.steps and args.steps % args.save_at:
                control.should_save = False

    from gpu_profile import StepProfiler
    profiler = StepProfiler(args.out + ".trace.json.gz") if args.profile_step else None

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            marks["train_begin"] = time.perf_counter()

        def on_step_begin(self, a, state, control, **kw):
            if profiler and state.global_step + 1 == args.profile_step:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                profiler.start()
            self.t = time.perf_counter()
            phase_marks.append({"begin": self.t})
            if state.global_step == steady_from(args):  # the steady steps' CPU time from here
                marks["cpu0"] = (self.t, cpu_seconds("self"), cpu_seconds(sampler.dosd_pid))
            marks.setdefault("first_step", self.t)

        def on_pre_optimizer_step(self, a, state, control, **kw):
            phase_marks[-1]["pre_optimizer"] = time.perf_counter()

        def on_optimizer_step(self, a, state, control, **kw):
            phase_marks[-1]["optimizer"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if torch.cuda.is_available() and (args.step_sync == "each" or
                                              state.global_step == args.steps):
                torch.cuda.synchronize()
            self.end = time.perf_counter()
            phase_marks[-1]["end"] = self.end
            if state.global_step == args.steps:
                marks["train_end"] = self.end
                marks["cpu1"] = (self.end, cpu_seconds("self"), cpu_seconds(sampler.dosd_pid))
            times.append(self.end - self.t)
            if profiler and state.global_step == args.profile_step:
                res["profile"] = profiler.stop()
                res["profile"]["step_s"] = self.end - self.t
            # The optimizer the Trainer steps is accelerate's wrapper of
            # `opt`; the report is read off `opt` itself, without waiting.
            keep_report(opt)

        def on_save(self, a, state, control, **kw):
            marks["save_s"] = time.perf_counter() - self.end

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    if args.framework == "accelerate":
        t = time.time()
        t_call = time.perf_counter()
        opt = train_accelerate(args, model, opt, times, losses, marks, keep_report)
    else:
        out_dir = os.path.join(args.workdir, "out")
        targs = dict(output_dir=out_dir, per_device_train_batch_size=1, max_steps=args.steps,
                     max_grad_norm=args.max_grad_norm, logging_steps=1, report_to=[], save_strategy="no",
                     dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-5,
                     lr_scheduler_type="constant", seed=0, data_seed=0)
        if args.roundtrip:
            targs.update(save_strategy="steps", save_steps=args.save_at, save_only_model=False)
        trainer = Trainer(model=model, args=TrainingArguments(**targs),
                          train_dataset=RandomTokens(max(64, args.steps), args.seq),
                          optimizers=(opt, None), callbacks=[Clock(), NoFinalSave()])
        t = time.time()
        resume = None
        if args.roundtrip == "resume":
            if args.mode == "all_gpu":
                mmap_loads()
            resume = os.path.join(out_dir, f"checkpoint-{args.save_at}")
        t_call = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume)
    res["train_s"] = time.time() - t
    res["step_s"] = times
    skip = steady_from(args)
    # The profiled step (--profile-step) runs slower under the profiler.
    timed = [s for i, s in enumerate(times) if i + 1 != args.profile_step]
    steady = sorted(timed[skip:]) if len(timed) > skip + 2 else sorted(timed)
    res["iter_s"] = steady[len(steady) // 2]
    res["step_sync"] = args.step_sync
    begins = [m["begin"] for m in phase_marks]
    res["begins_s"] = [b - begins[0] for b in begins]
    if args.step_sync == "end" and "train_end" in marks:
        first = throughput_from(args)
        # Unsynchronised steps end on the host before their GPU work: the
        # steady steps' mean, from the first's begin to the final sync.
        res["iter_s"] = (marks["train_end"] - begins[first]) / (len(begins) - first)
    periods = [b - a for a, b in zip(begins, begins[1:])][skip:]
    res["phases_s"] = step_phases(phase_marks, skip, args.profile_step)
    if periods:
        res["period_s"] = statistics.median(periods)
    if args.delay:
        # dosd numbers a fresh session's steps 1, 2, ... as the Trainer's
        # global steps: the steady ones are skip + 1 on.
        res.update(delay_figures([r for n, r in sorted(reports.items()) if n > skip]))
    if "cpu0" in marks and "cpu1" in marks:
        # Cores each process kept busy over the steady steps: a thread of
        # dosd's that spins beside the trainer shows as a core more.
        (t0, *c0), (t1, *c1) = marks["cpu0"], marks["cpu1"]
        for key, a, b in zip(("trainer_cpu_cores", "dosd_cpu_cores"), c0, c1):
            if a is not None and b is not None and t1 > t0 and (key == "trainer_cpu_cores"
                                                                or sampler.dosd_pid):
                res[key] = (b - a) / (t1 - t0)
    res["losses"] = losses
    res["hf_save_s"] = marks.get("save_s")
    if "first_step" in marks and "train_begin" in marks:
        res["until_first_step_s"] = marks["first_step"] - marks["train_begin"]
    if "first_step" in marks:  # a resume loads the checkpoint in here
        res["call_to_first_step_s"] = marks["first_step"] - t_call
    res["peaks_after_train"] = sampler.mark()
    if args.sink:
        t = time.time()
        torch.save(opt.state_dict(), "/dev/null")
        res["sink_save_s"] = time.time() - t
        res["peaks_after_sink"] = sampler.mark()
    if args.roundtrip == "save":
        t = time.time()
        trainer.save_model(os.path.join(args.workdir, "final"))
        res["final_save_s"] = time.time() - t
        from safetensors.torch import load_file
        saved = {}
        for f in os.listdir(os.path.join(args.workdir, "final")):
            if f.endswith(".safetensors"):
                saved.update(load_file(os.path.join(args.workdir, "final", f)))
        live = model.state_dict()
        res["saved_equals_final"] = int(all(
            torch.equal(saved[k].cpu(), live[k].detach().cpu()) for k in saved if k in live))
        ck = os.path.join(out_dir, f"checkpoint-{args.save_at}")
        res["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(ck, f))
                                      for f in os.listdir(ck))
    res["peaks"] = sampler.close()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("step_s",)}, indent=1))
    if hasattr(opt, "close"):
        opt.close()


if __name__ == "__main__":
    sys.exit(main())
