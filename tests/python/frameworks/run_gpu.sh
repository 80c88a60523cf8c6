#!/usr/bin/env bash
# Runs the three framework tests (Hugging Face Trainer, Accelerate, Lightning; test_frameworks.py)
# on the GPU against a dosd that the tests' fixture starts on a private socket, and writes their
# figures with the machine, date and versions to bench/results/integration_<machine>_<date>.json.
#
#   tests/python/frameworks/run_gpu.sh DOSD LIBDOS_CLIENT [RESULT_JSON]
#
# DOSD and LIBDOS_CLIENT: a CUDA build's dosd and libdos_client.so; the client library's folder
# goes on LD_LIBRARY_PATH (where a bundle keeps gRPC, abseil, oneTBB for dosd). Environment:
# DOS_MACHINE (default nvidia-h200), DOS_COMMIT (recorded; default: git's HEAD if there is one),
# DOS_FRAMEWORK_DEVICE (default cuda). Exit status: pytest's. About 2 minutes on nvidia-h200.
set -u
dosd=$(realpath "${1:?usage: run_gpu.sh DOSD LIBDOS_CLIENT [RESULT_JSON]}")
lib=$(realpath "${2:?usage: run_gpu.sh DOSD LIBDOS_CLIENT [RESULT_JSON]}")
repo=$(cd "$(dirname "$0")/../../.." && pwd)
machine=${DOS_MACHINE:-nvidia-h200}
day=$(date -u +%F)
out=${3:-$repo/bench/results/integration_${machine}_${day}.json}
commit=${DOS_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}

export LD_LIBRARY_PATH=$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export DOS_DOSD=$dosd DOS_CLIENT_LIB=$lib PYTHONPATH=$repo/client/python
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export DOS_FRAMEWORK_DEVICE=${DOS_FRAMEWORK_DEVICE:-cuda}
figures=$(mktemp -u /tmp/dos-integration-XXXXXX.json)
export DOS_INTEGRATION_RESULTS=$figures

start=$(date +%s)
timeout 230 python3 -m pytest -q -p no:cacheprovider -rs "$repo/tests/python/frameworks"
rc=$?
seconds=$(( $(date +%s) - start ))

python3 - "$figures" "$out" "$machine" "$day" "$commit" "$rc" "$seconds" <<'EOF'
import json, os, sys
figures_path, out, machine, day, commit, rc, seconds = sys.argv[1:]
figures = json.load(open(figures_path)) if os.path.exists(figures_path) else {}
versions = {}
for name in ("torch", "transformers", "accelerate", "lightning", "pytorch_lightning"):
    try:
        versions[name] = __import__(name).__version__
    except Exception:
        pass
gpu, gpus_in_host = None, 0
try:
    import torch
    gpus_in_host = torch.cuda.device_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception:
    pass
result = {"what": "framework integration: checkpoint saved at the last step equals the final "
                  "weights bit for bit (1/0); largest |loss difference| of a run resumed from "
                  "the mid-run checkpoint (0 = identical)",
          "machine": machine, "date": day, "commit": commit, "gpu": gpu,
          "gpus_in_host": gpus_in_host, "gpus_used": 1,
          "device": os.environ.get("DOS_FRAMEWORK_DEVICE"), "versions": versions,
          "pytest_exit_status": int(rc), "seconds": int(seconds)}
result.update(figures)
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
with open(out, "w") as f:
    json.dump(result, f, indent=1, sort_keys=True)
print(f"run_gpu.sh: wrote {out}")
print(json.dumps({k: v for k, v in result.items() if k.startswith("integration_")}, indent=1))
EOF
exit $rc
