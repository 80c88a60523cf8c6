"""ctypes binding of libdos_client (client/include/dos/dos.h).

The package is pure Python: it loads the C library at import time and never
compiles against torch, so one copy works with any torch and Python 3.11+.

Library lookup, first hit wins:
  1. $DOS_CLIENT_LIB (path to libdos_client.so)
  2. libdos_client.so next to this package (installed wheels / bundles)
  3. the build trees of a source checkout (build/client/src, build-*/client/src)
  4. the dynamic linker's search path (ldconfig, LD_LIBRARY_PATH)

Every C call goes through `_check`, the one place that turns a dos_status
into `DosError(code, message)`.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Optional

__all__ = ["DosError", "lib", "check", "Tensor", "Hparams", "AttachOptions", "StepArgs",
           "StepResult", "RegisterOptions", "DTYPE_F32", "DTYPE_BF16", "DTYPE_F16",
           "STATUS_NAMES"]

DTYPE_F32 = 1
DTYPE_BF16 = 2
DTYPE_F16 = 3

STATUS_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class DosError(RuntimeError):
    """A failed DOS call: `code` is the dos_status (gRPC canonical code),
    `code_name` its name, `message` what was wrong and what to do."""

    def __init__(self, code: int, message: str):
        self.code = int(code)
        self.code_name = STATUS_NAMES.get(self.code, str(self.code))
        self.message = message
        super().__init__(f"{self.code_name}: {message}")


class AttachOptions(ctypes.Structure):
    _fields_ = [("socket_path", ctypes.c_char_p), ("client_name", ctypes.c_char_p),
                ("rank", ctypes.c_int32), ("local_rank", ctypes.c_int32),
                ("world_size", ctypes.c_int32), ("timeout_ms", ctypes.c_int64)]


class Tensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("param_dtype", ctypes.c_int),
                ("param", ctypes.c_void_p), ("grad_dtype", ctypes.c_int),
                ("grad", ctypes.c_void_p), ("numel", ctypes.c_uint64),
                ("group", ctypes.c_uint32)]


class Hparams(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
                ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("decoupled_weight_decay", ctypes.c_int32)]


class RegisterOptions(ctypes.Structure):
    _fields_ = [("subgroup_size", ctypes.c_uint64)]


class StepArgs(ctypes.Structure):
    _fields_ = [("groups", ctypes.POINTER(Hparams)), ("num_groups", ctypes.c_size_t),
                ("grad_scale", ctypes.c_double), ("clip_coef", ctypes.c_double),
                ("gradients_checked", ctypes.c_int32)]


class StepResult(ctypes.Structure):
    _fields_ = [("found_inf", ctypes.c_int32), ("step", ctypes.c_int64),
                ("wall_us", ctypes.c_double), ("update_us", ctypes.c_double)]


def _candidates():
    env = os.environ.get("DOS_CLIENT_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libdos_client.so")
    repo = os.path.abspath(os.path.join(here, "..", "..", ".."))
    yield os.path.join(repo, "build", "client", "src", "libdos_client.so")
    yield from sorted(glob.glob(os.path.join(repo, "build*", "client", "src", "libdos_client.so")))
    yield "libdos_client.so.1"


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
    raise ImportError(
        "dos: cannot load libdos_client.so; tried " + ", ".join(tried) +
        ". Build it (cmake --build build --target dos_client) or set DOS_CLIENT_LIB to its path.")


lib = _load()

_S = ctypes.c_int  # dos_status
_P = ctypes.c_void_p
_sigs = {
    "dos_last_error": (ctypes.c_char_p, []),
    "dos_default_socket": (ctypes.c_char_p, []),
    "dos_cuda_supported": (ctypes.c_int32, []),
    "dos_attach_options_init": (None, [ctypes.POINTER(AttachOptions)]),
    "dos_attach": (_S, [ctypes.POINTER(AttachOptions), ctypes.POINTER(_P)]),
    "dos_detach": (_S, [_P]),
    "dos_session_id": (ctypes.c_uint64, [_P]),
    # Crash survival: a restarted trainer resumes its session (kept for dosd's
    # --session_lease) with the id and token the dead process saved.
    "dos_session_token": (ctypes.c_char_p, [_P]),
    "dos_session_resumed": (ctypes.c_int32, [_P]),
    "dos_resume": (_S, [ctypes.POINTER(AttachOptions), ctypes.c_uint64, ctypes.c_char_p,
                        ctypes.POINTER(_P)]),
    "dos_buffer_alloc": (_S, [_P, ctypes.c_uint64, ctypes.POINTER(_P)]),
    "dos_hparams_init_adamw": (None, [ctypes.POINTER(Hparams)]),
    "dos_register": (_S, [_P, ctypes.POINTER(Tensor), ctypes.c_size_t, ctypes.POINTER(Hparams),
                          ctypes.c_size_t, ctypes.POINTER(RegisterOptions)]),
    "dos_step_args_init": (None, [ctypes.POINTER(StepArgs)]),
    "dos_step_begin": (_S, [_P, ctypes.POINTER(StepArgs)]),
    "dos_step_wait": (_S, [_P, ctypes.c_int64, ctypes.POINTER(StepResult)]),
    "dos_step": (_S, [_P, ctypes.POINTER(StepArgs), ctypes.POINTER(StepResult)]),
    # Stream-ordered steps and per-subgroup progress (GPU mode: the trainer's
    # CUDA stream, as an integer cudaStream_t, waits instead of its thread).
    "dos_stream_sync_supported": (ctypes.c_int32, [_P]),
    "dos_step_begin_on_stream": (_S, [_P, ctypes.POINTER(StepArgs), _P]),
    "dos_tensor_subgroups": (_S, [_P, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32),
                                  ctypes.POINTER(ctypes.c_uint32)]),
    "dos_wait_subgroups": (_S, [_P, ctypes.c_uint32, ctypes.c_uint32, _P, ctypes.c_int64]),
    "dos_state_read": (_S, [_P, ctypes.c_uint32, _P, _P, _P, ctypes.POINTER(ctypes.c_int64)]),
    "dos_state_write": (_S, [_P, ctypes.c_uint32, _P, _P, _P, ctypes.c_int64]),
    "dos_set_policy": (_S, [_P, ctypes.c_char_p]),
}
for _name, (_res, _args) in _sigs.items():
    _fn = getattr(lib, _name)
    _fn.restype = _res
    _fn.argtypes = _args


def check(status: int) -> None:
    """Raises DosError for a non-OK dos_status (the one conversion point)."""
    if status != 0:
        raw = lib.dos_last_error()
        raise DosError(status, raw.decode("utf-8", "replace") if raw else "")


def cuda_supported() -> bool:
    """True when the loaded libdos_client can register CUDA device memory."""
    return bool(lib.dos_cuda_supported())


def default_socket() -> str:
    return lib.dos_default_socket().decode()


def call(name: str, *args) -> None:
    """Calls a dos_* function that returns dos_status and raises on error."""
    check(getattr(lib, name)(*args))


def ptr(value: Optional[int]) -> Optional[int]:
    return None if value is None else ctypes.c_void_p(value).value
