"""bench/frameworks/gpu_profile.py: the summary of one profiled step (busy
and idle GPU time, the longest gaps with how late the CPU issued what came
next, the kernels and runtime calls by time), from a chrome trace's events."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bench", "frameworks"))
import gpu_profile  # noqa: E402


def kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def launch(ts, dur, corr):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def test_busy_idle_and_a_gap_the_cpu_caused():
    events = [
        launch(0, 5, 1), kernel("gemm", 10, 100, 1),
        launch(20, 5, 2), kernel("add", 60, 100, 2),  # overlaps gemm: one busy run 10..160
        launch(400, 10, 3), kernel("norm", 415, 85, 3),  # launched late: a 255 us gap
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 500, "dur": 20},
        {"cat": "cpu_op", "name": "aten::view", "ts": 1, "dur": 1},
    ]
    s = gpu_profile.summarise(events)
    assert s["span_ms"] == 0.51
    assert abs(s["busy_ms"] - 0.255) < 1e-9  # 150 + 85 + 20
    assert abs(s["idle_ms"] - 0.255) < 1e-9
    gap = s["gaps"][0]
    assert abs(gap["ms"] - 0.255) < 1e-9 and gap["before"] == "add" and gap["after"] == "norm"
    assert abs(gap["launch_lag_ms"] - 0.25) < 1e-9  # issued at 410 us, the GPU free from 160
    assert s["idle_gaps_over_50us_ms"] == gap["ms"]
    assert s["kernels"]["gemm"] == 0.1 and s["runtime"]["cudaLaunchKernel"] == 0.02


def test_cheap_ops_by_50_ms_say_how_fast_the_launch_thread_ran():
    events = [kernel("gemm", 0, 10, 1)]
    events += [{"cat": "cpu_op", "name": "aten::view", "ts": 1000 + i, "dur": 2} for i in range(5)]
    events += [{"cat": "cpu_op", "name": "aten::t", "ts": 60_000 + i, "dur": d}
               for i, d in enumerate([4, 5, 6, 7, 8])]
    events += [{"cat": "cpu_op", "name": "aten::mm", "ts": 60_000, "dur": 90}]  # not cheap
    events += [{"cat": "cpu_op", "name": "aten::view", "ts": 120_000, "dur": 1}]  # too few
    s = gpu_profile.summarise(events)
    assert s["cheap_op_us"] == {"0": 2, "50": 6}


def test_a_trace_without_gpu_work_says_so():
    assert "error" in gpu_profile.summarise([{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}])
