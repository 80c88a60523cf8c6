"""dosd is never the victim of a trainer's memory (issue 22): a trainer that
allocates past a memory limit is the process the kernel's OOM killer kills,
while dosd, which holds more memory than it, and another session live on.

The limit is a memory cgroup (v2, or v1's memory controller) holding dosd and
the greedy trainer, set just above what they use: without the guards (dosd
lowering its OOM score where it may; trainers raising theirs at attach where
dosd could not: client/src/oom_score.cc) the killer would pick dosd, the
larger process. (Run where dosd may lower its score, the trainer keeps its.)
Needs root and a writable cgroup hierarchy; skips saying why otherwise."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
import dos.torch  # noqa: E402
from conftest import running_dosd  # noqa: E402

MiB = 1 << 20

HOG = textwrap.dedent("""
    import sys, torch, dos.torch
    model = torch.nn.Linear(64, 64)
    opt = dos.torch.AdamW(model.parameters(), socket=sys.argv[1])
    print("attached", open("/proc/self/oom_score_adj").read().strip(), flush=True)
    with open(sys.argv[2], "w") as f:  # into the cgroup: what it allocates from here is charged
        f.write(str(__import__("os").getpid()))
    hold = []
    while True:
        hold.append(torch.ones(4 * 1024 * 1024 // 4))  # 4 MiB, touched
""")


class Cgroup:
    """A memory cgroup of the test's own: v2 if the unified hierarchy has the
    memory controller, else v1's memory hierarchy."""

    def __init__(self):
        name = f"dos-oom-test-{os.getpid()}"
        v2 = "/sys/fs/cgroup/cgroup.controllers"
        if os.path.exists(v2) and "memory" in open(v2).read():
            self.path, self.limit_file, self.usage_file = (
                f"/sys/fs/cgroup/{name}", "memory.max", "memory.current")
        elif os.path.isdir("/sys/fs/cgroup/memory"):
            self.path, self.limit_file, self.usage_file = (
                f"/sys/fs/cgroup/memory/{name}", "memory.limit_in_bytes",
                "memory.usage_in_bytes")
        else:
            pytest.skip("no memory cgroup controller on this machine")
        try:
            os.mkdir(self.path)
        except OSError as e:
            pytest.skip(f"cannot create a memory cgroup ({self.path}: {e}); run as root")
        self.procs = []

    def add(self, pid):
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        self.procs.append(pid)

    def usage(self):
        return int(open(os.path.join(self.path, self.usage_file)).read())

    def limit(self, n):
        with open(os.path.join(self.path, self.limit_file), "w") as f:
            f.write(str(n))

    def remove(self):
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)


def test_a_trainer_out_of_memory_is_killed_not_dosd():
    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    cg = Cgroup()
    try:
        with running_dosd(killed_ok=True) as (socket, proc):
            cg.add(proc.pid)  # before the victim registers: its state is charged here
            torch.manual_seed(0)
            # 25M parameters: 300 MB of state in dosd, which also maps this
            # trainer's 200 MB of weights and gradients: more than the greedy
            # trainer will hold (torch's own ~240 MB plus the 96 MB below).
            model = torch.nn.Sequential(torch.nn.Linear(4096, 3072, bias=False),
                                        torch.nn.Linear(3072, 4096, bias=False))
            with dos.torch.AdamW(model.parameters(), socket=socket, lr=1e-3) as victim:
                x = torch.randn(8, 4096)
                victim.zero_grad()
                model(x).pow(2).mean().backward()
                victim.step()
                dosd_rss = int(next(l for l in open(f"/proc/{proc.pid}/status")
                                    if l.startswith("VmRSS")).split()[1]) * 1024
                assert dosd_rss > 450 * MiB
                # Room for a greedy trainer of half dosd's size: dosd is the
                # larger process when memory runs out.
                cg.limit(cg.usage() + 96 * MiB)
                env = dict(os.environ)
                env.pop("DOS_TRAINER_OOM_SCORE_ADJ", None)
                hog = subprocess.Popen(
                    [sys.executable, "-c", HOG, socket, os.path.join(cg.path, "cgroup.procs")],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                try:
                    out, _ = hog.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    hog.kill()
                    out, _ = hog.communicate()
                    pytest.fail(f"the greedy trainer was never stopped:\n{out[-2000:]}")
                dosd_adj = int(open(f"/proc/{proc.pid}/oom_score_adj").read())
                assert dosd_adj == -900 or "attached 1000" in out, out[-2000:]
                assert hog.returncode == -9, f"greedy trainer exit {hog.returncode}:\n{out[-2000:]}"
                assert proc.poll() is None, "dosd was killed for the trainer's memory"
                # dosd and the other session live on.
                cg.limit(-1 if cg.limit_file == "memory.limit_in_bytes" else "max")
                victim.zero_grad()
                model(x).pow(2).mean().backward()
                victim.step()
                assert float(victim.state_dict()["state"][0]["step"]) == 2
    finally:
        cg.remove()
