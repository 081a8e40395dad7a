"""The one binding of liboffload_c.so (optimizer_client/capi/offload_c.h): where the library and
the server are found, the ctypes mirror of the header's structs and prototypes, and its errors.

The library is looked for, in order: ``$OFFLOAD_LIBRARY`` (a file), the package's own copy
(``offload/lib/liboffload_c.so``, what the wheel of ``scripts/build-wheel`` installs), then, in a
source tree only, ``$OFFLOAD_BUILD_DIR/lib`` (relative to the repository root unless absolute) or
the repository's ``build/lib``, then the system's library path (an installed
``liboffload_c.so``). ``cpu_optimizer_server`` likewise: the package's ``offload/bin/``, the build
tree's ``bin/``, then ``PATH``.

At load the mirror is checked against the layout the library was compiled with
(``offload_abi_layout``): a struct whose fields differ in name, order, offset or size (a stale
library, a header changed without its mirror) is refused, naming the struct and the field, before
any call could read a field at the wrong place.

Every call that can fail goes through ``check`` or ``NativeOptimizer``'s methods: a code other
than 0 raises ``OffloadError`` with the absl::StatusCode's name and ``offload_last_error()``.
No other module calls the library's functions itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import shutil
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

ABI_VERSION = 6
FP32, FP16, BF16 = 1, 2, 3
ADAM, ADAMW = 1, 2
FORM_TORCH_1_13, FORM_LERP = 0, 1  # OffloadConfig.adam_form
MASTER, EXP_AVG, EXP_AVG_SQ = 1, 2, 3
TIERS = {"auto": 0, "memory": 1, "disk": 2}
ROUNDINGS = {"stochastic": 0, "nearest": 1}  # OffloadConfig.state_rounding

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
    """A call into liboffload_c failed; ``code`` is the absl::StatusCode, ``message`` the
    library's text."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{_CODES.get(code, code)}: {message}")
        self.code = code
        self.message = message


# ------------------------------------------------------------------------------ the structs

u64, i32, f32, dbl = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_double
c_str = ctypes.c_char_p


class OffloadGroup(ctypes.Structure):
    _fields_ = [("offset", u64), ("length", u64), ("kind", i32), ("lr", dbl), ("beta1", dbl),
                ("beta2", dbl), ("eps", dbl), ("weight_decay", dbl)]


class OffloadConfig(ctypes.Structure):
    _fields_ = [("abi_version", i32), ("job_id", c_str), ("num_params", u64), ("world_size", i32),
                ("rank", i32), ("create_job", i32), ("dtype", i32), ("num_groups", i32),
                ("groups", ctypes.POINTER(OffloadGroup)), ("num_shards", i32),
                ("shard_addresses", ctypes.POINTER(c_str)), ("threads", i32),
                ("transport", c_str), ("token", c_str), ("tls_ca", c_str), ("tls_cert", c_str),
                ("tls_key", c_str), ("tls_server_name", c_str), ("call_timeout_seconds", dbl),
                ("loss_scale_init", f32), ("loss_scale_window", i32), ("grad_clip", f32),
                ("trace_file", c_str), ("state_tier", i32), ("adam_form", i32),
                ("state_dtype", i32), ("state_rounding", i32),
                ("step_timeout_floor_seconds", dbl)]


class OffloadNamedTensor(ctypes.Structure):
    _fields_ = [("name", c_str), ("offset", u64), ("ndim", i32),
                ("shape", ctypes.POINTER(ctypes.c_int64))]


class OffloadStepReport(ctypes.Structure):
    _fields_ = [("step", u64), ("skipped", i32), ("loss_scale", f32), ("next_loss_scale", f32),
                ("grad_norm", dbl), ("clip_coef", f32), ("grad_multiplier", f32),
                ("adam_step", u64), ("skipped_steps", u64), ("early_updated", u64),
                ("early_rolled_back", u64)]


class OffloadRangeStep(ctypes.Structure):
    """t 0 leaves the range alone this step; t > 0 is its bias-correction step."""
    _fields_ = [("offset", u64), ("length", u64), ("t", u64)]


class OffloadFieldLayout(ctypes.Structure):
    """One row of offload_abi_layout(): a field, or (field null) the struct as a whole."""
    _fields_ = [("struct_name", c_str), ("field", c_str), ("offset", u64), ("size", u64)]


# The mirror checked at load, in the header's order.
MIRRORS: Tuple[Type[ctypes.Structure], ...] = (
    OffloadGroup, OffloadConfig, OffloadNamedTensor, OffloadStepReport, OffloadRangeStep,
    OffloadFieldLayout)

# (offset, length, t) runs, as OffloadRangeStep holds them.
Run = Sequence[int]

_P = ctypes.c_void_p
_SIGNATURES: Dict[str, Tuple[Any, List[Any]]] = {
    "offload_last_error": (c_str, []),
    "offload_abi_version": (i32, []),
    "offload_abi_layout": (ctypes.POINTER(OffloadFieldLayout), []),
    "offload_create": (i32, [ctypes.POINTER(OffloadConfig), ctypes.POINTER(_P)]),
    "offload_destroy": (None, [_P]),
    "offload_drop_job": (i32, [_P]),
    "offload_padded_length": (u64, [_P]),
    "offload_partition_offset": (u64, [_P]),
    "offload_partition_length": (u64, [_P]),
    "offload_transport_names": (c_str, [_P]),
    "offload_plan_buckets": (i32, [ctypes.POINTER(u64), i32, u64, ctypes.POINTER(i32)]),
    "offload_read_state": (i32, [_P, i32, u64, u64, _P]),
    "offload_load_begin": (i32, [_P, i32, u64, u64]),
    "offload_load_chunk": (i32, [_P, i32, u64, u64, _P]),
    "offload_load_finish": (i32, [_P]),
    "offload_load_abort": (None, [_P]),
    "offload_read_weights16": (i32, [_P, u64, u64, _P]),
    "offload_save_checkpoint": (i32, [_P, c_str, ctypes.POINTER(OffloadNamedTensor), i32, u64,
                                      u64, c_str, i32, c_str, u64]),
    "offload_find_checkpoint": (i32, [c_str, c_str, u64]),
    "offload_check_checkpoint": (i32, [c_str, ctypes.POINTER(OffloadNamedTensor), i32]),
    "offload_load_checkpoint": (i32, [_P, c_str, ctypes.POINTER(OffloadNamedTensor), i32]),
    "offload_loss_scale": (f32, [_P]),
    "offload_get_scaler": (None, [_P, ctypes.POINTER(f32), ctypes.POINTER(ctypes.c_uint32),
                                  ctypes.POINTER(u64)]),
    "offload_set_scaler": (i32, [_P, f32, ctypes.c_uint32, u64]),
    "offload_begin_step": (i32, [_P, u64]),
    "offload_in_step": (i32, [_P]),
    "offload_gradient_buffer": (_P, [_P, u64, u64]),
    "offload_gradients_ready": (i32, [_P, u64, u64, _P]),
    "offload_send_gradients_f32": (i32, [_P, u64, _P, u64, f32]),
    "offload_next_micro_batch": (i32, [_P]),
    "offload_local_stats": (i32, [_P, ctypes.POINTER(dbl)]),
    "offload_set_range_steps": (i32, [_P, ctypes.POINTER(OffloadRangeStep), i32]),
    "offload_speculate": (i32, [_P, ctypes.POINTER(dbl), i32, ctypes.POINTER(OffloadRangeStep),
                                i32]),
    "offload_update_ready": (i32, [_P, u64, u64]),
    "offload_read_gradient_sum": (i32, [_P, u64, u64, _P]),
    "offload_restore_gradient_sum": (i32, [_P, _P]),
    "offload_read_checkpoint_gradient_sum": (i32, [c_str, ctypes.POINTER(OffloadNamedTensor), i32,
                                                   u64, _P]),
    "offload_commit": (i32, [_P, _P, ctypes.POINTER(dbl), i32, f32, _P,
                             ctypes.POINTER(OffloadStepReport)]),
    "offload_commit_async": (i32, [_P, _P, ctypes.POINTER(dbl), i32, f32, _P,
                                   ctypes.POINTER(OffloadStepReport)]),
    "offload_wait_commit": (i32, [_P, ctypes.POINTER(OffloadStepReport)]),
    "offload_preview": (i32, [_P, _P, f32, ctypes.POINTER(OffloadStepReport)]),
    "offload_abort_step": (None, [_P]),
    "offload_trace_phase": (None, [_P, c_str, u64, dbl, dbl]),
    "offload_write_trace": (i32, [_P]),
}


# ------------------------------------------------------------------------------ finding and loading

def _build_dir() -> pathlib.Path:
    build = pathlib.Path(os.environ.get("OFFLOAD_BUILD_DIR", "build"))
    return build if build.is_absolute() else _REPO / build


def _find(folder: str, name: str,
          system: Callable[[], Optional[str]]) -> Tuple[Optional[str], pathlib.Path, pathlib.Path]:
    """The package's own folder/name, else the build tree's (from a source tree only), else what
    `system` finds; and where the first two were looked for."""
    own = _PACKAGE / folder / name
    built = _build_dir() / folder / name
    if own.exists():
        return str(own), own, built
    if _IN_SOURCE_TREE and built.exists():
        return str(built), own, built
    return system(), own, built


def library_path() -> str:
    """The liboffload_c.so this package loads (see the module's docstring for the order)."""
    explicit = os.environ.get("OFFLOAD_LIBRARY")
    if explicit:
        return explicit
    found, own, built = _find("lib", "liboffload_c.so",
                              lambda: ctypes.util.find_library("offload_c"))
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
    found, own, built = _find("bin", "cpu_optimizer_server",
                              lambda: shutil.which("cpu_optimizer_server"))
    if found:
        return found
    if not _IN_SOURCE_TREE:
        raise OffloadError(5, f"cpu_optimizer_server is missing: this package has no {own} and "
                              "none is on PATH: reinstall the wheel of scripts/build-wheel")
    raise OffloadError(5, f"cpu_optimizer_server is not built ({built} is missing) and not on "
                          "PATH: run ./scripts/build, or set OFFLOAD_BUILD_DIR")


def read_layout(L: ctypes.CDLL) -> Dict[str, List[Tuple[Optional[str], int, int]]]:
    """offload_abi_layout()'s table: per struct, (field, offset, size) in declaration order, the
    struct as a whole (field None, offset 0, its size) first."""
    table: Dict[str, List[Tuple[Optional[str], int, int]]] = {}
    rows = L.offload_abi_layout()
    k = 0
    while rows[k].struct_name is not None:
        row = rows[k]
        field = row.field.decode() if row.field is not None else None
        table.setdefault(row.struct_name.decode(), []).append((field, row.offset, row.size))
        k += 1
    return table


def check_layout(table: Dict[str, List[Tuple[Optional[str], int, int]]],
                 mirrors: Sequence[Type[ctypes.Structure]] = MIRRORS, where: str = "") -> None:
    """Raises OffloadError (FAILED_PRECONDITION) naming the first struct and field where a ctypes
    mirror (named as its C struct) differs from the library's table."""
    def refuse(what: str) -> None:
        raise OffloadError(9, f"{where or 'liboffload_c.so'} and this package disagree on the "
                              f"C structs: {what}; rebuild the library and reinstall the package "
                              "from the same tree")

    for mirror in mirrors:
        name = mirror.__name__
        rows = table.get(name)
        if rows is None:
            refuse(f"the library has no struct {name}")
        whole = [(o, s) for f, o, s in rows if f is None]
        fields = [(f, o, s) for f, o, s in rows if f is not None]
        mine = [(f, getattr(mirror, f).offset, getattr(mirror, f).size)
                for f, *_ in mirror._fields_]
        for k in range(max(len(fields), len(mine))):
            theirs = fields[k] if k < len(fields) else None
            ours = mine[k] if k < len(mine) else None
            if theirs == ours:
                continue
            if ours is None:
                refuse(f"{name}.{theirs[0]} (field {k}) is not in this package's {name}")
            if theirs is None:
                refuse(f"{name}.{ours[0]} (field {k}) is not in the library's {name}")
            if theirs[0] != ours[0]:
                refuse(f"field {k} of {name} is {theirs[0]} in the library, {ours[0]} here")
            refuse(f"{name}.{ours[0]} is at offset {theirs[1]} with size {theirs[2]} in the "
                   f"library, offset {ours[1]} with size {ours[2]} here")
        if whole != [(0, ctypes.sizeof(mirror))]:
            refuse(f"{name} is {whole[0][1] if whole else '?'} bytes in the library, "
                   f"{ctypes.sizeof(mirror)} here")


_lib: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    """The loaded library, with every function's signature declared and its ABI checked."""
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    L = ctypes.CDLL(path)
    missing = [name for name in _SIGNATURES if not hasattr(L, name)]
    if missing:
        version = L.offload_abi_version() if hasattr(L, "offload_abi_version") else "?"
        raise OffloadError(9, f"{path} (ABI version {version}) has no {', '.join(missing[:4])}: "
                              "it is older than this package: rebuild it")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(L, name)
        fn.restype = restype
        fn.argtypes = argtypes
    if L.offload_abi_version() != ABI_VERSION:
        raise OffloadError(9, f"{path} speaks ABI version {L.offload_abi_version()}, "
                              f"this package {ABI_VERSION}: rebuild one of them")
    check_layout(read_layout(L), MIRRORS, path)
    _lib = L
    return L


def last_error() -> str:
    return lib().offload_last_error().decode("utf-8", "replace")


def check(rc: int) -> None:
    """Raises OffloadError with the library's message unless rc is 0."""
    if rc != 0:
        raise OffloadError(rc, last_error())


T = TypeVar("T")


def attempt(fn: Callable[[], T]) -> Tuple[Optional[T], Optional[OffloadError]]:
    """fn's result, or its OffloadError: for a call whose failure every rank must learn of
    (``Ranks.agree``) before any raises."""
    try:
        return fn(), None
    except OffloadError as e:
        return None, e


def ptr(t: Any) -> ctypes.c_void_p:
    """A tensor's data as the library's void*."""
    return ctypes.c_void_p(t.data_ptr())


def range_steps(runs: Sequence[Run]) -> ctypes.Array:
    """(offset, length, t) runs as an OffloadRangeStep array (one element at least)."""
    return (OffloadRangeStep * max(1, len(runs)))(*[OffloadRangeStep(*r) for r in runs])


def doubles(values: Sequence[float]) -> ctypes.Array:
    return (ctypes.c_double * len(values))(*[float(v) for v in values])


def report_dict(report: OffloadStepReport) -> Dict[str, Any]:
    return {f: getattr(report, f) for f, _ in OffloadStepReport._fields_}


# ------------------------------------------------------------------------------ calls without a job

def plan_buckets(sizes: Sequence[int], bucket_elements: int) -> List[int]:
    """Each member's bucket: members (sizes in the order they are grouped) grouped greedily
    until a bucket holds at least bucket_elements (>= 1); the last may hold fewer. The C++
    trainer's gradient buckets use the same planner."""
    n = len(sizes)
    out = (i32 * max(1, n))()
    check(lib().offload_plan_buckets((u64 * max(1, n))(*sizes), n, bucket_elements, out))
    return list(out[:n])


def find_checkpoint(path: str) -> str:
    """The checkpoint directory ``path`` names (itself, or what its ``latest`` names)."""
    out = ctypes.create_string_buffer(4096 + len(path.encode()))
    check(lib().offload_find_checkpoint(path.encode(), out, len(out)))
    return out.value.decode()


def check_checkpoint(directory: str, tensors: ctypes.Array) -> None:
    """Refuses (INVALID_ARGUMENT, naming the first) a checkpoint of other parameters."""
    check(lib().offload_check_checkpoint(directory.encode(), tensors, len(tensors)))


def read_checkpoint_gradient_sum(directory: str, tensors: ctypes.Array, num_params: int,
                                 out: Any) -> None:
    """The gradient sum a checkpoint saved mid-accumulation holds, into out (num_params,)."""
    check(lib().offload_read_checkpoint_gradient_sum(directory.encode(), tensors, len(tensors),
                                                    num_params, ptr(out)))


# ------------------------------------------------------------------------------ one optimizer

class NativeOptimizer:
    """One OffloadOptimizer of the library: a job's steps on this rank. Every method raises
    OffloadError where the library refuses; the methods that end a step, a load or a commit on
    failure say so."""

    def __init__(self, handle: ctypes.c_void_p) -> None:
        self._handle: Optional[ctypes.c_void_p] = handle
        self._L = lib()

    @classmethod
    def create(cls, config: OffloadConfig) -> "NativeOptimizer":
        handle = ctypes.c_void_p()
        check(lib().offload_create(ctypes.byref(config), ctypes.byref(handle)))
        return cls(handle)

    @property
    def handle(self) -> Optional[ctypes.c_void_p]:
        """The library's OffloadOptimizer*, None once closed."""
        return self._handle

    def live(self) -> ctypes.c_void_p:
        if not self._handle:
            raise RuntimeError("this offload.torch optimizer was closed")
        return self._handle

    def close(self, drop_job: bool) -> None:
        """Drops the job on the shards (drop_job: rank 0) and frees everything; idempotent."""
        handle, self._handle = self._handle, None
        if handle:
            if drop_job:
                self._L.offload_drop_job(handle)
            self._L.offload_destroy(handle)

    # The flat space.
    def padded_length(self) -> int:
        return int(self._L.offload_padded_length(self.live()))

    def partition(self) -> Tuple[int, int]:
        """This rank's partition: (offset, length)."""
        h = self.live()
        return int(self._L.offload_partition_offset(h)), int(self._L.offload_partition_length(h))

    def transport_names(self) -> str:
        return self._L.offload_transport_names(self.live()).decode()

    # One step.
    def in_step(self) -> bool:
        return bool(self._L.offload_in_step(self.live()))

    def begin_step(self, step: int) -> None:
        check(self._L.offload_begin_step(self.live(), step))

    def gradient_buffer(self, offset: int, n: int) -> int:
        """The address to write flat [offset, offset + n)'s 16-bit gradients at."""
        where = self._L.offload_gradient_buffer(self._handle, offset, n)
        if not where:
            check(13)
        return where

    def gradients_ready(self, offset: int, n: int, where: int) -> None:
        check(self._L.offload_gradients_ready(self._handle, offset, n, where))

    def send_gradients_f32(self, offset: int, grads: Any, scale: float) -> None:
        check(self._L.offload_send_gradients_f32(self._handle, offset, ptr(grads), grads.numel(),
                                                 scale))

    def next_micro_batch(self) -> None:
        check(self._L.offload_next_micro_batch(self._handle))

    def local_stats(self) -> Tuple[float, float]:
        out = (ctypes.c_double * 2)()
        check(self._L.offload_local_stats(self._handle, out))
        return out[0], out[1]

    def set_range_steps(self, runs: Sequence[Run]) -> None:
        check(self._L.offload_set_range_steps(self._handle, range_steps(runs), len(runs)))

    def speculate(self, lrs: Sequence[float], runs: Sequence[Run]) -> None:
        check(self._L.offload_speculate(self._handle, doubles(lrs), len(lrs), range_steps(runs),
                                        len(runs)))

    def update_ready(self, offset: int, n: int) -> None:
        check(self._L.offload_update_ready(self._handle, offset, n))

    def read_gradient_sum(self, offset: int, out: Any) -> None:
        check(self._L.offload_read_gradient_sum(self._handle, offset, out.numel(), ptr(out)))

    def restore_gradient_sum(self, sums: Any) -> None:
        check(self._L.offload_restore_gradient_sum(self._handle, ptr(sums)))

    def preview(self, stats: Optional[ctypes.Array], max_norm: float) -> OffloadStepReport:
        report = OffloadStepReport()
        check(self._L.offload_preview(self._handle, stats, max_norm, ctypes.byref(report)))
        return report

    def commit(self, stats: Optional[ctypes.Array], lrs: Sequence[float], max_norm: float,
               params16: ctypes.c_void_p, delayed: bool = False) -> OffloadStepReport:
        """offload_commit, or with delayed offload_commit_async (wait_commit ends it)."""
        report = OffloadStepReport()
        fn = self._L.offload_commit_async if delayed else self._L.offload_commit
        check(fn(self._handle, stats, doubles(lrs), len(lrs), max_norm, params16,
                 ctypes.byref(report)))
        return report

    def wait_commit(self) -> OffloadStepReport:
        report = OffloadStepReport()
        check(self._L.offload_wait_commit(self._handle, ctypes.byref(report)))
        return report

    def abort_step(self) -> None:
        if self._handle:
            self._L.offload_abort_step(self._handle)

    # State.
    def load_begin(self, with_counters: bool = False, completed_step: int = 0,
                   adam_step: int = 0) -> None:
        check(self._L.offload_load_begin(self._handle, int(with_counters), completed_step,
                                         adam_step))

    def load_chunk(self, tensor: int, offset: int, values: Any) -> None:
        check(self._L.offload_load_chunk(self._handle, tensor, offset, values.numel(),
                                         ptr(values)))

    def load_finish(self) -> None:
        check(self._L.offload_load_finish(self._handle))

    def load_abort(self) -> None:
        if self._handle:
            self._L.offload_load_abort(self._handle)

    def read_state(self, tensor: int, offset: int, out: Any) -> None:
        check(self._L.offload_read_state(self.live(), tensor, offset, out.numel(), ptr(out)))

    def read_weights16(self, offset: int, out: Any) -> None:
        check(self._L.offload_read_weights16(self._handle, offset, out.numel(), ptr(out)))

    def save_checkpoint(self, root: str, tensors: ctypes.Array, completed_step: int,
                        adam_step: int, front_end: str, keep: int) -> str:
        out = ctypes.create_string_buffer(4096 + len(root.encode()))
        check(self._L.offload_save_checkpoint(self._handle, root.encode(), tensors, len(tensors),
                                              completed_step, adam_step, front_end.encode(),
                                              keep, out, len(out)))
        return out.value.decode()

    def load_checkpoint(self, directory: str, tensors: ctypes.Array) -> None:
        check(self._L.offload_load_checkpoint(self._handle, directory.encode(), tensors,
                                              len(tensors)))

    # The step policy's loss scaler.
    def loss_scale(self) -> float:
        return float(self._L.offload_loss_scale(self.live()))

    def get_scaler(self) -> Tuple[float, int, int]:
        """(scale, clean steps, skipped steps)."""
        scale, clean, skipped = ctypes.c_float(), ctypes.c_uint32(), ctypes.c_uint64()
        self._L.offload_get_scaler(self.live(), ctypes.byref(scale), ctypes.byref(clean),
                                   ctypes.byref(skipped))
        return float(scale.value), int(clean.value), int(skipped.value)

    def set_scaler(self, scale: float, clean_steps: int, skipped_steps: int) -> None:
        check(self._L.offload_set_scaler(self._handle, float(scale), int(clean_steps),
                                         int(skipped_steps)))

    # The trace.
    def trace_phase(self, name: str, step: int, begin: float, end: float) -> None:
        self._L.offload_trace_phase(self._handle, name.encode(), step, begin, end)

    def write_trace(self) -> None:
        check(self._L.offload_write_trace(self._handle))
