"""Where a rebuild keeps the optimizer state it carries from one dosd
session to the next (add_param_group after steps, parameters moved or
thawed: Assembly.rebuild).

dosd registers a session's tensors once, so a rebuild reads every tensor's
state out, closes the session and writes it into a new one: 12 bytes a
parameter (81 GB at 7B) between the two. Held in this process's memory, that
is a second copy of what dosd holds, and at 7B the kernel's OOM killer takes
the trainer or dosd with every session on the node. So the state is held in
memory only where the host (and this process's cgroup) has room for it twice
over; otherwise it goes, tensor by tensor, into an unnamed file on a disk
(DOS_SPILL_DIR, else the temporary directory, /var/tmp or the working
directory, whichever is on a disk and has room), reserved whole before the
old session is touched and read back one tensor at a time: the process holds
one tensor's state at most. With neither, the rebuild is refused before
anything changes, naming the sizes and the fixes. DOS_SPILL=always spills
whatever the memory (a trainer sharing its host with other jobs), never holds
it in memory as before.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from dos._entry import local_of
from dos._errors import DosError
from dos._native import Status

__all__ = ["Carry", "Saved", "in_memory", "reserve", "restored", "rescue",
           "rescued_state_dict", "spill_mode"]

# File systems whose files are memory (statfs f_type): a spill there is the
# copy in memory again. devtmpfs reports tmpfs's.
_RAM_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}
_PROC_FS = 0x9FA0
# Room left on a disk beside the spill, and carried state held in memory
# whatever the host says (a small model's rebuild never asks the disk).
_DISK_MARGIN = 1 << 30
_SMALL = 256 << 20
# Memory kept free beside the carried state and the new session (dosd's own
# reserve is 1 GiB; a CPU model's parameters move between arenas meanwhile).
_MARGIN = 2 << 30


def available_memory() -> int:
    """Bytes this process may still take: the host's MemAvailable, or less
    where a memory cgroup above it leaves less; shared by the node's ranks
    (LOCAL_WORLD_SIZE), which rebuild together."""
    avail = _meminfo("MemAvailable")
    limit = _cgroup_room()
    avail = avail if limit is None else min(avail, limit)
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return avail // ranks


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_room() -> Optional[int]:
    """The least room (limit - usage) of this process's memory cgroups, its
    own and every one above it (cgroup v2: Slurm's and systemd's limits sit
    on ancestors; v1: the memory controller's), None without a limit."""
    rooms = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    except OSError:
        return None
    for hid, controllers, path in (ln for ln in lines if len(ln) == 3):
        if hid == "0":
            roots, files = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), ("memory.max",
                                                                      "memory.current")
        elif "memory" in controllers.split(","):
            roots, files = ("/sys/fs/cgroup/memory",), ("memory.limit_in_bytes",
                                                        "memory.usage_in_bytes")
        else:
            continue
        for root in roots:
            d = os.path.join(root, path.lstrip("/"))
            while d.startswith(root):
                limit, used = _read_int(os.path.join(d, files[0])), _read_int(
                    os.path.join(d, files[1]))
                if limit is not None and used is not None and limit < (1 << 60):
                    rooms.append(max(0, limit - used))
                if d == root:
                    break
                d = os.path.dirname(d)
    return min(rooms) if rooms else None


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def fs_type(path: str) -> str:
    """"tmpfs", "ramfs", "hugetlbfs" or "proc" for a file system of those
    types at `path` (statfs), "" for any other or when it cannot be told."""
    buf = _StatFs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return ""
    kind = buf.f_type & 0xFFFFFFFF
    return _RAM_FS.get(kind, "proc" if kind == _PROC_FS else "")


def _candidates() -> List[str]:
    chosen = os.environ.get("DOS_SPILL_DIR")
    if chosen:
        return [chosen]
    out: List[str] = []
    for d in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        if os.path.realpath(d) not in (os.path.realpath(o) for o in out):
            out.append(d)
    return out


def _disk_room(d: str) -> Tuple[int, str]:
    """Free bytes of directory `d` for a spill, and why it cannot take one ("" if it can)."""
    if not os.path.isdir(d):
        return 0, "no such directory"
    kind = fs_type(d)
    if kind in _RAM_FS.values():
        return 0, f"{kind}, which is memory"
    if not os.access(d, os.W_OK | os.X_OK):
        return 0, "not writable"
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize, ""


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def spill_mode() -> str:
    """DOS_SPILL: auto (the default: a disk where memory is short), always or never."""
    mode = os.environ.get("DOS_SPILL", "auto")
    if mode not in ("auto", "always", "never"):
        raise DosError(Status.INVALID_ARGUMENT, f"dos.torch: DOS_SPILL={mode!r}: use auto "
                       "(the default: a disk where memory is short), always or never")
    return mode


def in_memory(nbytes: int, room: int) -> bool:
    """Whether `nbytes` of state may be held in this process's memory, where
    holding them takes `room` bytes in all (DOS_SPILL decides first)."""
    mode = spill_mode()
    return mode == "never" or nbytes == 0 or (mode == "auto" and (
        nbytes <= _SMALL or room <= available_memory()))


def reserve(nbytes: int) -> Tuple[Optional[Any], str, str]:
    """An unnamed file of `nbytes`, reserved whole (a full disk fails now,
    not mid-way), on the first spill directory with room: (file, directory,
    ""), or (None, "", why each directory was passed over)."""
    tried = []
    for d in _candidates():
        free, bad = _disk_room(d)
        if not bad and free < nbytes + _DISK_MARGIN:
            bad = f"{_gb(free)} free"
        if not bad:
            f = None
            try:
                f = tempfile.TemporaryFile(dir=d)  # unnamed (O_TMPFILE) or unlinked at once
                os.posix_fallocate(f.fileno(), 0, nbytes)
                return f, d, ""
            except BaseException as err:
                if f is not None:
                    f.close()
                if not isinstance(err, OSError):
                    raise
                bad = str(err)  # no inodes, no room after all: the next directory
        tried.append(f"{d} ({bad})")
    return None, "", "; ".join(tried)


class Carry:
    """The state of one rebuild, `nbytes` in all (12 bytes a parameter
    carried, fp32 whatever the state's format): in memory, or in a file."""

    def __init__(self, nbytes: int, why: str, adding: int = 0):
        """`adding`: bytes of state the new session has beside the carried
        (a group added, parameters unfrozen), which dosd takes from the same
        memory while the carried state is held."""
        self.nbytes = nbytes
        self._file = None
        self._end = 0
        self.path = None  # the spill's directory (None: in memory)
        room = nbytes * 2 + adding + _MARGIN  # held here, and the new session
        if in_memory(nbytes, room):
            return
        f, d, tried = reserve(nbytes)
        if f is None:
            raise DosError(Status.RESOURCE_EXHAUSTED, (
                f"dos.torch: {why} rebuilds dosd's session, carrying {_gb(nbytes)} of optimizer "
                f"state from the old session to the new one; this process has "
                f"{_gb(available_memory())} of memory available ({_gb(room)} needed to hold it "
                f"in memory beside the new session) and no disk with room for it: {tried}. Set "
                f"DOS_SPILL_DIR to a directory on a disk with {_gb(nbytes + _DISK_MARGIN)} free, "
                "or make the change before the first step (build the optimizer after moving or "
                "unfreezing the model; pass every param group at construction). Nothing was "
                "changed: the optimizer goes on as it was"))
        self._file, self.path = f, d
        weakref.finalize(self, f.close)  # when the rebuild lets go of it

    def keep(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             **rest) -> Dict[str, Any]:
        """One tensor's state as saved_state() hands it to a rebuild:
        the arrays themselves, or where they lie in the spill file."""
        if self._file is None:
            return dict(master_param=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, **rest)
        n = master.numel()
        at = self._end
        for i, t in enumerate((master, exp_avg, exp_avg_sq)):
            _transfer(os.pwrite, self._file.fileno(), _float32(t), at + i * 4 * n)
        self._end += 12 * n
        return dict(spilled=(self, at, n), **rest)

    def load(self, at: int, n: int) -> torch.Tensor:
        buf = torch.empty(3, n, dtype=torch.float32)
        try:  # the three rows lie one after another, as in the file
            _transfer(lambda fd, mv, off: os.preadv(fd, [mv], off), self._file.fileno(), buf, at)
        except (OSError, ValueError) as err:
            raise DosError(Status.DATA_LOSS, (
                f"dos.torch: reading the optimizer state back from the rebuild's spill file in "
                f"{self.path} failed ({err}); the old session is closed, so the state of the "
                "steps so far is lost: load the last checkpoint (opt.load_state_dict) and "
                "check that disk")) from err
        return buf

    def close(self) -> None:
        """Gives the spill file (and its disk space) back now."""
        if self._file is not None:
            self._file.close()


class Saved(dict):
    """saved_state()'s answer, {id(param): state}, holding its Carry:
    `with` it, or close() it, to give a spill file back once the rebuild
    is done (also when it failed: a traceback would keep it)."""

    def __init__(self, carry: Carry):
        super().__init__()
        self.carry = carry

    def close(self) -> None:
        self.carry.close()

    def __enter__(self) -> "Saved":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def restored(s: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A saved tensor's state (Carry.keep) with its arrays in memory."""
    if s is None or "spilled" not in s:
        return s
    carry, at, n = s["spilled"]
    buf = carry.load(at, n)
    rest = {k: v for k, v in s.items() if k != "spilled"}
    return dict(master_param=buf[0], exp_avg=buf[1], exp_avg_sq=buf[2], **rest)


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)


def _transfer(op, fd: int, t: torch.Tensor, offset: int) -> None:
    """All of `t`'s bytes through `op` (os.pwrite, or a preadv into it) at `offset`."""
    n = t.numel() * t.element_size()
    mv = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else b""
    done = 0
    while done < n:
        k = op(fd, mv[done:], offset + done)
        if k <= 0:
            raise DosError(Status.INTERNAL, f"dos.torch: the rebuild's spill file ended at byte "
                           f"{offset + done} of {offset + n}")
        done += k


def rescue(saved: Saved, groups: list) -> Tuple[str, str]:
    """After a rebuild whose new session dosd refused (the old one closed):
    the carried state written, one tensor at a time, as torch files in a
    new folder (the working directory, else the temporary directories),
    with an index of `groups` (the param_groups, params as indices, as
    torch's state_dict() numbers them). Returns (folder, "") or ("", why none
    could take it). rescued_state_dict() reads it back."""
    params = [p for g in groups for p in g["params"]]
    tried = []
    for d in (os.getcwd(), tempfile.gettempdir(), "/var/tmp"):
        folder = None
        try:
            folder = tempfile.mkdtemp(prefix="dos-rescued-state-", dir=d)
            for i, p in enumerate(params):
                s = restored(saved.get(id(p)))
                if s is None or s.get("fresh"):
                    continue
                keep = ["exp_avg", "exp_avg_sq"] + (["master_param"] if p.dtype != torch.float32
                                                    else [])
                state = {k: s[k].reshape(local_of(p).shape) for k in keep}  # a shard's own
                state["step"] = torch.tensor(float(s["step"]))
                torch.save(state, os.path.join(folder, f"{i}.pt"))
            index = [{**{k: v for k, v in g.items() if k != "params"},
                      "params": list(range(at, at + len(g["params"])))}
                     for at, g in zip(_starts(groups), groups)]
            torch.save({"param_groups": index}, os.path.join(folder, "index.pt"))
            return folder, ""
        except (OSError, RuntimeError, DosError) as err:
            tried.append(f"{d} ({err})")
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    return "", "; ".join(tried)


def _starts(groups: list) -> List[int]:
    out, at = [], 0
    for g in groups:
        out.append(at)
        at += len(g["params"])
    return out


def rescued_state_dict(folder: str) -> Dict[str, Any]:
    """The optimizer state dict (torch.optim.AdamW's format) a refused
    rebuild wrote into `folder`: load it into the optimizer built again over
    the same param groups. Tensors are mapped from their files where torch
    can (torch.load(mmap=True), torch >= 2.1), not read into memory."""
    def load(name):
        path = os.path.join(folder, name)
        try:
            return torch.load(path, mmap=True, weights_only=True)
        except TypeError:  # torch < 2.1
            return torch.load(path)
    index = load("index.pt")
    state = {int(n[:-3]): load(n) for n in os.listdir(folder)
             if n.endswith(".pt") and n != "index.pt"}
    return {"state": state, "param_groups": index["param_groups"]}
