"""bench/e2e/largest.py (issue 14 item 5: largest model per node): the memory
arithmetic, the failure classification and the search order with a fake
trainer (instant), and one short real search on the CPU against dosd with a
fake host memory, so that the first size is refused by dosd's host budget and
the next one trains (~10 s)."""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench", "e2e"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))

import gpt  # noqa: E402
import largest  # noqa: E402

GiB = largest.GiB


@pytest.mark.parametrize("layers,d,heads,seq,vocab", [(2, 64, 4, 32, 256), (3, 128, 2, 16, 100)])
def test_param_count_matches_the_model(layers, d, heads, seq, vocab):
    model = gpt.build("tiny", layers, d, heads, seq, vocab, init_in_dtype=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    assert sum(p.numel() for p in model.parameters()) == largest.gpt_params(layers, d, seq, vocab)


def h200(avail_gib=120, gpu_gib=80):
    return largest.Budget(avail_gib * GiB, 3 * GiB, int(3.5 * GiB), 2 * GiB, gpu_gib * GiB, GiB)


def test_prediction_is_the_largest_that_fits_and_names_the_limit():
    b = h200()
    shape = (4608, 2048, 2, 32000)
    for fmt in ("fp32", "compact"):
        n, over = b.predict(fmt, *shape, 400)
        assert not b.check(fmt, n, *shape)[2]
        assert over == b.check(fmt, n + 1, *shape)[2] == ["host memory"]
        p = largest.gpt_params(n, 4608, 2048, 32000)
        host = largest.FORMATS[fmt][1] * p + 8.5 * GiB
        assert host <= 120 * GiB < host + largest.FORMATS[fmt][1] * (p // n)
    fp32 = b.predict("fp32", *shape, 400)[0]
    compact = b.predict("compact", *shape, 400)[0]
    assert 1.4 < compact / fp32 < 1.6  # 12 vs 8 bytes of state a parameter
    # A 40 GiB card: compact state is limited by the GPU (4 B a parameter there).
    n, over = h200(gpu_gib=40).predict("compact", *shape, 400)
    assert over == ["GPU memory"] and n < compact
    # The state limit handed to dosd is what the arithmetic allows.
    assert b.state_limit() == 120 * GiB - int(8.5 * GiB)


def test_calibration_takes_the_measured_peaks():
    b = h200()
    p = largest.gpt_params(30, 4608, 2048, 32000)
    rec = {"params": p, "layers": 30, "d_model": 4608, "seq": 2048, "batch": 2, "vocab": 32000,
           "dosd_host_peak_bytes": 12 * p + 3 * GiB, "host_peak_bytes": GiB,
           "gpu_peak_reserved_bytes": 4 * p + 5 * GiB}
    b.calibrate(rec, "fp32")
    assert b.dosd_overhead == 3 * GiB and b.trainer_host == GiB
    assert b.gpu_need(30, 4608, 2048, 2, 32000) == 4 * p + 5 * GiB
    fake = h200()
    fake.calibrate(rec, "fp32", host=False)  # a fake host memory keeps its figures
    assert fake.trainer_host == 3 * GiB


@pytest.mark.parametrize("rec,want", [
    ({"iter_s": 1.0, "gpu_peak_device_bytes": 79 * GiB}, None),
    ({"iter_s": 1.0, "gpu_peak_device_bytes": 81 * GiB}, "gpu_over_budget"),
    ({"error": "DosError: RESOURCE_EXHAUSTED: register: session 1 needs 1 GiB of host "
               "optimizer state, but ...; raise dosd --host_memory_limit"}, "host_budget_refused"),
    ({"error": "exit -9", "rc": -9}, "host_oom_killed"),
    ({"error": "DosError: UNAVAILABLE: dosd went away", "rc": 1, "dosd_died": -9},
     "host_oom_killed"),
    ({"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "rc": 1},
     "gpu_oom"),
    ({"error": "timed out", "timed_out": True, "rc": None}, "timeout"),
    ({"error": "DosError: UNAVAILABLE", "rc": 1, "dosd_died": -6}, "dosd_died"),
    ({"error": "DosError: INTERNAL: register: mlock: Cannot allocate memory", "rc": 1},
     "host_alloc_failed"),
    ({"error": "ValueError: something else", "rc": 1}, "error"),
])
def test_failure_classes(rec, want):
    assert largest.classify(rec, gpu_budget=80 * GiB) == want


def test_cgroup_room_bounds_the_host_memory(tmp_path):
    assert largest.cgroup_available(str(tmp_path)) is None  # no cgroup files
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(f"{GiB}\n")
    assert largest.cgroup_available(str(tmp_path)) is None  # no limit
    (tmp_path / "memory.max").write_text(f"{100 * GiB}\n")
    (tmp_path / "memory.stat").write_text(f"anon {GiB}\ninactive_file {2 * GiB}\n")
    assert largest.cgroup_available(str(tmp_path)) == 101 * GiB


def fake_args(**kw):
    a = largest.parse_args(["--dosd", "dosd", "--gpu-budget-gb", "80"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


class FakeTrainer:
    """A runner that trains up to `fits[fmt]` layers and fails above with
    `cls`; it advances a fake clock by `wall` seconds a candidate."""

    def __init__(self, fits, cls="host_oom_killed", wall=60.0):
        self.fits, self.cls, self.wall, self.now, self.calls = fits, cls, wall, 0.0, []

    def clock(self):
        return self.now

    def __call__(self, fmt, layers, host_limit, timeout):
        self.calls.append((fmt, layers))
        self.now += self.wall
        p = largest.gpt_params(layers, 4608, 2048, 32000)
        if layers > self.fits[fmt]:
            return {"error": "exit -9", "rc": -9} if self.cls == "host_oom_killed" else \
                {"error": "OutOfMemoryError: CUDA out of memory", "rc": 1}
        return {"iter_s": 2.0, "iter_s_pipelined_median": 1.9, "model_init_s": 1.0,
                "setup_s": 9.0, "params": p, "layers": layers, "d_model": 4608, "seq": 2048,
                "batch": 2, "vocab": 32000, "losses": [1.0] * 10, "last_loss": 1.0,
                "dosd_host_peak_bytes": largest.FORMATS[fmt][1] * p + int(3.5 * GiB),
                "host_peak_bytes": 3 * GiB, "gpu_peak_device_bytes": 70 * GiB}


def test_search_steps_down_from_the_prediction_and_says_what_limits():
    b = h200()
    pred = {f: b.predict(f, 4608, 2048, 2, 32000, 400)[0] for f in ("fp32", "compact")}
    t = FakeTrainer({"fp32": pred["fp32"] - 3, "compact": pred["compact"]})
    cands, summary = largest.search(fake_args(), t, b, ["fp32", "compact"], clock=t.clock)
    n = pred["fp32"]
    # The prediction fails, a step down (6%: 3 layers) trains; the arithmetic
    # (unchanged: the fake's peaks are the estimates) allows more below the
    # failure, so the gap is halved until it closes.
    assert [c for f, c in t.calls if f == "fp32"] == [n, n - 3, n - 1, n - 2]
    assert summary["fp32"]["largest"]["layers"] == n - 3
    assert summary["fp32"]["limit"] == "host memory"
    assert summary["fp32"]["limit_evidence"].startswith(f"measured: {n - 2} x 4608")
    assert [c["failure_class"] for c in cands if c["format"] == "fp32"][0] == "host_oom_killed"
    # compact trains at its prediction; with the measured peaks equal to the
    # estimates, nothing larger is predicted, so it is the only try.
    assert [c for f, c in t.calls if f == "compact"] == [pred["compact"]]
    assert summary["compact"]["largest"]["params"] == \
        largest.gpt_params(pred["compact"], 4608, 2048, 32000)
    assert summary["compact"]["limit_evidence"].startswith("predicted:")


def test_search_probes_up_when_the_measured_overheads_are_smaller():
    b = h200()
    pred = b.predict("fp32", 4608, 2048, 2, 32000, 400)[0]
    t = FakeTrainer({"fp32": pred + 1, "compact": 0})
    t_call = t.__call__

    def lean(fmt, layers, host_limit, timeout):  # dosd and trainer use 3 GiB less
        r = t_call(fmt, layers, host_limit, timeout)
        if "iter_s" in r:
            r["dosd_host_peak_bytes"] -= 2 * GiB
            r["host_peak_bytes"] -= GiB
        return r
    cands, summary = largest.search(fake_args(), lean, b, ["fp32"], clock=t.clock)
    assert t.calls[0] == ("fp32", pred) and t.calls[1][1] > pred
    # the probe (pred + 2) failed, the gap was halved: pred + 1 trains
    assert [c for _, c in t.calls] == [pred, pred + 2, pred + 1]
    assert summary["fp32"]["largest"]["layers"] == pred + 1
    assert summary["fp32"]["limit_evidence"].startswith("measured:")


def test_search_keeps_time_for_the_next_format():
    b = h200()
    t = FakeTrainer({"fp32": 1, "compact": 1000}, wall=100.0)
    _, summary = largest.search(fake_args(time_budget_s=350, est_candidate_s=100), t, b,
                                ["fp32", "compact"], clock=t.clock)
    # fp32 fails and steps down while leaving one candidate's time for compact.
    assert summary["fp32"]["largest"] is None and "time budget" in summary["fp32"]["stopped"]
    assert summary["compact"]["largest"] is not None
    assert [f for f, _ in t.calls].count("fp32") == 2


def test_cpu_search_against_dosd(tmp_path):
    dosd = os.environ.get("DOS_DOSD")
    if not dosd:
        pytest.skip("DOS_DOSD is not set (ctest sets it)")
    # 6 x 64 needs 3.83 MiB of fp32 state, 5 x 64 3.26: with 3.4 MiB allowed,
    # dosd refuses the predicted 6 layers and 5 train.
    rc = largest.main(["--device", "cpu", "--dosd", dosd, "--formats", "fp32", "--d-model", "64",
                       "--head-dim", "16", "--seq", "32", "--vocab", "256", "--batch", "2",
                       "--mem-available-gib", str(4.2e6 / GiB),
                       "--host-limit-gib", str(3.4 * 2**20 / GiB),
                       "--trainer-host-gib", "0", "--dosd-overhead-gib", "0",
                       "--host-margin-gib", "0", "--machine", "test", "--out", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("largest_test_*.json")
    doc = json.loads(path.read_text())
    cands = doc["candidates"]
    assert [(c["layers"], c["failure_class"]) for c in cands] == \
        [(6, "host_budget_refused"), (5, None)]
    assert cands[1]["iterations"] == 10 and cands[1]["s_per_iter"] > 0
    assert doc["results"][0] == {"name": "largest_model_params_fp32",
                                 "value": largest.gpt_params(5, 64, 32, 256), "unit": "params"}
    assert doc["summary"]["fp32"]["limit"] == "host memory"
