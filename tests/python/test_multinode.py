"""Two "nodes" on one machine: each node its own dosd on its own socket, two
torchrun agents (--nnodes=2, c10d rendezvous on 127.0.0.1), one rank each,
every rank attached to its node's daemon through DOS_SOCKET; DDP (and FSDP2
where torch >= 2.4) with gloo on the CPU. The losses and final weights of
every rank must equal, bit for bit, those of the same job with both ranks on
one node and one dosd (client/python/examples/multinode.py does the training
and the comparison; multinode_localhost.sh is the same on 2 GPUs with NCCL).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from conftest import running_dosd  # noqa: E402

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "client",
                                        "python", "examples"))
SCRIPT = os.path.join(EXAMPLES, "multinode.py")
STEPS = 15

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture
def two_daemons():
    """Node 0's and node 1's dosd."""
    with running_dosd("--cpu_threads=1") as (node0, _), \
            running_dosd("--cpu_threads=1") as (node1, _):
        yield [node0, node1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args, dos_socket, out, wrap):
    env = dict(os.environ, DOS_SOCKET=dos_socket, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        # --redirects=1 --tee=2: workers' stdout to torchrun's log files, stderr
        # to ours. Spelled out because torch 1.13's torchrun parses the
        # default "0" into None under Python 3.11 (its Std IntFlag no longer
        # iterates the zero member) and fails before starting a worker.
        [sys.executable, "-m", "torch.distributed.run", *args, "--max_restarts=0",
         "--redirects=1", "--tee=2", SCRIPT,
         "--wrap", wrap, "--steps", str(STEPS), "--out", out],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, what):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
        assert p.returncode == 0, f"{what}: torchrun exited {p.returncode}:\n{out[-3000:]}"
    return outs


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_two_nodes_equal_one_node(two_daemons, dos_socket, tmp_path, wrap):
    if wrap == "fsdp2":
        sys.path.insert(0, EXAMPLES)
        try:
            import multinode
        finally:
            sys.path.remove(EXAMPLES)
        if multinode.fully_shard_fn() is None:
            pytest.skip(f"FSDP2 (fully_shard) needs torch >= 2.4; this is torch "
                        f"{torch.__version__}")
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    port = free_port()
    nodes = [torchrun(["--nnodes=2", f"--node_rank={i}", "--nproc_per_node=1",
                       "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                       f"--rdzv_id=pytest-{wrap}-{port}"], two_daemons[i], two, wrap)
             for i in range(2)]
    finish(nodes, "two nodes")
    finish([torchrun(["--standalone", "--nproc_per_node=2"], dos_socket, one, wrap)], "one node")

    reports = {}
    for name in os.listdir(two):
        with open(os.path.join(two, name)) as f:
            r = json.load(f)
        reports[r["rank"]] = r
    assert sorted(reports) == [0, 1]
    # Each node's rank attached to its own node's dosd.
    assert sorted(r["socket"] for r in reports.values()) == sorted(two_daemons)
    assert all(r["steps"] == STEPS and r["world_size"] == 2 for r in reports.values())
    out = subprocess.run([sys.executable, SCRIPT, "--compare", two, one], capture_output=True,
                         text=True, timeout=60)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
