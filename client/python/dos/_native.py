"""ctypes binding of libdos_client (client/include/dos/dos.h).

Mirrors the header: the status and dtype enums, the structs and every
function's signature. tests/python/test_native_abi.py parses dos.h and checks
these definitions against it, so a change to the header that is not made here
fails CI. Calls that can fail go through dos._errors (check/call), the one
place that turns a dos_status into DosError.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Optional

from dos._lib import find_library

__all__ = ["lib", "Status", "DType", "Tensor", "Hparams", "AttachOptions", "StepArgs",
           "StepResult", "RegisterOptions", "DaemonInfo", "RegisterProgress", "DTYPE_F32", "DTYPE_BF16", "DTYPE_F16",
           "STATUS_NAMES", "SIGNATURES", "cuda_supported", "default_socket", "ptr"]


class Status(enum.IntEnum):
    """dos_status: gRPC canonical codes."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class DType(enum.IntEnum):
    """dos_dtype (values match dos.v1.DType)."""
    F32 = 1
    BF16 = 2
    F16 = 3


DTYPE_F32 = DType.F32
DTYPE_BF16 = DType.BF16
DTYPE_F16 = DType.F16
STATUS_NAMES = {int(s): s.name for s in Status}


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
                ("gradients_checked", ctypes.c_int32),
                ("skip_tensors", ctypes.POINTER(ctypes.c_uint32)),
                ("num_skip_tensors", ctypes.c_size_t)]


MAX_SKIP_TENSORS = 4096  # DOS_MAX_SKIP_TENSORS


class StepResult(ctypes.Structure):
    _fields_ = [("found_inf", ctypes.c_int32), ("step", ctypes.c_int64),
                ("wall_us", ctypes.c_double), ("update_us", ctypes.c_double)]


class DaemonInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_int32), ("version", ctypes.c_char_p),
                ("protocol_version", ctypes.c_uint32),
                ("client_protocol_version", ctypes.c_uint32),
                ("client_version", ctypes.c_char_p), ("health", ctypes.c_char_p),
                ("sessions", ctypes.c_uint32)]


class RegisterProgress(ctypes.Structure):
    _fields_ = [("phase", ctypes.c_int32), ("phase_name", ctypes.c_char_p),
                ("bytes_done", ctypes.c_uint64), ("bytes_total", ctypes.c_uint64),
                ("phase_seconds", ctypes.c_double), ("total_seconds", ctypes.c_double)]


class GpuLease(ctypes.Structure):
    _fields_ = [("lease_bytes", ctypes.c_uint64), ("budget_bytes", ctypes.c_uint64),
                ("peak_bytes", ctypes.c_uint64)]


class StateView(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("map_bytes", ctypes.c_uint64),
                ("numel", ctypes.c_uint64), ("elem_bytes", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32)]


# C struct name in dos.h -> its ctypes mirror (checked by test_native_abi.py).
STRUCTS = {
    "dos_daemon_info": DaemonInfo,
    "dos_register_progress": RegisterProgress,
    "dos_attach_options": AttachOptions,
    "dos_tensor": Tensor,
    "dos_hparams": Hparams,
    "dos_register_options": RegisterOptions,
    "dos_step_args": StepArgs,
    "dos_step_result": StepResult,
    "dos_gpu_lease": GpuLease,
    "dos_state_view": StateView,
}

_S = ctypes.c_int  # dos_status
_P = ctypes.c_void_p
_F = ctypes.c_void_p  # float* (tensor data, passed as an address)
# name -> (restype, argtypes), in dos.h's order.
SIGNATURES = {
    "dos_last_error": (ctypes.c_char_p, []),
    "dos_daemon_probe": (_S, [ctypes.c_char_p, ctypes.c_int64, ctypes.POINTER(DaemonInfo)]),
    "dos_version": (ctypes.c_char_p, []),
    "dos_cuda_supported": (ctypes.c_int32, []),
    "dos_default_socket": (ctypes.c_char_p, []),
    "dos_attach_options_init": (None, [ctypes.POINTER(AttachOptions)]),
    "dos_attach": (_S, [ctypes.POINTER(AttachOptions), ctypes.POINTER(_P)]),
    "dos_detach": (_S, [_P]),
    "dos_session_id": (ctypes.c_uint64, [_P]),
    # Crash survival: a restarted trainer resumes its session (kept for dosd's
    # --session_lease) with the id and token the dead process saved.
    "dos_session_token": (ctypes.c_char_p, [_P]),
    "dos_resume": (_S, [ctypes.POINTER(AttachOptions), ctypes.c_uint64, ctypes.c_char_p,
                        ctypes.POINTER(_P)]),
    "dos_session_resumed": (ctypes.c_int32, [_P]),
    "dos_buffer_alloc": (_S, [_P, ctypes.c_uint64, ctypes.POINTER(_P)]),
    "dos_hparams_init_adamw": (None, [ctypes.POINTER(Hparams)]),
    "dos_set_state_format": (_S, [_P, ctypes.c_int]),
    "dos_register": (_S, [_P, ctypes.POINTER(Tensor), ctypes.c_size_t, ctypes.POINTER(Hparams),
                          ctypes.c_size_t, ctypes.POINTER(RegisterOptions)]),
    # Safe from another thread while dos_register runs (dos._progress).
    "dos_register_progress_read": (_S, [_P, ctypes.POINTER(RegisterProgress)]),
    "dos_step_args_init": (None, [ctypes.POINTER(StepArgs)]),
    "dos_step_begin": (_S, [_P, ctypes.POINTER(StepArgs)]),
    "dos_step_wait": (_S, [_P, ctypes.c_int64, ctypes.POINTER(StepResult)]),
    # Stream-ordered steps and per-subgroup progress (GPU mode: the trainer's
    # CUDA stream, as an integer cudaStream_t, waits instead of its thread).
    "dos_stream_sync_supported": (ctypes.c_int32, [_P]),
    "dos_step_begin_on_stream": (_S, [_P, ctypes.POINTER(StepArgs), _P]),
    "dos_tensor_subgroups": (_S, [_P, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32),
                                  ctypes.POINTER(ctypes.c_uint32)]),
    "dos_wait_subgroups": (_S, [_P, ctypes.c_uint32, ctypes.c_uint32, _P, ctypes.c_int64]),
    # Early steps (work during backward; dos.h).
    "dos_step_begin_early": (_S, [_P, ctypes.POINTER(StepArgs), ctypes.c_uint32, _P]),
    "dos_mark_ready": (_S, [_P, ctypes.c_uint32, ctypes.c_uint32, _P]),
    "dos_step_verdict": (_S, [_P, ctypes.POINTER(StepArgs), _P]),
    "dos_step_abandon": (_S, [_P]),
    "dos_last_step_early": (_S, [_P, ctypes.POINTER(ctypes.c_int32),
                                 ctypes.POINTER(ctypes.c_double),
                                 ctypes.POINTER(ctypes.c_double),
                                 ctypes.POINTER(ctypes.c_uint64)]),
    "dos_set_step_delay": (_S, [_P, ctypes.c_uint32]),
    "dos_step_finish_delayed": (_S, [_P, _P, ctypes.c_int64]),
    "dos_step_gradients_rewritten": (_S, [_P]),
    "dos_step_stop_captures": (_S, [_P, _P, ctypes.c_int64]),
    "dos_step_gradients_scaled": (_S, [_P, ctypes.c_float]),
    "dos_step_gradients_scaled_on_stream": (_S, [_P, _P, _P]),
    "dos_last_step_delay": (_S, [_P, ctypes.POINTER(ctypes.c_uint32),
                                 ctypes.POINTER(ctypes.c_uint64)] +
                            [ctypes.POINTER(ctypes.c_double)] * 5),
    "dos_step": (_S, [_P, ctypes.POINTER(StepArgs), ctypes.POINTER(StepResult)]),
    "dos_state_read": (_S, [_P, ctypes.c_uint32, _F, _F, _F, ctypes.POINTER(ctypes.c_int64)]),
    "dos_state_write": (_S, [_P, ctypes.c_uint32, _F, _F, _F, ctypes.c_int64]),
    "dos_state_read_range": (_S, [_P, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64, _F, _F,
                                  _F, ctypes.POINTER(ctypes.c_int64)]),
    "dos_state_write_range": (_S, [_P, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64, _F, _F,
                                   _F, ctypes.c_int64]),
    # Zero-copy state views (state_dict() over dosd's memory).
    "dos_state_views_fetch": (_S, [_P, ctypes.POINTER(ctypes.c_uint32),
                                   ctypes.POINTER(ctypes.c_uint32)]),
    "dos_state_view_step": (_S, [_P, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int64)]),
    "dos_state_view_map": (_S, [_P, ctypes.c_uint32, ctypes.c_int32, ctypes.POINTER(StateView)]),
    "dos_state_view_modified": (_S, [_P, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int32)]),
    "dos_state_view_unmap": (_S, [_P, ctypes.c_uint64]),
    # GPU mode: the memory this trainer lends dosd for its resident tier.
    "dos_set_gpu_lease": (_S, [_P, ctypes.POINTER(GpuLease)]),
    "dos_set_policy": (_S, [_P, ctypes.c_char_p]),
}

DOS_EARLY_NO_VERDICT = 1  # dos.h: dos_step_begin_early's flag

lib = find_library()
for _name, (_res, _args) in SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _res
    _fn.argtypes = _args


def cuda_supported() -> bool:
    """True when the loaded libdos_client can register CUDA device memory."""
    return bool(lib.dos_cuda_supported())


def default_socket() -> str:
    return lib.dos_default_socket().decode()


def ptr(value: Optional[int]) -> Optional[int]:
    return None if value is None else ctypes.c_void_p(value).value
