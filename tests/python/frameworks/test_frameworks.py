"""The framework examples (client/python/examples/{hf_trainer,accelerate_train,
lightning_train}.py) run for real against dosd, each in its own interpreter:
the checkpoint saved at the last step must equal the final weights bit for
bit, a run resumed from the mid-run checkpoint must reproduce the first run's
losses exactly, and the interpreter must exit 0 (a SIGSEGV at exit after an
Accelerate run was one of the bugs). Each test skips, saying so, where its
framework is not installed (CI has none of them; the GPU machine has all).

$DOS_INTEGRATION_RESULTS (optional): a JSON file that collects the figures
integration_<framework>_saved_equals_final (1 or 0) and
integration_<framework>_resume_max_loss_diff. $DOS_FRAMEWORK_DEVICE: auto
(default: cuda where there is a GPU and a CUDA build), cpu or cuda.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "client",
                                        "python", "examples"))


def installed(*modules):
    for m in modules:
        try:
            if importlib.util.find_spec(m) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def record(framework, result):
    path = os.environ.get("DOS_INTEGRATION_RESULTS")
    if not path:
        return
    figures = {}
    if os.path.exists(path):
        with open(path) as f:
            figures = json.load(f)
    figures[f"integration_{framework}_saved_equals_final"] = result["saved_equals_final"]
    figures[f"integration_{framework}_resume_max_loss_diff"] = result["resume_max_loss_diff"]
    figures.setdefault("details", {})[framework] = {
        k: result[k] for k in ("device", "torch", "steps", "save_at", "saved_problems",
                               "resumed_steps_missing") if k in result}
    with open(path, "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)


def run_example(framework, script, socket, tmp_path, timeout=300):
    result_path = tmp_path / "result.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (EXAMPLES, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), "--socket", socket,
         "--workdir", str(tmp_path / "work"), "--result", str(result_path),
         "--device", os.environ.get("DOS_FRAMEWORK_DEVICE", "auto")],
        env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    if result is not None:
        record(framework, result)
    assert proc.returncode >= 0, (f"{script} was killed by signal {-proc.returncode} "
                                  f"(at exit?); output:\n{out[-4000:]}")
    assert result is not None, f"{script} wrote no result (exit {proc.returncode}):\n{out[-4000:]}"
    assert result["saved_equals_final"] == 1, result["saved_problems"]
    assert result["resume_max_loss_diff"] == 0, (result["losses"], result["resumed_losses"])
    assert not result["resumed_steps_missing"], result
    assert proc.returncode == 0, out[-4000:]
    assert "Exception ignored" not in out, out[-4000:]


def test_hf_trainer(dos_socket, tmp_path):
    if not installed("transformers", "safetensors"):
        pytest.skip("transformers (and safetensors) not installed: pip install transformers "
                    "to run the Hugging Face Trainer example")
    run_example("hf_trainer", "hf_trainer.py", dos_socket, tmp_path)


def test_accelerate(dos_socket, tmp_path):
    if not installed("accelerate"):
        pytest.skip("accelerate not installed: pip install accelerate to run its example")
    run_example("accelerate", "accelerate_train.py", dos_socket, tmp_path)


def test_lightning(dos_socket, tmp_path):
    if not installed("lightning", "pytorch_lightning"):
        pytest.skip("PyTorch Lightning not installed: pip install lightning to run its example")
    run_example("lightning", "lightning_train.py", dos_socket, tmp_path)
