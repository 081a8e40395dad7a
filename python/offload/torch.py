"""``offload.torch.AdamW``: a torch optimizer whose state lives on Offload's optimizer servers.

A model needs no change. The optimizer takes the parameters' values (fp32, as most models are
built) as the fp32 master weights on the servers, and casts the parameters in place to a 16-bit
type (``dtype=``, bf16 by default): each becomes a view of one flat 16-bit buffer, laid out group
by group in parameter order. While backward runs, a hook on every parameter copies its gradient
to where the server reads it (the shared-memory segment when the server is on this host) and
hands full buckets to the library's sender thread. ``step()`` commits: the servers run Adam or
AdamW in fp32 and return the 16-bit weights, which land in the parameters in place.

Numerics live in the C++ library (``gpu_trainer/capi/offload_c.h``): the statistics of the
gradients, the loss scale, the overflow skip and the clipping multiplier are the C++ trainer's
own step policy. This file only moves tensors and calls the library.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import secrets
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from offload import _lib
from offload._lib import OffloadError, check
from offload.server import LocalServer

__all__ = ["AdamW", "Adam", "OffloadError", "save_safetensors"]

_DTYPES = {torch.float16: _lib.FP16, torch.bfloat16: _lib.BF16}
# The hyper-parameters fixed when the job is created on the servers; lr may change every step.
_FIXED = ("betas", "eps", "weight_decay")


def _host_view(ptr: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """(n,) CPU tensor over memory the library owns (no copy)."""
    buf = (ctypes.c_uint8 * (n * 2)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=n)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with fp32 state on optimizer servers and 16-bit parameters.

    Args beyond torch's:
      dtype: torch.bfloat16 (default) or torch.float16; fp16 uses dynamic loss scaling: call
        ``optimizer.backward(loss)`` (or multiply the loss by ``optimizer.loss_scale``).
      servers: None starts a local ``cpu_optimizer_server`` child process (over shared memory);
        a list of "host:port" uses running servers (with ``token``); "inprocess" runs the same
        shard engine in this process, without a server.
      max_grad_norm: clip the global gradient norm every step (0: off);
        ``clip_grad_norm_`` sets it for one step.
      loss_scale, loss_scale_window: fp16's initial scale and growth window (GradScaler's).
      bucket_elements: gradients are handed to the sender in buckets of about this many elements.
      transport: "auto", "shm", "grpc" or "ucx".
      threads: Adam threads of the local server or the in-process engine (0: every core).
      job_id: the job's name on the servers (default: a fresh one).
      process_group: torch.distributed group for several ranks (ZeRO-2); None: one rank.
      trace_file: write a Chrome trace of every step there (backward, the gradients' sends,
        step) at close() and at write_trace().
    """

    _kind = _lib.ADAMW

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 dtype: torch.dtype = torch.bfloat16, servers: Any = None,
                 token: Optional[str] = None, transport: str = "auto",
                 max_grad_norm: float = 0.0, loss_scale: float = 65536.0,
                 loss_scale_window: int = 2000, bucket_elements: int = 1 << 22, threads: int = 0,
                 job_id: Optional[str] = None, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_server_name: Optional[str] = None, call_timeout: float = 600.0,
                 process_group: Any = None, trace_file: Optional[str] = None):
        if amsgrad:
            raise ValueError("amsgrad is not supported: the optimizer servers keep exp_avg and "
                             "exp_avg_sq only")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, not {dtype}")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"invalid lr {lr}, eps {eps} or weight_decay {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        self._building = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=False))
        self._building = False
        self.dtype = dtype
        self.bucket_elements = int(bucket_elements)
        self._max_grad_norm = float(max_grad_norm)
        self._step_max_norm: Optional[float] = None
        self._lock = threading.RLock()
        self._handle: Optional[ctypes.c_void_p] = None
        self._server: Optional[LocalServer] = None
        self._step = 0  # steps committed (the servers' completed_step)
        self._adam_step = 0  # of them, updates applied (the t of bias correction)
        self.last_report: Optional[Dict[str, float]] = None

        self._world, self._rank, self._group = 1, 0, process_group
        if process_group is not None:
            import torch.distributed as dist
            self._world = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)

        # The flat layout: group by group, parameter by parameter.
        self._params: List[torch.nn.Parameter] = []
        self._offsets: List[int] = []
        self._shapes: List[torch.Size] = []
        group_bounds: List[Tuple[int, int]] = []
        offset = 0
        device = None
        for g in self.param_groups:
            start = offset
            for p in g["params"]:
                if not p.is_floating_point():
                    raise TypeError(f"parameter of dtype {p.dtype} is not floating point: the "
                                    "optimizer servers train floating-point parameters only")
                if p.is_sparse:
                    raise TypeError("sparse parameters are not supported")
                if device is None:
                    device = p.device
                elif p.device != device:
                    raise ValueError(f"parameters on {device} and {p.device}: keep every "
                                     "parameter of one optimizer on one device")
                self._params.append(p)
                self._offsets.append(offset)
                self._shapes.append(p.shape)
                offset += p.numel()
            if offset == start:
                raise ValueError("a parameter group without parameters")
            group_bounds.append((start, offset - start))
        self.num_params = offset
        self.device = device

        servers_list, token = self._servers(servers, token, threads)
        groups = (_lib.Group * len(self.param_groups))()
        for i, (g, (start, length)) in enumerate(zip(self.param_groups, group_bounds)):
            groups[i] = _lib.Group(start, length, self._kind, g["lr"], g["betas"][0],
                                   g["betas"][1], g["eps"], g["weight_decay"])
        addresses = (ctypes.c_char_p * max(1, len(servers_list)))(
            *[a.encode() for a in servers_list])
        if job_id is None:
            job_id = f"torch-{os.getpid()}-{secrets.token_hex(4)}"
            if self._world > 1:  # rank 0's name, for the job the others join
                import torch.distributed as dist
                names = [job_id]
                dist.broadcast_object_list(names, src=self._src0(), group=self._group)
                job_id = names[0]
        enc = lambda s: s.encode() if s else None  # noqa: E731
        config = _lib.Config(
            abi_version=_lib.ABI_VERSION, job_id=job_id.encode(), num_params=self.num_params,
            world_size=self._world, rank=self._rank, create_job=1 if self._rank == 0 else 0,
            dtype=_DTYPES[dtype], num_groups=len(groups), groups=groups,
            num_shards=len(servers_list), shard_addresses=addresses, threads=threads,
            transport=transport.encode(), token=enc(token), tls_ca=enc(tls_ca),
            tls_cert=enc(tls_cert), tls_key=enc(tls_key), tls_server_name=enc(tls_server_name),
            call_timeout_seconds=call_timeout, loss_scale_init=loss_scale,
            loss_scale_window=loss_scale_window, grad_clip=self._max_grad_norm,
            trace_file=enc(trace_file))
        L = _lib.lib()
        handle = ctypes.c_void_p()
        # Rank 0 creates the job, then the others join it; every rank learns whether all did.
        rc = L.offload_create(ctypes.byref(config), ctypes.byref(handle)) if self._rank == 0 else 0
        error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
        self._agree(rc, error, "creating the job")
        if self._rank != 0:
            rc = L.offload_create(ctypes.byref(config), ctypes.byref(handle))
            error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
        self._agree(rc, error, "joining the job")
        self._handle = handle
        self._finalizer = weakref.finalize(self, AdamW._release, L, handle, self._rank == 0,
                                           self._server)
        self.job_id = job_id
        self.padded_length = L.offload_padded_length(handle)
        self._part_offset = L.offload_partition_offset(handle)
        self._part_length = L.offload_partition_length(handle)
        self.transport = L.offload_transport_names(handle).decode()

        # The parameters become views of one flat 16-bit buffer on their device; their current
        # values are the master weights.
        master = torch.zeros(self.padded_length, dtype=torch.float32)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                master[off:off + p.numel()].copy_(p.detach().reshape(-1))
        self._flat16 = torch.empty(self.padded_length, dtype=dtype, device=device)
        self._host16 = (self._flat16 if device.type == "cpu" else
                        torch.empty(self.padded_length, dtype=dtype,
                                    pin_memory=torch.cuda.is_available()))
        with torch.no_grad():
            self._flat16.copy_(master)  # round to nearest even, as the servers round
            for p, off in zip(self._params, self._offsets):
                p.data = self._flat16[off:off + p.numel()].view(p.shape)
                p.grad = None
        rc = L.offload_load_state(handle, _ptr(master), None, None, 0, 0) if self._rank == 0 else 0
        error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
        self._agree(rc, error, "loading the master weights")
        del master
        if self._world > 1:
            # The servers hold rank 0's values: every rank computes with them (as DDP does).
            import torch.distributed as dist
            dist.broadcast(self._flat16.view(torch.int32), src=self._src0(), group=self._group)

        self._sent = [False] * len(self._params)
        self._gradients_done = False
        self._pending: List[Tuple[int, int, int]] = []  # (offset, n, where)
        self._pending_elements = 0
        self._hooks = [p.register_hook(self._make_hook(i)) for i, p in enumerate(self._params)]

    # ----------------------------------------------------------------------------- set-up

    def _src0(self) -> int:
        """The global rank of the group's rank 0 (what torch.distributed's src= names)."""
        import torch.distributed as dist
        if self._group is None or self._group == dist.group.WORLD:
            return 0
        get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        return get(self._group, 0)

    def _agree(self, rc: int, error: str, what: str) -> None:
        """Raises on every rank when any rank's rc is not 0 (one rank's failure must not leave
        the others waiting in a collective); with one rank, raises this rank's error."""
        if self._world == 1:
            if rc:
                raise OffloadError(rc, error)
            return
        import torch.distributed as dist
        codes = [0] * self._world
        dist.all_gather_object(codes, (rc, error), group=self._group)
        if rc:
            raise OffloadError(rc, error)
        for r, (code, message) in enumerate(codes):
            if code:
                raise RuntimeError(f"rank {r} failed {what}: {_lib.OffloadError(code, message)}")

    def _servers(self, servers: Any, token: Optional[str], threads: int) -> Tuple[List[str], Optional[str]]:
        if servers is None:
            if self._world > 1:
                raise ValueError("several ranks need running servers: pass servers=[...] and "
                                 "token=...")
            self._server = LocalServer(threads=threads)
            return [self._server.address], self._server.token
        if isinstance(servers, str):
            if servers == "inprocess":
                if self._world > 1:
                    raise ValueError("servers='inprocess' is one process's engine: several ranks "
                                     "need running servers")
                return [], None
            servers = [servers]
        servers = list(servers)
        if not servers:
            raise ValueError("servers=[] names no server; use None for a local one")
        if token is None:
            token = os.environ.get("OFFLOAD_TOKEN")
        return servers, token

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError("offload.torch optimizers cannot take parameter groups after "
                               "they are built: the job's groups are fixed on the servers")
        super().add_param_group(param_group)

    @staticmethod
    def _release(L: ctypes.CDLL, handle: ctypes.c_void_p, owner: bool,
                 server: Optional[LocalServer]) -> None:
        if handle:
            if owner:
                L.offload_drop_job(handle)
            L.offload_destroy(handle)
        if server is not None:
            server.close()

    def close(self) -> None:
        """Drops the job on the servers (rank 0) and stops the local server, if any. The
        optimizer cannot be used afterwards."""
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()
        self._handle = None

    def _live(self) -> ctypes.c_void_p:
        """The library's optimizer; an error once closed."""
        if not self._handle:
            raise RuntimeError("this offload.torch optimizer was closed")
        return self._handle

    def _barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self._group)

    # ----------------------------------------------------------------------------- gradients

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # A weak reference: the model's parameters must not keep the optimizer (its job, its
        # server) alive, and a collected or closed optimizer's hooks do nothing.
        ref = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            opt = ref()
            if opt is not None and opt._handle:
                opt._on_gradient(index, grad)
        return hook

    def _begin_step(self) -> None:
        if not _lib.lib().offload_in_step(self._live()):
            check(_lib.lib().offload_begin_step(self._handle, self._step + 1))

    def _on_gradient(self, index: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(f"parameter {index} got a sparse gradient: offload.torch optimizers "
                               "take dense gradients only")
        with self._lock:
            if self._sent[index]:
                raise RuntimeError(
                    f"parameter {index} got a second gradient in one step: accumulating "
                    "gradients over several backward() calls is not supported yet; call "
                    "step() after each backward()")
            self._check_param(index)
            self._begin_step()
            self._sent[index] = True
            if self._world > 1:
                return  # reduced over the ranks at step() (_reduce_and_send), from p.grad
            off, n = self._offsets[index], self._params[index].numel()
            L = _lib.lib()
            ptr = L.offload_gradient_buffer(self._handle, off, n)
            if not ptr:
                check(13)
            _host_view(ptr, n, self.dtype).copy_(grad.detach().reshape(-1))
            self._pending.append((off, n, ptr))
            self._pending_elements += n
            if self._pending_elements >= self.bucket_elements:
                self._flush()

    def _flush(self) -> None:
        """Hands the pending gradients to the sender, contiguous runs merged."""
        runs: List[List[int]] = []
        for off, n, ptr in sorted(self._pending):
            # One run only where the pieces are neighbours in the flat space and in memory (one
            # shard's segment, or the library's buffer).
            if runs and runs[-1][0] + runs[-1][1] == off and runs[-1][2] + 2 * runs[-1][1] == ptr:
                runs[-1][1] += n
            else:
                runs.append([off, n, ptr])
        for off, n, ptr in runs:
            check(_lib.lib().offload_gradients_ready(self._handle, off, n, ptr))
        self._pending = []
        self._pending_elements = 0

    def _fill_missing(self) -> None:
        """Zeros for parameters backward gave no gradient this step, and for the padding."""
        L = _lib.lib()
        missing = [(self._offsets[i], self._params[i].numel())
                   for i, sent in enumerate(self._sent) if not sent]
        if self.padded_length > self.num_params:
            missing.append((self.num_params, self.padded_length - self.num_params))
        for off, n in missing:
            ptr = L.offload_gradient_buffer(self._handle, off, n)
            if not ptr:
                check(13)
            _host_view(ptr, n, self.dtype).zero_()
            self._pending.append((off, n, ptr))
        for i in range(len(self._sent)):
            self._sent[i] = True
        self._flush()

    def _finish_gradients(self) -> None:
        """Every gradient of this rank's partition on its way (once per step)."""
        if self._gradients_done:
            return
        if self._world > 1:
            self._reduce_and_send()
        else:
            self._fill_missing()
        self._gradients_done = True

    def _reduce_and_send(self) -> None:
        """Several ranks: bucket by bucket in flat order (the same on every rank), the fp32 sum
        of the ranks' gradients; each rank hands its partition's share to the library, which
        takes the mean and rounds it to 16 bits in one pass."""
        import torch.distributed as dist
        L = _lib.lib()
        lo, hi = self._part_offset, self._part_offset + self._part_length
        for start, end, members in self._buckets():
            flat = torch.zeros(end - start, dtype=torch.float32, device=self.device)
            for i in members:
                g = self._params[i].grad
                if g is not None:
                    off = self._offsets[i] - start
                    flat[off:off + g.numel()].copy_(g.reshape(-1))
            dist.all_reduce(flat, group=self._group)
            a, b = max(start, lo), min(end, hi)
            if a < b:
                mine = flat[a - start:b - start].cpu().contiguous()
                check(L.offload_send_gradients_f32(self._handle, a, _ptr(mine), b - a,
                                                   1.0 / self._world))
        self._sent = [True] * len(self._params)

    def _buckets(self) -> List[Tuple[int, int, List[int]]]:
        """[start, end) runs of whole parameters of about bucket_elements, covering
        [0, padded_length) (the padding in the last)."""
        out: List[Tuple[int, int, List[int]]] = []
        start, members = 0, []
        for i, (p, off) in enumerate(zip(self._params, self._offsets)):
            members.append(i)
            end = off + p.numel()
            if end - start >= self.bucket_elements:
                out.append((start, end, members))
                start, members = end, []
        if start < self.padded_length:
            out.append((start, self.padded_length, members))
        return out

    def _check_param(self, index: int) -> None:
        p = self._params[index]
        off = self._offsets[index]
        if (p.dtype != self.dtype or p.shape != self._shapes[index] or
                p.data_ptr() != self._flat16.data_ptr() + 2 * off):
            raise RuntimeError(
                f"parameter {index} (shape {tuple(self._shapes[index])}) changed after the "
                f"optimizer was built: it is now {p.dtype} of shape {tuple(p.shape)}"
                + ("" if p.data_ptr() == self._flat16.data_ptr() + 2 * off else
                   " and no longer a view of the optimizer's 16-bit buffer")
                + "; build a new optimizer for a changed model")

    def _abort(self) -> None:
        if self._handle:
            _lib.lib().offload_abort_step(self._handle)
        self._gradients_done = False
        self._sent = [False] * len(self._params)
        self._pending = []
        self._pending_elements = 0

    # ----------------------------------------------------------------------------- the step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients already on their way in an unfinished step are dropped too
        (nothing is applied), so a failed backward can be retried."""
        with self._lock:
            if _lib.lib().offload_in_step(self._live()):
                self._abort()
        super().zero_grad(set_to_none=set_to_none)

    @property
    def loss_scale(self) -> float:
        """The scale to multiply the next loss by (1 for bf16)."""
        return float(_lib.lib().offload_loss_scale(self._live()))

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward() at the current loss scale (what fp16 needs; bf16's scale is 1)."""
        scale = self.loss_scale
        begin = time.monotonic()
        (loss * scale if scale != 1.0 else loss).backward(**kwargs)
        self._trace("backward", begin)

    def _trace(self, name: str, begin: float) -> None:
        _lib.lib().offload_trace_phase(self._handle, name.encode(), self._step + 1, begin,
                                       time.monotonic())

    def write_trace(self) -> None:
        """Writes the trace_file now (it is written at close() too)."""
        check(_lib.lib().offload_write_trace(self._handle))

    def _global_stats(self) -> Optional[ctypes.Array]:
        if self._world == 1:
            return None
        local = (ctypes.c_double * 2)()
        check(_lib.lib().offload_local_stats(self._handle, local))
        import torch.distributed as dist
        # On the parameters' device: NCCL reduces device tensors only.
        device = self.device if dist.get_backend(self._group) == "nccl" else "cpu"
        t = torch.tensor([local[0], local[1]], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self._group)
        t = t.cpu()
        return (ctypes.c_double * 2)(float(t[0]), float(t[1]))

    def _gradients_out(self) -> Optional[ctypes.Array]:
        """Every gradient of the step on its way, and the statistics to decide it by (summed
        over the ranks; None with one rank). Any failure ends the step, nothing applied."""
        try:
            for i in range(len(self._params)):
                self._check_param(i)
            self._begin_step()
            self._finish_gradients()
            return self._global_stats()
        except BaseException:
            self._abort()
            raise

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for this optimizer's parameters: returns the global norm
        of this step's (unscaled) gradients and clips them by max_norm in the coming step()."""
        with self._lock:
            stats = self._gradients_out()
            report = _lib.StepReport()
            try:
                check(_lib.lib().offload_preview(self._handle, stats, float(max_norm),
                                                 ctypes.byref(report)))
            except BaseException:
                self._abort()
                raise
        self._step_max_norm = float(max_norm)
        return torch.tensor(report.grad_norm if not report.skipped else math.inf)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        L = _lib.lib()
        self._live()
        begin = time.monotonic()
        with self._lock:
            stats = self._gradients_out()
            lrs = (ctypes.c_float * len(self.param_groups))(
                *[float(g["lr"]) for g in self.param_groups])
            max_norm = self._step_max_norm if self._step_max_norm is not None else -1.0
            report = _lib.StepReport()
            rc = L.offload_commit(self._handle, stats, lrs, len(lrs), max_norm,
                                  _ptr(self._host16), ctypes.byref(report))
            error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
            # Whatever happened, this step is over on both sides (a commit refused before it
            # reached the shards leaves the library's step open: it ends here, nothing applied).
            self._abort()
            if rc == 0:
                self._step_max_norm = None
            self._agree(rc, error, "committing the step")
        self._trace("step", begin)
        self._step = int(report.step)
        self._adam_step = int(report.adam_step)
        if not report.skipped:
            self._gather_weights()
        self.last_report = {f: getattr(report, f) for f, _ in _lib.StepReport._fields_}
        return loss

    def _gather_weights(self) -> None:
        """After a commit: this rank's partition is in _host16; every rank's, everywhere."""
        if self._host16 is not self._flat16:
            lo, n = self._part_offset, self._part_length
            self._flat16[lo:lo + n].copy_(self._host16[lo:lo + n])
        if self._world > 1:
            import torch.distributed as dist
            # As int32 pairs: gloo has neither bfloat16 nor int16, and a copy keeps the bits
            # (partitions are whole 64-element blocks, so the pairs never straddle two).
            flat = self._flat16.view(torch.int32)
            parts = list(flat.chunk(self._world))
            mine = parts[self._rank].clone()
            dist.all_gather(parts, mine, group=self._group)

    # ----------------------------------------------------------------------------- state

    def _read(self, tensor: int) -> torch.Tensor:
        out = torch.empty(self.padded_length, dtype=torch.float32)
        check(_lib.lib().offload_read_state(self._live(), tensor, 0, self.padded_length,
                                            _ptr(out)))
        return out

    def master_weights(self) -> torch.Tensor:
        """(num_params,) fp32 master weights, read from the servers."""
        return self._read(_lib.MASTER)[:self.num_params]

    def state_dict(self) -> Dict[str, Any]:
        """torch's layout (per-parameter ``exp_avg``, ``exp_avg_sq``, ``step``) plus each
        parameter's fp32 ``master`` and an ``offload`` entry (counters, loss scale)."""
        with self._lock:
            if _lib.lib().offload_in_step(self._live()):
                raise RuntimeError("state_dict() between backward() and step(): finish the step")
            master, m, v = (self._read(t) for t in (_lib.MASTER, _lib.EXP_AVG, _lib.EXP_AVG_SQ))
        scale = ctypes.c_float()
        clean = ctypes.c_uint32()
        skipped = ctypes.c_uint64()
        _lib.lib().offload_get_scaler(self._handle, ctypes.byref(scale), ctypes.byref(clean),
                                      ctypes.byref(skipped))
        adam_step = self._adam_step
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for i, (p, off) in enumerate(zip(self._params, self._offsets)):
            n = p.numel()
            state[i] = {"step": torch.tensor(float(adam_step)),
                        "exp_avg": m[off:off + n].view(self._shapes[i]).clone(),
                        "exp_avg_sq": v[off:off + n].view(self._shapes[i]).clone(),
                        "master": master[off:off + n].view(self._shapes[i]).clone()}
        groups = []
        index = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups,
                "offload": {"format": 1, "dtype": str(self.dtype), "num_params": self.num_params,
                            "completed_step": self._step, "adam_step": adam_step,
                            "loss_scale": float(scale.value), "clean_steps": int(clean.value),
                            "skipped_steps": int(skipped.value)}}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores what state_dict() returned: the servers' state, counters and loss scale, the
        groups' lrs, and the 16-bit weights (the master weights rounded). Everything is checked
        against this optimizer's parameters first; a refused state changes nothing."""
        meta = state_dict.get("offload")
        if not isinstance(meta, dict) or meta.get("format") != 1:
            raise ValueError("not a state_dict of an offload.torch optimizer (no 'offload' "
                             "entry of format 1)")
        if meta["dtype"] != str(self.dtype):
            raise ValueError(f"the state is of a {meta['dtype']} optimizer, this one is "
                             f"{self.dtype}")
        if meta["num_params"] != self.num_params:
            raise ValueError(f"the state is of a model of {meta['num_params']} parameters, this "
                             f"one has {self.num_params}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("the state's parameter groups differ from this optimizer's in "
                             "number or size")
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            for k in _FIXED:
                a, b = saved.get(k), mine[k]
                if k == "betas":
                    a, b = tuple(a or ()), tuple(b)
                if a != b:
                    raise ValueError(f"parameter group {i}: {k} is {saved[k]} in the state but "
                                     f"{mine[k]} here; the servers' job fixes it: build the "
                                     "optimizer with the saved value")
        flat = {name: torch.zeros(self.padded_length, dtype=torch.float32)
                for name in ("master", "exp_avg", "exp_avg_sq")}
        state = state_dict["state"]
        for i, (shape, off) in enumerate(zip(self._shapes, self._offsets)):
            s = state.get(i)
            if s is None:
                raise ValueError(f"the state has nothing for parameter {i}")
            for name, buf in flat.items():
                t = s.get(name)
                if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != torch.float32:
                    raise ValueError(
                        f"parameter {i}: {name} is "
                        f"{None if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}"
                        f", expected float32 of shape {tuple(shape)}: the state is of another "
                        "model")
                buf[off:off + t.numel()].copy_(t.reshape(-1))
        L = _lib.lib()
        with self._lock:
            self._live()
            self._abort()  # the state replaces whatever the open step would have applied
            old = (ctypes.c_float(), ctypes.c_uint32(), ctypes.c_uint64())
            L.offload_get_scaler(self._handle, *(ctypes.byref(v) for v in old))
            # The scaler first: it checks its values, and is put back if the shards refuse.
            check(L.offload_set_scaler(self._handle, float(meta["loss_scale"]),
                                       int(meta["clean_steps"]), int(meta["skipped_steps"])))
            rc = 0
            if self._rank == 0:
                rc = L.offload_load_state(self._handle, _ptr(flat["master"]),
                                          _ptr(flat["exp_avg"]), _ptr(flat["exp_avg_sq"]),
                                          int(meta["completed_step"]), int(meta["adam_step"]))
            error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
            try:
                self._agree(rc, error, "loading the state")
            except BaseException:
                L.offload_set_scaler(self._handle, old[0].value, old[1].value, old[2].value)
                raise
        self._step = int(meta["completed_step"])
        self._adam_step = int(meta["adam_step"])
        self.last_report = None
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        with torch.no_grad():
            self._flat16.copy_(flat["master"])


class Adam(AdamW):
    """torch.optim.Adam (weight decay added to the gradient) on the optimizer servers."""

    _kind = _lib.ADAM

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 **kwargs: Any):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}


def save_safetensors(model: torch.nn.Module, path: str) -> None:
    """Writes the model's state_dict (its 16-bit weights as trained) as a safetensors file, the
    format Hugging Face and gpu_trainer --init_from read. Written atomically: a temporary file,
    fsync, then a rename, so a crash leaves the old file or the new one. Tied tensors (one
    Parameter under two names) are written under each name."""
    tensors = {}
    for name, t in model.state_dict().items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name here")
        tensors[name] = t.detach().to("cpu").contiguous()
    header: Dict[str, Any] = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in sorted(tensors):
                t = tensors[name]
                # Through a same-size integer view: numpy has no bfloat16.
                view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                f.write(t.view(view[t.element_size()]).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dirfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
