"""ctypes binding of liboffload_c.so (optimizer_client/capi/offload_c.h), and where to find it.

The library is looked for, in order: ``$OFFLOAD_LIBRARY`` (a file), the package's own copy
(``offload/lib/liboffload_c.so``, what the wheel of ``scripts/build-wheel`` installs), then, in a
source tree only, ``$OFFLOAD_BUILD_DIR/lib`` (relative to the repository root unless absolute) or
the repository's ``build/lib``, then the system's library path (an installed
``liboffload_c.so``). ``cpu_optimizer_server`` likewise: the package's ``offload/bin/``, the build
tree's ``bin/``, then ``PATH``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
from typing import Optional

ABI_VERSION = 4
FP16, BF16 = 2, 3
ADAM, ADAMW = 1, 2
FORM_TORCH_1_13, FORM_LERP = 0, 1  # OffloadConfig.adam_form
MASTER, EXP_AVG, EXP_AVG_SQ = 1, 2, 3
TIERS = {"auto": 0, "memory": 1, "disk": 2}

_PACKAGE = pathlib.Path(__file__).resolve().parent
_REPO = _PACKAGE.parents[1]
# A source tree (python/offload in the repository) has build trees beside it; an installed package
# (site-packages/offload) has not, and a build/ that happens to lie two levels up is not ours.
_IN_SOURCE_TREE = (_REPO / "CMakeLists.txt").is_file() and (_REPO / "python" / "offload").is_dir()

# absl::StatusCode names, for messages.
_CODES = {1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
          5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
          9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
          13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED"}


class OffloadError(RuntimeError):
    """A call into liboffload_c failed; ``code`` is the absl::StatusCode."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{_CODES.get(code, code)}: {message}")
        self.code = code


class Group(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64),
                ("kind", ctypes.c_int32), ("lr", ctypes.c_double), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double),
                ("weight_decay", ctypes.c_double)]


class Config(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_int32), ("job_id", ctypes.c_char_p),
                ("num_params", ctypes.c_uint64), ("world_size", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("create_job", ctypes.c_int32),
                ("dtype", ctypes.c_int32), ("num_groups", ctypes.c_int32),
                ("groups", ctypes.POINTER(Group)), ("num_shards", ctypes.c_int32),
                ("shard_addresses", ctypes.POINTER(ctypes.c_char_p)),
                ("threads", ctypes.c_int32), ("transport", ctypes.c_char_p),
                ("token", ctypes.c_char_p), ("tls_ca", ctypes.c_char_p),
                ("tls_cert", ctypes.c_char_p), ("tls_key", ctypes.c_char_p),
                ("tls_server_name", ctypes.c_char_p), ("call_timeout_seconds", ctypes.c_double),
                ("loss_scale_init", ctypes.c_float), ("loss_scale_window", ctypes.c_int32),
                ("grad_clip", ctypes.c_float), ("trace_file", ctypes.c_char_p),
                ("state_tier", ctypes.c_int32), ("adam_form", ctypes.c_int32)]


class NamedTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_uint64), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64))]


class RangeStep(ctypes.Structure):
    """OffloadRangeStep: t 0 leaves the range alone this step; t > 0 is its bias-correction
    step."""
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64), ("t", ctypes.c_uint64)]


class StepReport(ctypes.Structure):
    _fields_ = [("step", ctypes.c_uint64), ("skipped", ctypes.c_int32),
                ("loss_scale", ctypes.c_float), ("next_loss_scale", ctypes.c_float),
                ("grad_norm", ctypes.c_double), ("clip_coef", ctypes.c_float),
                ("grad_multiplier", ctypes.c_float), ("adam_step", ctypes.c_uint64),
                ("skipped_steps", ctypes.c_uint64), ("early_updated", ctypes.c_uint64),
                ("early_rolled_back", ctypes.c_uint64)]


def _build_dir() -> pathlib.Path:
    build = pathlib.Path(os.environ.get("OFFLOAD_BUILD_DIR", "build"))
    return build if build.is_absolute() else _REPO / build


def library_path() -> str:
    """The liboffload_c.so this package loads (see the module's docstring for the order)."""
    explicit = os.environ.get("OFFLOAD_LIBRARY")
    if explicit:
        return explicit
    own = _PACKAGE / "lib" / "liboffload_c.so"
    if own.exists():
        return str(own)
    built = _build_dir() / "lib" / "liboffload_c.so"
    if _IN_SOURCE_TREE and built.exists():
        return str(built)
    found = ctypes.util.find_library("offload_c")
    if found:
        return found
    if not _IN_SOURCE_TREE:
        raise OffloadError(5, f"liboffload_c.so is missing: this package has no {own} and none is "
                              "installed: reinstall the wheel of scripts/build-wheel, or set "
                              "OFFLOAD_LIBRARY")
    raise OffloadError(5, f"liboffload_c.so is not built ({built} is missing) and not installed: "
                          "run ./scripts/build, or set OFFLOAD_BUILD_DIR or OFFLOAD_LIBRARY")


def server_binary() -> str:
    """The package's own cpu_optimizer_server, else the build tree's, else the one on PATH."""
    own = _PACKAGE / "bin" / "cpu_optimizer_server"
    if own.exists():
        return str(own)
    built = _build_dir() / "bin" / "cpu_optimizer_server"
    if _IN_SOURCE_TREE and built.exists():
        return str(built)
    import shutil
    found = shutil.which("cpu_optimizer_server")
    if found:
        return found
    if not _IN_SOURCE_TREE:
        raise OffloadError(5, f"cpu_optimizer_server is missing: this package has no {own} and "
                              "none is on PATH: reinstall the wheel of scripts/build-wheel")
    raise OffloadError(5, f"cpu_optimizer_server is not built ({built} is missing) and not on "
                          "PATH: run ./scripts/build, or set OFFLOAD_BUILD_DIR")


_lib: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    """The loaded library, with every function's signature declared."""
    global _lib
    if _lib is not None:
        return _lib
    L = ctypes.CDLL(library_path())
    P = ctypes.c_void_p
    u64, i32, f32, dbl = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_double
    fptr = ctypes.POINTER(ctypes.c_float)
    dptr = ctypes.POINTER(ctypes.c_double)
    sigs = {
        "offload_last_error": (ctypes.c_char_p, []),
        "offload_abi_version": (i32, []),
        "offload_create": (i32, [ctypes.POINTER(Config), ctypes.POINTER(P)]),
        "offload_destroy": (None, [P]),
        "offload_drop_job": (i32, [P]),
        "offload_padded_length": (u64, [P]),
        "offload_partition_offset": (u64, [P]),
        "offload_partition_length": (u64, [P]),
        "offload_transport_names": (ctypes.c_char_p, [P]),
        "offload_read_state": (i32, [P, i32, u64, u64, P]),
        "offload_load_begin": (i32, [P, i32, u64, u64]),
        "offload_load_chunk": (i32, [P, i32, u64, u64, P]),
        "offload_load_finish": (i32, [P]),
        "offload_load_abort": (None, [P]),
        "offload_read_weights16": (i32, [P, u64, u64, P]),
        "offload_save_checkpoint": (i32, [P, ctypes.c_char_p, ctypes.POINTER(NamedTensor), i32,
                                          u64, u64, ctypes.c_char_p, i32, ctypes.c_char_p, u64]),
        "offload_find_checkpoint": (i32, [ctypes.c_char_p, ctypes.c_char_p, u64]),
        "offload_check_checkpoint": (i32, [ctypes.c_char_p, ctypes.POINTER(NamedTensor), i32]),
        "offload_load_checkpoint": (i32, [P, ctypes.c_char_p, ctypes.POINTER(NamedTensor), i32]),
        "offload_loss_scale": (f32, [P]),
        "offload_get_scaler": (None, [P, fptr, ctypes.POINTER(ctypes.c_uint32),
                                      ctypes.POINTER(u64)]),
        "offload_set_scaler": (i32, [P, f32, ctypes.c_uint32, u64]),
        "offload_begin_step": (i32, [P, u64]),
        "offload_in_step": (i32, [P]),
        "offload_gradient_buffer": (P, [P, u64, u64]),
        "offload_gradients_ready": (i32, [P, u64, u64, P]),
        "offload_send_gradients_f32": (i32, [P, u64, P, u64, f32]),
        "offload_next_micro_batch": (i32, [P]),
        "offload_local_stats": (i32, [P, ctypes.POINTER(dbl)]),
        "offload_set_range_steps": (i32, [P, ctypes.POINTER(RangeStep), i32]),
        "offload_speculate": (i32, [P, dptr, i32, ctypes.POINTER(RangeStep), i32]),
        "offload_update_ready": (i32, [P, u64, u64]),
        "offload_read_gradient_sum": (i32, [P, u64, u64, P]),
        "offload_restore_gradient_sum": (i32, [P, P]),
        "offload_read_checkpoint_gradient_sum": (i32, [ctypes.c_char_p, ctypes.POINTER(NamedTensor),
                                                  i32, u64, P]),
        "offload_commit": (i32, [P, P, dptr, i32, f32, P, ctypes.POINTER(StepReport)]),
        "offload_commit_async": (i32, [P, P, dptr, i32, f32, P, ctypes.POINTER(StepReport)]),
        "offload_wait_commit": (i32, [P, ctypes.POINTER(StepReport)]),
        "offload_preview": (i32, [P, P, f32, ctypes.POINTER(StepReport)]),
        "offload_abort_step": (None, [P]),
        "offload_trace_phase": (None, [P, ctypes.c_char_p, u64, dbl, dbl]),
        "offload_write_trace": (i32, [P]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(L, name)
        fn.restype = restype
        fn.argtypes = argtypes
    if L.offload_abi_version() != ABI_VERSION:
        raise OffloadError(9, f"{library_path()} speaks ABI version {L.offload_abi_version()}, "
                              f"this package {ABI_VERSION}: rebuild one of them")
    _lib = L
    return L


def check(rc: int) -> None:
    """Raises OffloadError with the library's message unless rc is 0."""
    if rc != 0:
        raise OffloadError(rc, lib().offload_last_error().decode("utf-8", "replace"))
