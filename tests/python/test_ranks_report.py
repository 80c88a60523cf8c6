"""bench/e2e/ranks_report.py (issue 14 item 4): the figures it writes from
ranks.py's JSON lines (1 rank, 2 DDP ranks with the node model's predictions),
and that it writes what it can when predictions are missing (no dosctl)."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPORT = os.path.join(HERE, "..", "..", "bench", "e2e", "ranks_report.py")


def run(tmp_path, lines, probe=None):
    src = tmp_path / "ranks.jsonl"
    src.write_text("".join(json.dumps(l) + "\n" for l in lines))
    out = tmp_path / "ranks.json"
    args = [sys.executable, REPORT, str(src), "test-machine", str(out)]
    if probe is not None:
        p = tmp_path / "probe.json"
        p.write_text(json.dumps(probe))
        args += [str(p), "8G"]
    subprocess.run(args, check=True, capture_output=True, text=True)
    doc = json.loads(out.read_text())
    return doc, {r["name"]: r["value"] for r in doc["results"]}


def line(world, rate, bound=None, err=None):
    l = {"wrap": "ddp", "world": world, "size": "1.5b", "policy": "auto",
         "params_per_rank": [1545302016] * world, "update_s_per_rank": [0.3] * world,
         "aggregate_gparam_per_s": rate}
    if bound is not None:
        l.update(node_bound_gparam_per_s=bound, prediction_error_per_rank=[err] * world,
                 daemon_prediction_error_per_rank=[err / 2] * world)
    return l


def test_figures_of_one_and_two_ranks(tmp_path):
    doc, r = run(tmp_path, [line(1, 5.0, 5.2, 0.04), line(2, 8.5, 9.0, 0.06)],
                 probe={"m_host_gbps": 151.23, "host_copy_gbps": 98.7})
    assert doc["machine"] == "test-machine"
    assert r["update_gparams_auto_1rank"] == 5.0
    assert r["update_gparams_auto_2ranks"] == 8.5
    assert r["update_2ranks_vs_1rank"] == 1.7
    assert r["update_node_bound_gparams_2ranks"] == 9.0
    assert r["update_2ranks_of_node_bound"] == round(8.5 / 9.0, 3)
    assert r["update_node_bound_2ranks_vs_1rank"] == round(9.0 / 5.2, 3)
    assert r["update_pred_err_2ranks_rank0"] == 0.06
    assert r["update_pred_err_2ranks_rank1"] == 0.06
    assert r["update_pred_err_daemon_2ranks_rank0"] == 0.03
    assert r["update_pred_err_1rank"] == 0.04
    assert r["host_memory_gbps_probe"] == 151.2
    assert "--gpu_memory_budget=8G" in doc["note"]
    assert len(doc["runs"]) == 2


def test_without_predictions(tmp_path):
    _, r = run(tmp_path, [line(1, 5.0), line(2, 6.0)])
    assert r["update_2ranks_vs_1rank"] == 1.2
    assert "update_node_bound_gparams_2ranks" not in r
    assert not any(k.startswith("update_pred_err") for k in r)
