"""Where one training step's time goes on the trainer's GPU: torch.profiler
around one step, summarised (the chrome trace of a 7B step is large):

  busy_ms     the union of the trainer's kernels, copies and memsets
  idle_ms     the step's span minus busy: the GPU waited (for the CPU to
              launch, for a sync, for another process's work)
  gaps        the longest idle gaps, each with the kernel before and after
              it and how late the next one's launch call was (launch_lag_ms:
              the CPU issued it only then, so the CPU was the bound)
  kernels     total time by kernel name (the 15 longest)
  runtime     CUDA runtime calls by total time on the CPU (a long
              cudaStreamSynchronize or cudaMemcpy is a stall)
  cheap_op_us the median CPU cost of the cheapest ops (view, t, transpose,
              reshape, as_strided, empty: dispatcher work, no kernel) in each
              50 ms from the step's first op, keyed by the bin's start in ms:
              how fast the launch thread ran then (what host work beside
              the trainer, such as dosd's delayed update, takes from it)

Used by bench/frameworks/hf7b.py --profile-step N.
"""
import collections
import gzip
import json
import os
import statistics
import tempfile

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CHEAP_OPS = ("aten::view", "aten::t", "aten::transpose", "aten::reshape", "aten::as_strided",
             "aten::empty")
BIN_US = 50_000


def _union(intervals):
    """(covered length, the merged intervals) of (start, end) pairs."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged), merged


def summarise(events, top=10):
    gpu = [e for e in events if e.get("cat") in GPU_CATS and "dur" in e]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    busy, merged = _union((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    t0, t1 = merged[0][0], merged[-1][1]
    starts = {e["ts"]: e for e in gpu}
    ends = {}
    for e in gpu:
        ends[e["ts"] + e["dur"]] = e
    gaps = []
    for (s0, e0), (s1, _) in zip(merged, merged[1:]):
        nxt = starts.get(s1)
        prev = ends.get(e0)
        launch = launches.get(nxt.get("args", {}).get("correlation")) if nxt else None
        gaps.append({"ms": (s1 - e0) / 1e3, "at_ms": (e0 - t0) / 1e3,
                     "before": prev["name"][:80] if prev else "",
                     "after": nxt["name"][:80] if nxt else "",
                     "launch_lag_ms": ((launch["ts"] + launch["dur"] - e0) / 1e3
                                       if launch else None)})
    gaps.sort(key=lambda g: -g["ms"])
    by_kernel = collections.Counter()
    for e in gpu:
        by_kernel[e["name"][:80]] += e["dur"] / 1e3
    runtime = collections.Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and "dur" in e:
            runtime[e["name"]] += e["dur"] / 1e3
    cheap = collections.defaultdict(list)
    ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    c0 = min((e["ts"] for e in ops), default=0)  # the step's first op
    for e in ops:
        if e["name"] in CHEAP_OPS:
            cheap[int((e["ts"] - c0) // BIN_US) * BIN_US // 1000].append(e["dur"])
    return {"span_ms": (t1 - t0) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (t1 - t0 - busy) / 1e3,
            "idle_gaps_over_50us_ms": sum(g["ms"] for g in gaps if g["ms"] > 0.05),
            "gaps": gaps[:top],
            "kernels": {k: round(v, 3) for k, v in by_kernel.most_common(15)},
            "runtime": {k: round(v, 3) for k, v in runtime.most_common(10)},
            "cheap_op_us": {str(b): round(statistics.median(v), 2)
                            for b, v in sorted(cheap.items()) if len(v) >= 5}}


class StepProfiler:
    """start() before the step, stop() after it (the device synchronised):
    the summary, and the trace gzipped to `trace_path` if given."""

    def __init__(self, trace_path=None):
        self.trace_path = trace_path
        self.prof = None

    def start(self):
        import torch.profiler as tp
        self.prof = tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA])
        self.prof.__enter__()

    def stop(self):
        self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                raw = f.read()
        if self.trace_path:
            with gzip.open(self.trace_path, "wb") as g:
                g.write(raw)
        return summarise(json.loads(raw).get("traceEvents", []))
