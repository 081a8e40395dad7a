"""``offload.torch.AdamW``: a torch optimizer whose state lives on Offload's optimizer servers.

A model needs no change. The optimizer takes the parameters' values (fp32, as most models are
built) as the fp32 master weights on the servers, and casts the parameters in place to a 16-bit
type (``dtype=``, bf16 by default): each becomes a view of one flat 16-bit buffer, laid out group
by group in parameter order. While backward runs, a hook on every parameter, run once autograd
has accumulated its gradient, copies it to where the server reads it (the shared-memory segment
when the server is on this host), hands full buckets to the library's sender thread and frees
``p.grad`` (``offload.grad_hooks``). ``step()`` commits: the servers run Adam or
AdamW in fp32 and return the 16-bit weights, which land in the parameters in place.

Numerics live in the C++ library (``optimizer_client/capi/offload_c.h``): the statistics of the
gradients, the loss scale, the overflow skip and the clipping multiplier are the C++ trainer's
own step policy. This file only moves tensors and calls the library.
"""

from __future__ import annotations

import contextlib
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
from offload import checkpoint as ckpt
from offload import job as _job
from offload._lib import OffloadError, check
from offload.grad_hooks import BucketReducer, GradientHooks, HostCopies, Piece, StagingRing
from offload.param_window import ParamWindow
from offload.server import LocalServer

__all__ = ["AdamW", "Adam", "OffloadError", "materialize", "save_safetensors"]

_DTYPES = {torch.float16: _lib.FP16, torch.bfloat16: _lib.BF16}
# The installed torch's single-tensor Adam/AdamW, which the shards reproduce bit for bit: 2.0
# moved exp_avg with lerp_ (and bias_correction2 ** 0.5) where 1.x has mul_().add_().
_ADAM_FORM = (_lib.FORM_LERP if int(torch.__version__.split(".")[0]) >= 2
              else _lib.FORM_TORCH_1_13)
# Elements converted, sent or read per call when state moves in pieces (4 MiB of fp32): what the
# process holds of the state at a time.
_CHUNK = 1 << 20
# The hyper-parameters fixed when the job is created on the servers; lr may change every step.
_FIXED = ("betas", "eps", "weight_decay")


def _host_view(ptr: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """(n,) CPU tensor over memory the library owns (no copy)."""
    buf = (ctypes.c_uint8 * (n * 2)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=n)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _split_names(params: Any) -> Tuple[Any, Optional[List[str]]]:
    """torch.optim's params argument with the names taken off: (name, parameter) pairs, what
    model.named_parameters() gives, alone or as the "params" of groups, become plain parameters
    (torch 1.13's Optimizer takes tensors only) and the names are returned in flat order."""
    if isinstance(params, torch.Tensor):
        return params, None
    params = list(params)
    if not params:
        return params, None
    grouped = isinstance(params[0], dict)
    groups = params if grouped else [{"params": params}]
    names: List[Optional[str]] = []
    stripped = []
    for g in groups:
        items = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        plain = []
        for item in items:
            named = isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            names.append(item[0] if named else None)
            plain.append(item[1] if named else item)
        stripped.append({**{k: v for k, v in g.items() if k != "param_names"}, "params": plain})
    if all(n is None for n in names):
        return params, None
    if any(n is None for n in names):
        raise ValueError("some parameters come with names and some without: name every "
                         "parameter (model.named_parameters()) or none")
    return (stripped if grouped else stripped[0]["params"]), names  # type: ignore[return-value]


def _job_group() -> Any:
    """A torch job's ranks (offload.job): torch.distributed's default group when the job has
    several, which the script must have set up (the job's MASTER_ADDR, RANK... are in its
    environment)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"this torch job has {world} ranks: call "
                           "torch.distributed.init_process_group('gloo') (the job's MASTER_ADDR, "
                           "MASTER_PORT, RANK and WORLD_SIZE are set) before building the "
                           "optimizer, or pass process_group=")
    return dist.group.WORLD


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with fp32 state on optimizer servers and 16-bit parameters.

    ``params`` as torch's, or with names (``model.named_parameters()``, alone or as groups'
    "params"): the names are the tensors' names in ``save_checkpoint``'s files.

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
      keep_grads: leave each 16-bit gradient in ``p.grad`` after backward, as plain torch does,
        for code that reads them: 2 bytes a parameter more on the parameters' device, held until
        ``zero_grad()``. By default ``p.grad`` is freed as soon as the gradient is on its way, so
        after backward every ``p.grad`` is None. The step uses the gradients sent either way:
        clip with ``max_grad_norm`` or ``clip_grad_norm_`` of this optimizer. With
        accumulation over several ``backward()`` calls, keep_grads must be False.
      transport: "auto", "shm", "grpc" or "ucx".
      threads: Adam threads of the local server or the in-process engine (0: every core).
      job_id: the job's name on the servers (default: a fresh one).
      process_group: torch.distributed group for several ranks (ZeRO-2); None: one rank.
      trace_file: write a Chrome trace of every step there (backward, the gradients' sends,
        step) at close() and at write_trace().
      device: where the 16-bit weights live (default: the parameters' device). Each parameter
        is cast on the host, a chunk at a time, and copied there, so a model built in fp32 on
        the CPU trains on a GPU that could not hold it in fp32.
      state_dir: the local server's disk tier (``--state_dir``, servers=None only).
      optimizer_state: "auto" (on disk when the state does not fit the server's memory limit),
        "memory" or "disk": where the servers keep this job's fp32 state.
      server_memory_mib: the local server's ``--memory_limit_mib`` (0: its default).
      delay_update: the delayed parameter update (the ZeRO-Offload paper's DPU): after
        ``delay_warmup_steps`` ordinary steps, ``step()`` returns as soon as the step is decided
        and its commit has left; the servers run Adam while the next forward (and backward, up
        to its first complete gradient) computes on the weights one update old, and the update
        lands in the parameters at the next ``step()``. Exactly one update behind, never
        anything between. fp16 overflow in a delayed step skips it, as in an ordinary one; the
        loss scale moves at once. ``state_dict()``, ``save_checkpoint()`` and ``flush()`` put
        the update in flight into the parameters, so a run resumed from them computes with the
        same weights as the run that saved. On the CPU the update waits in a second 16-bit
        copy (2 bytes a parameter of host memory); on a GPU in the pinned copy there is anyway.
      update_in_backward: the servers run Adam on each bucket as soon as backward has produced
        all of its gradients, so by the end of backward most of the update is done and
        ``step()`` waits for the tail. The step's decision is speculated (nothing skipped or
        clipped, the lrs the groups have when backward begins): each server keeps what it
        overwrote (12 bytes a parameter of server memory, kept from the first such step) and
        at the commit restores and redoes exactly what the decision changed (an fp16 overflow,
        clipping that bites, a changed lr, a second ``backward()``), so the weights are the
        same bits as without it, always. After a step it had to undo, it pauses for a few
        steps (1, 3, 7, ... up to 63 while undos repeat); with several micro-batches per step
        it stays off. Where a server cannot (no memory for the copy, state on disk) it updates
        at the commit as usual. Every data plane carries it (shared memory, gRPC, UCX). ``last_report``'s
        ``early_updated`` and ``early_rolled_back`` count the elements. Not with
        ``delay_update``, which overlaps the same update with the next step instead.
      zero_stage: 2 (default): the 16-bit weights stay on ``device``; 3 (ZeRO-3, needs
        ``model``): they live in host memory (page-locked for a GPU; with several ranks each
        rank holds its partition) and visit the device a block at a time through hooks on
        ``model`` (``offload.param_window``): a block's parameters are copied there before its
        forward and again when backward needs them, then released; the blocks after it (in the
        last forward's order) are prefetched while they fit. The same bits as stage 2. Between
        uses the parameters are empty: outside the model's forward use ``gathered()``. The
        model may stay where it was built (the host) with ``device=`` the GPU: its buffers are
        moved there.
      model: the module whose forward uses the parameters (ZeRO-3).
      window: ZeRO-3: the most blocks on the device at once (2: one computing, one prefetched).
      max_resident_bytes: ZeRO-3: the most bytes of blocks and root set on the device (0: no
        limit but the window); below the root set plus the largest block it is refused.
      blocks: ZeRO-3: the modules fetched as units, as classes or a predicate (name, module);
        default: the children of the model's nn.ModuleList and nn.Sequential containers.
        Parameters outside every block stay on the device for the whole forward.
      persist_elements: ZeRO-3: parameters of at most this many elements stay on the device
        (default: 1-D ones of at most 65536, norms and biases).

    Gradient accumulation: any number of ``backward()`` calls per ``step()``. Each
    micro-batch's gradients leave during its backward (device memory stays a bucket); the servers
    add them in fp32, and the step (overflow skip, global norm, clipping) is decided on the sum,
    which is what the parameters' ``.grad`` would hold in fp32. As with torch, the sum is the
    gradient: divide the loss by the number of micro-batches for a mean. With several ranks each
    micro-batch is reduced between the ranks during its backward. ``step()`` with no gradient
    since the last one does nothing, as torch's.

    Parameters with ``requires_grad=False`` when the optimizer is built are frozen: cast to
    ``dtype`` with the others, but never sent, stepped or changed, and the servers hold nothing
    for them (no moments, no memory); unfreezing one later is refused at ``step()`` with an
    error (build a new optimizer). A trained parameter that gets no gradient in a step is skipped
    as torch skips it: its weights, moments and own step count (``state_dict()``'s per-parameter
    ``step``) stay.

    The fp32 values the parameters hold when the optimizer is built go to the servers in
    chunks as each parameter is cast; no fp32 copy of the model is made. For a model built on
    the meta device, see ``materialize``.
    """

    _kind = _lib.ADAMW

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 dtype: torch.dtype = torch.bfloat16, servers: Any = None,
                 token: Optional[str] = None, transport: str = "auto",
                 max_grad_norm: float = 0.0, loss_scale: float = 65536.0,
                 loss_scale_window: int = 2000, bucket_elements: int = 1 << 22, threads: int = 0,
                 keep_grads: bool = False,
                 job_id: Optional[str] = None, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_server_name: Optional[str] = None, call_timeout: float = 600.0,
                 process_group: Any = None, trace_file: Optional[str] = None,
                 device: Any = None, state_dir: Optional[str] = None,
                 optimizer_state: str = "auto", server_memory_mib: int = 0,
                 delay_update: bool = False, delay_warmup_steps: int = 20,
                 update_in_backward: bool = False, zero_stage: int = 2,
                 model: Optional[torch.nn.Module] = None, window: int = 2,
                 max_resident_bytes: int = 0, persist_elements: Optional[int] = None,
                 blocks: Any = None,
                 _values: Optional[Callable[[List[torch.nn.Parameter]],
                                            Iterable[Tuple[int, torch.nn.Parameter]]]] = None):
        if amsgrad:
            raise ValueError("amsgrad is not supported: the optimizer servers keep exp_avg and "
                             "exp_avg_sq only")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, not {dtype}")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"invalid lr {lr}, eps {eps} or weight_decay {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if optimizer_state not in _lib.TIERS:
            raise ValueError(f"optimizer_state must be one of {sorted(_lib.TIERS)}, not "
                             f"{optimizer_state!r}")
        if zero_stage not in (2, 3):
            raise ValueError(f"zero_stage must be 2 or 3, not {zero_stage}")
        if zero_stage == 3 and model is None:
            raise ValueError("zero_stage=3 needs model=: the parameters visit the device module "
                             "by module, through hooks on the model")
        if zero_stage == 2 and (model is not None or blocks is not None or max_resident_bytes):
            raise ValueError("model=, blocks= and max_resident_bytes= are zero_stage=3's")
        if persist_elements is not None and persist_elements < 0:
            raise ValueError(f"persist_elements is {persist_elements}")
        params, names = _split_names(params)
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
        if delay_warmup_steps < 0:
            raise ValueError(f"delay_warmup_steps is {delay_warmup_steps}; it must be >= 0")
        self._delay = bool(delay_update)
        self._delay_warmup = int(delay_warmup_steps)
        if update_in_backward and delay_update:
            raise ValueError("update_in_backward and delay_update both overlap the servers' "
                             "update with the model's compute (in this step's backward, or in "
                             "the next step): choose one")
        # The update during backward: wanted, on in the open step, micro-batches of the open
        # and of the last step, and the pause after undone speculation (steps left, undos in
        # a row).
        self._speculate_wanted = bool(update_in_backward)
        self._speculating = False
        self._micro_batches = 0
        self._last_micro_batches = 1
        self._speculation_pause = 0
        self._speculation_misses = 0
        self._in_flight = False  # a delayed commit runs on the servers
        self._pending_update = False  # _next16 holds an update the parameters have not

        if servers is None and _job.servers() is not None:
            # A torch job on the pool (offload.job): its servers, credential and id.
            servers = _job.servers()
            job_id = job_id or _job.job_id()
            if transport == "auto":
                transport = os.environ.get("OFFLOAD_TRANSPORT") or "auto"
            process_group = process_group if process_group is not None else _job_group()
            tls_ca = tls_ca or os.environ.get("OFFLOAD_TLS_CA")
            tls_cert = tls_cert or os.environ.get("OFFLOAD_TLS_CERT")
            tls_key = tls_key or os.environ.get("OFFLOAD_TLS_KEY")
            tls_server_name = tls_server_name or os.environ.get("OFFLOAD_TLS_SERVER_NAME")
        self._world, self._rank, self._group = 1, 0, process_group
        if process_group is not None:
            import torch.distributed as dist
            self._world = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)

        # The flat layout: group by group, parameter by parameter, of the parameters that
        # require gradients. Frozen ones (requires_grad=False) have no place on the servers.
        self._params: List[torch.nn.Parameter] = []
        self._offsets: List[int] = []
        self._shapes: List[torch.Size] = []
        self._packed: List[int] = []  # flat index -> index in param_groups order (torch's)
        self._frozen: List[Tuple[int, int]] = []  # (group, position) of each frozen parameter
        group_bounds: List[Tuple[int, int]] = []
        offset = 0
        packed = 0
        source_device = None
        for gi, g in enumerate(self.param_groups):
            start = offset
            if not g["params"]:
                raise ValueError("a parameter group without parameters")
            for pj, p in enumerate(g["params"]):
                packed += 1
                if not p.is_floating_point():
                    raise TypeError(f"parameter of dtype {p.dtype} is not floating point: the "
                                    "optimizer servers train floating-point parameters only")
                if p.is_sparse:
                    raise TypeError("sparse parameters are not supported")
                if source_device is None:
                    source_device = p.device
                elif p.device != source_device and device is None and _values is None:
                    raise ValueError(f"parameters on {source_device} and {p.device}: keep every "
                                     "parameter of one optimizer on one device, or pass device=")
                if not p.requires_grad:
                    self._frozen.append((gi, pj))
                    continue
                self._params.append(p)
                self._offsets.append(offset)
                self._shapes.append(p.shape)
                self._packed.append(packed - 1)
                offset += p.numel()
            group_bounds.append((start, offset - start))
        if offset == 0:
            raise ValueError("no parameter requires a gradient: there is nothing to train")
        self.num_params = offset
        # The servers' parameter groups: those with a parameter to train.
        self._trained = [gi for gi, (_, n) in enumerate(group_bounds) if n > 0]
        self.device = torch.device(device) if device is not None else source_device
        if self.device.type == "meta" and _values is not None:
            self.device = torch.device("cpu")  # materialize()'s model, without a device=
        if self.device.type == "meta":
            raise ValueError("the parameters are on the meta device: build the optimizer with "
                             "offload.torch.materialize(model, ...), which gives them values")
        if names is not None and len(names) != packed:
            raise ValueError("name every parameter or none")
        self._names: Optional[List[str]] = (None if names is None else
                                            [names[k] for k in self._packed])

        servers_list, token = self._servers(servers, token, threads, state_dir,
                                            server_memory_mib)
        groups = (_lib.Group * len(self._trained))()
        for i, (g, (start, length)) in enumerate(
                (self.param_groups[gi], group_bounds[gi]) for gi in self._trained):
            groups[i] = _lib.Group(start, length, self._kind, float(g["lr"]),
                                   float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                                   float(g["weight_decay"]))
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
            trace_file=enc(trace_file), state_tier=_lib.TIERS[optimizer_state],
            adam_form=_ADAM_FORM)
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
        # values (or what _values makes of them) are the master weights, streamed to the servers.
        # ZeRO-3: the flat buffer is the host copy (page-locked for a GPU), of this rank's
        # partition only with several ranks (flat [_host_lo, _host_lo + its length)); the
        # parameters visit the device through the window (offload.param_window).
        self.zero_stage = zero_stage
        self._window: Optional[ParamWindow] = None
        self._persistent = [self._persists(p, persist_elements) for p in self._params]
        host_only = zero_stage == 3 or self.device.type == "cpu"
        partitioned = zero_stage == 3 and self._world > 1
        self._host_lo = self._part_offset if partitioned else 0
        self._flat16 = torch.empty(self._part_length if partitioned else self.padded_length,
                                   dtype=dtype, device="cpu" if host_only else self.device,
                                   pin_memory=zero_stage == 3 and self.device.type == "cuda")
        self._host16 = (self._flat16 if host_only else
                        torch.empty(self.padded_length, dtype=dtype,
                                    pin_memory=torch.cuda.is_available()))
        # The delayed update's weights wait here while the parameters are in use: on a GPU the
        # host copy the commits write anyway, on the CPU a second copy (2 bytes a parameter).
        self._next16 = (self._host16 if not self._delay or self._host16 is not self._flat16 else
                        torch.empty_like(self._host16))
        self._partitions: List[Tuple[int, int]] = []  # every rank's, for ZeRO-3's gathers
        if partitioned:
            import torch.distributed as dist
            bounds: List[Any] = [None] * self._world
            dist.all_gather_object(bounds, (self._part_offset,
                                            self._part_offset + self._part_length),
                                   group=self._group)
            self._partitions = [tuple(b) for b in bounds]
        try:
            self._set_up_weights(_values)
            self._set_up_frozen(_values)
        except BaseException:
            self.close()  # no job left on the servers, no server left running
            raise
        if self._world > 1:
            # The servers hold rank 0's values: every rank computes with them (as DDP does), and
            # with rank 0's frozen parameters (as bytes: gloo has no bfloat16). ZeRO-3: each
            # rank reads its partition of them from the servers.
            import torch.distributed as dist
            if partitioned:
                self._weights_from_masters()
            else:
                dist.broadcast(self._flat16.view(torch.int32), src=self._src0(),
                               group=self._group)
            for gi, pj in self._frozen:
                frozen = self.param_groups[gi]["params"][pj].data
                dist.broadcast(frozen.view(-1).view(torch.uint8), src=self._src0(),
                               group=self._group)

        self._init_gradients(keep_grads)
        if zero_stage == 3:
            try:
                self._window = ParamWindow(
                    model, self._params, self._persistent, self._fill_from_host, self.device,
                    dtype, window, max_resident_bytes, blocks,
                    persistent_bytes=sum(s.numel() for s, keep in zip(self._shapes,
                                                                      self._persistent) if keep)
                    * self._flat16.element_size())
            except BaseException:
                self.close()
                raise
            self._weights_changed()
            # The model's buffers (a BatchNorm's statistics, a causal mask) go where it computes:
            # a model built on the host is not moved there whole.
            for module in model.modules():
                for name, b in module._buffers.items():
                    if b is not None and b.device != self.device:
                        module._buffers[name] = b.to(self.device)

    # ----------------------------------------------------------------------------- set-up

    def _set_up_weights(self, values: Optional[Callable[[List[torch.nn.Parameter]], Iterable[
            Tuple[int, torch.nn.Parameter]]]]) -> None:
        """Each parameter in turn: its fp32 values go to the servers (rank 0) as the master
        weights, in chunks, and it becomes a view of the flat 16-bit buffer, its own storage
        freed; so no fp32 copy of the model is ever made, and a model built in fp32 on the CPU
        shrinks as it is cast. `values` (materialize's) yields (index, parameter) pairs in any
        order, the parameter replacing the optimizer's own; by default each parameter is its own
        value, in flat order."""
        L = _lib.lib()
        loading = self._rank == 0
        rc = L.offload_load_begin(self._handle, 0, 0, 0) if loading else 0
        self._agree(rc, L.offload_last_error().decode("utf-8", "replace") if rc else "",
                    "starting the load of the master weights")
        try:
            # flat index -> (group, position) in param_groups
            where = [(gi, pj) for gi, g in enumerate(self.param_groups)
                     for pj in range(len(g["params"]))]
            done = [False] * len(self._params)
            source = (values(list(self._params)) if values is not None else
                      ((k, p) for k, p in enumerate(self._params)))
            for index, p in source:
                if done[index]:
                    raise RuntimeError(f"parameter {index} was given values twice")
                if p is not self._params[index]:
                    gi, pj = where[self._packed[index]]
                    self.param_groups[gi]["params"][pj] = p
                    self._params[index] = p
                self._take_values(index, p, loading)
                done[index] = True
            missing = [k for k, d in enumerate(done) if not d]
            if missing:
                raise RuntimeError(f"parameters {missing[:8]} got no values")
            # The padding: the servers' is zero too.
            self._flat16[max(0, self.num_params - self._host_lo):].zero_()
            rc = L.offload_load_finish(self._handle) if loading else 0
            error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
        except BaseException:
            if loading and self._handle:
                L.offload_load_abort(self._handle)
            raise
        self._agree(rc, error, "loading the master weights")

    def _set_up_frozen(self, values: Any) -> None:
        """The frozen parameters (requires_grad=False when the optimizer was built) are cast to
        the 16-bit type on the optimizer's device, as the trained ones are, so the model computes
        in one type; they are never sent, stepped or changed afterwards (torch's AdamW leaves a
        parameter without a gradient alone), and the servers hold nothing for them."""
        replaced = getattr(values, "replaced", {})
        with torch.no_grad():
            for gi, pj in self._frozen:
                p = self.param_groups[gi]["params"][pj]
                p = replaced.get(id(p), p)  # materialize()'s parameter with values
                if p.is_meta:
                    raise ValueError(f"a frozen parameter (shape {tuple(p.shape)}) is on the meta "
                                     "device but no module of the model holds it")
                self.param_groups[gi]["params"][pj] = p
                if p.dtype != self.dtype or p.device != self.device or not p.is_contiguous():
                    p.data = p.data.to(device=self.device, dtype=self.dtype).contiguous()

    def _take_values(self, index: int, p: torch.nn.Parameter, loading: bool) -> None:
        """p's values: to the servers as fp32 (rank 0), into the flat buffer rounded to 16 bits,
        then p becomes its view there. Conversions run a chunk at a time."""
        L = _lib.lib()
        off, n = self._offsets[index], p.numel()
        if p.shape != self._shapes[index]:
            raise RuntimeError(f"parameter {index} has shape {tuple(p.shape)}, expected "
                               f"{tuple(self._shapes[index])}")
        src = p.detach().reshape(-1)
        # ZeRO-3 over ranks: the host copies are read from the servers once they are loaded.
        dst = self._flat16[off:off + n] if not self._partitions else None
        direct = src.device.type == "cpu" and src.dtype == torch.float32 and src.is_contiguous()
        with torch.no_grad():
            for a in range(0, n, _CHUNK):
                b = min(n, a + _CHUNK)
                piece = src[a:b] if direct else src[a:b].to("cpu", torch.float32)
                if loading:
                    check(L.offload_load_chunk(self._handle, _lib.MASTER, off + a, b - a,
                                               _ptr(piece)))
                if dst is None:
                    pass
                elif dst.device.type == "cpu":
                    dst[a:b].copy_(piece)  # round to nearest even, as the servers round
                else:
                    dst[a:b].copy_(piece.to(self.dtype), non_blocking=False)
            p.data = self._stage3_data(index) if self.zero_stage == 3 else dst.view(
                self._shapes[index])
            p.grad = None

    @staticmethod
    def _persists(p: torch.nn.Parameter, persist_elements: Optional[int]) -> bool:
        """Whether ZeRO-3 keeps p on the device all the time: by default the small 1-D ones
        (norms, biases), else those of at most persist_elements elements."""
        if persist_elements is None:
            return p.dim() <= 1 and p.numel() <= 1 << 16
        return p.numel() <= persist_elements

    def _stage3_data(self, index: int) -> torch.Tensor:
        """ZeRO-3: what parameter index holds once its values are in the host copy. A persistent
        one: its place on the device (on the CPU with one rank, a view of the host copy, as stage
        2's; else a tensor _weights_changed fills); a
        managed one: a stand-in of its shape that holds no memory, until the window releases it
        (autograd's hooks are set up on the parameter's shape)."""
        off, shape = self._offsets[index], self._shapes[index]
        if self._persistent[index]:
            if self.device.type == "cpu" and not self._partitions:
                return self._flat16[off:off + shape.numel()].view(shape)
            # Filled by _weights_changed once the window is built.
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        return torch.empty(1, dtype=self.dtype, device=self.device).expand(shape)

    def _host_ptr(self, t: torch.Tensor) -> ctypes.c_void_p:
        """The library's (padded_length,) view of a host copy: where flat offset 0 would be
        (ZeRO-3 over ranks holds only the partition, the only part the library writes)."""
        return ctypes.c_void_p(t.data_ptr() - t.element_size() * self._host_lo)

    def _fill_from_host(self, indices: List[int], tensors: List[torch.Tensor]) -> None:
        """The window's fetch: the parameters' 16-bit values from the host copy, or from every
        rank's partition of it."""
        if self._partitions:
            self._gather_params(indices, tensors)
            return
        for i, t in zip(indices, tensors):
            off = self._offsets[i]
            t.copy_(self._flat16[off:off + t.numel()].view(t.shape), non_blocking=True)

    def _gather_params(self, indices: List[int], tensors: List[torch.Tensor]) -> None:
        """ZeRO-3 over ranks: the parameters' values from the ranks that hold them, in one
        all_gather of the pieces each rank's partition has (as bytes: gloo has no bfloat16).
        Every rank gathers the same parameters in the same order."""
        import torch.distributed as dist
        spans: List[List[Tuple[int, int, int, int]]] = []  # per rank: (k, start in k, n, flat)
        for lo, hi in self._partitions:
            pieces = []
            for k, i in enumerate(indices):
                off, n = self._offsets[i], self._shapes[i].numel()
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    pieces.append((k, a - off, b - a, a))
            spans.append(pieces)
        width = max(1, max(sum(n for _, _, n, _ in pieces) for pieces in spans))
        where = self.device if dist.get_backend(self._group) == "nccl" else torch.device("cpu")
        mine = torch.zeros(width, dtype=self.dtype, device=where)
        pos = 0
        for _, _, n, a in spans[self._rank]:
            mine[pos:pos + n].copy_(self._flat16[a - self._host_lo:a - self._host_lo + n])
            pos += n
        out = [torch.empty(width, dtype=self.dtype, device=where) for _ in spans]
        dist.all_gather([o.view(torch.uint8) for o in out], mine.view(torch.uint8),
                        group=self._group)
        for r, pieces in enumerate(spans):
            pos = 0
            for k, start, n, _ in pieces:
                tensors[k].view(-1)[start:start + n].copy_(out[r][pos:pos + n], non_blocking=True)
                pos += n

    def _weights_changed(self) -> None:
        """ZeRO-3, after the host copy changed (a step, a load): the persistent parameters that
        are not views of it (on a GPU, or with several ranks) take the new values; copies on the
        device are stale."""
        if self._window is None:
            return
        keep = [i for i, k in enumerate(self._persistent) if k]
        if keep and (self.device.type != "cpu" or self._partitions):
            with torch.no_grad():
                self._fill_from_host(keep, [self._params[i].data for i in keep])
        self._window.invalidate()

    def gathered(self) -> Any:
        """ZeRO-3: a context in which every parameter is on the device with its current values
        (evaluation or export outside the model's forward, ``model.state_dict()``). Stage 2: a
        context that does nothing."""
        if self._window is None:
            return contextlib.nullcontext()
        return self._window.gather()

    @property
    def completed_steps(self) -> int:
        """Steps committed on the servers since the job began (skipped ones included), restored
        by load_checkpoint: where a resumed training loop goes on from."""
        return self._step

    def _checkpoint_path(self, path: Optional[str], what: str) -> str:
        if path is not None:
            return path
        path = _job.checkpoint_dir()
        if path is None:
            raise ValueError(f"{what}() needs a path: this process is no torch job with a "
                             "checkpoint directory (checkpoint.dir, $OFFLOAD_CHECKPOINT_DIR)")
        return path

    @property
    def param_window(self) -> Optional[ParamWindow]:
        """ZeRO-3's device window (its blocks, resident_bytes(), peak_resident_bytes), or None."""
        return self._window

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

    def _servers(self, servers: Any, token: Optional[str], threads: int,
                 state_dir: Optional[str], memory_mib: int) -> Tuple[List[str], Optional[str]]:
        if servers is None:
            if self._world > 1:
                raise ValueError("several ranks need running servers: pass servers=[...] and "
                                 "token=...")
            self._server = LocalServer(threads=threads, state_dir=state_dir,
                                       memory_limit_mib=memory_mib)
            return [self._server.address], self._server.token
        if state_dir is not None:
            raise ValueError("state_dir= is the local server's (servers=None); running servers "
                             "have their own --state_dir")
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
        if getattr(self, "_grad_hooks", None) is not None:
            self._grad_hooks.remove()
        if getattr(self, "_window", None) is not None:
            self._window.remove()
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

    # Staging slots of the CUDA ring: enough to keep copies in flight while older slots are
    # handed over, few enough that the page-locked memory stays small.
    _STAGING_SLOTS = 4
    # Whether a CPU model's gradients go through the staging ring too (the CUDA path's
    # bookkeeping with stand-in streams): for tests; a CPU gradient is copied straight into place.
    _stage_on_cpu = False
    # The way of hooking after accumulation (grad_hooks' names); None: this torch's newest.
    _hook_path: Optional[str] = None

    def _init_gradients(self, keep_grads: bool) -> None:
        """The per-step gradient state, and the hooks that feed it."""
        self.keep_grads = bool(keep_grads)
        self._sent = [False] * len(self._params)  # in the current micro-batch
        self._seen = [False] * len(self._params)  # in any micro-batch of the step
        self._unused: List[int] = []  # of the step being decided (_global_stats)
        # Per parameter, the updates it missed (applied steps in which it had no gradient): its
        # own step count, torch's state["step"], is adam_step minus this.
        self._lag = [0] * len(self._params)
        self._gradients_done = False
        self._pending: List[Tuple[int, int, int]] = []  # (offset, n, where)
        self._pending_elements = 0
        # Weak references: the model's parameters must not keep the optimizer (its job, its
        # server) alive, and a collected or closed optimizer's hooks do nothing; nor should its
        # own ring and reducer (a cycle would keep it until the garbage collector runs).
        ref = weakref.ref(self)
        self._ring: Optional[StagingRing] = None
        self._reducer: Optional[BucketReducer] = None
        copies = HostCopies(self.device)
        if self._world > 1:
            self._reducer = BucketReducer(
                self._buckets(), self._offsets, self.device, self._part_offset,
                self._part_offset + self._part_length, copies,
                lambda flat: ref()._all_reduce(flat),
                lambda offset, grads, complete: ref()._send_share(offset, grads, complete),
                lambda name, begin: ref()._trace(name, begin))
        elif self.device.type == "cuda" or self._stage_on_cpu:
            self._ring = StagingRing(self._STAGING_SLOTS,
                                     min(self.bucket_elements, self.padded_length), self.dtype,
                                     copies, lambda pieces: ref()._hand_over(pieces))

        def arrived(index: int) -> None:
            opt = ref()
            if opt is not None and opt._handle:
                opt._on_gradient(index)
        self._grad_hooks = GradientHooks(self._params, arrived, self._hook_path)

    def _begin_step(self) -> None:
        if not _lib.lib().offload_in_step(self._live()):
            # The delayed commit must be done on the servers before this step opens there; its
            # update waits for step() (the parameters must not change under backward).
            self._wait_commit()
            check(_lib.lib().offload_begin_step(self._handle, self._step + 1))
            self._micro_batches = 1
            if self._speculation_due():
                self._speculate()

    def _speculation_due(self) -> bool:
        """Whether the step opening now updates during backward."""
        if not self._speculate_wanted or self._last_micro_batches != 1:
            return False
        if self._speculation_pause > 0:
            self._speculation_pause -= 1
            return False
        return True

    def _speculate(self) -> None:
        """The commit this step will most likely make: every parameter gets its gradient (each
        its own t), the groups' lrs as they are now, nothing skipped or clipped."""
        lrs = (ctypes.c_double * len(self._trained))(
            *[float(self.param_groups[gi]["lr"]) for gi in self._trained])
        runs = self._range_step_runs([])
        array = (_lib.RangeStep * max(1, len(runs)))(*[_lib.RangeStep(*r) for r in runs])
        check(_lib.lib().offload_speculate(self._handle, lrs, len(lrs), array, len(runs)))
        self._speculating = True

    def _on_gradient(self, index: int) -> None:
        """Parameter index's gradient is in p.grad, accumulated over every use of p in the
        graph: on its way, then freed (unless keep_grads)."""
        p = self._params[index]
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError(f"parameter {index} got a sparse gradient: offload.torch optimizers "
                               "take dense gradients only")
        if grad.shape != self._shapes[index]:
            raise RuntimeError(
                f"parameter {index} (shape {tuple(self._shapes[index])}) got a gradient of shape "
                f"{tuple(grad.shape)}"
                + ("; with zero_stage=3 a parameter is empty outside the forward of the block "
                   "that holds it: was it used elsewhere? (blocks= can name a module that holds "
                   "both the parameter and its use)" if self._window is not None else ""))
        with self._lock:
            self._check_param(index)
            self._begin_step()
            if self._sent[index]:
                self._next_micro_batch(index)
            self._sent[index] = True
            self._seen[index] = True
            off = self._offsets[index]
            if self._reducer is not None:
                self._reducer.add(index, grad)
            elif self._ring is not None:
                self._ring.put(off, grad)
            else:
                self._place(off, grad.numel()).copy_(grad.detach().reshape(-1))
                self._pending_elements += grad.numel()
                if self._pending_elements >= self.bucket_elements:
                    self._flush()
            if not self.keep_grads:
                p.grad = None
            if self._window is not None:
                self._window.arrived(index)

    def _next_micro_batch(self, index: int) -> None:
        """Parameter index has a gradient again: another backward() of the same step began (a
        parameter's hook runs once per backward). Everything of the micro-batch before leaves
        first; the library then adds what follows to it (the servers sum in fp32)."""
        if self.keep_grads:
            self._abort()
            raise RuntimeError(
                f"parameter {index} got a second gradient before step(): with keep_grads=True, "
                "torch accumulates p.grad in 16 bits, which the servers cannot undo; accumulate "
                "gradients over several backward() calls with keep_grads=False (the servers sum "
                "the micro-batches in fp32)")
        try:
            if self._reducer is not None:
                self._reducer.finish()
                self._reducer.reset()
            elif self._ring is not None:
                self._ring.flush()
            self._flush()
            self._speculating = False  # the library and the servers undo what it updated
            self._micro_batches += 1
            check(_lib.lib().offload_next_micro_batch(self._handle))
        except BaseException:
            self._abort()  # the step ends, nothing applied: zero_grad() and retry
            raise
        self._sent = [False] * len(self._params)

    def _hand_over(self, pieces: List[Piece]) -> None:
        """A staging slot whose copies have landed: into the library's place, then ready."""
        for off, src in pieces:
            self._place(off, src.numel()).copy_(src)
        self._flush()

    def _place(self, off: int, n: int) -> torch.Tensor:
        """(n,) host view of where flat [off, off + n)'s 16-bit gradients go (the shared-memory
        segment, or the library's buffer), queued for the next _flush."""
        ptr = _lib.lib().offload_gradient_buffer(self._handle, off, n)
        if not ptr:
            check(13)
        self._pending.append((off, n, ptr))
        return _host_view(ptr, n, self.dtype)

    def _all_reduce(self, flat: torch.Tensor) -> Any:
        import torch.distributed as dist
        return dist.all_reduce(flat, group=self._group, async_op=True)

    def _send_share(self, offset: int, grads: torch.Tensor, complete: bool) -> None:
        """This rank's share of a bucket's fp32 sum over the ranks (host memory): the library
        takes the mean and rounds it to 16 bits in one pass. complete: every parameter of the
        bucket had its gradient (not zeros of finish()), so it may be updated early."""
        check(_lib.lib().offload_send_gradients_f32(self._handle, offset, _ptr(grads),
                                                    grads.numel(), 1.0 / self._world))
        if self._speculating and complete:
            check(_lib.lib().offload_update_ready(self._handle, offset, grads.numel()))

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
        L = _lib.lib()
        for off, n, ptr in runs:
            check(L.offload_gradients_ready(self._handle, off, n, ptr))
            if self._speculating:
                check(L.offload_update_ready(self._handle, off, n))
        self._pending = []
        self._pending_elements = 0

    def _fill_missing(self) -> None:
        """Zeros for parameters backward gave no gradient this step, and for the padding."""
        missing = [(self._offsets[i], self._shapes[i].numel())
                   for i, seen in enumerate(self._seen) if not seen]
        if self.padded_length > self.num_params:
            missing.append((self.num_params, self.padded_length - self.num_params))
        for off, n in missing:
            self._place(off, n).zero_()
        for i in range(len(self._sent)):
            self._sent[i] = True
        self._flush()

    def _finish_gradients(self) -> None:
        """Every gradient of this rank's partition on its way (once per step)."""
        if self._gradients_done:
            return
        unfrozen = self._frozen_with_grad()
        if unfrozen is not None:
            gi, p = unfrozen
            raise RuntimeError(
                f"a parameter of group {gi} (shape {tuple(p.shape)}) was frozen "
                "(requires_grad=False) when the optimizer was built and has a gradient now: "
                "the servers hold no state for it and the job's parameters are fixed. "
                "Build a new optimizer after unfreezing, or set its .grad to None to keep "
                "it frozen")
        if self._reducer is not None:
            # The buckets finish() fills with zeros say so (complete=False): they update at
            # the commit.
            self._reducer.finish()
            self._speculating = False
            self._sent = [True] * len(self._params)
        else:
            if self._ring is not None:
                self._ring.flush()
            self._flush()  # backward's last bucket: still updated early, before the commit
            self._speculating = False  # the zeros of _fill_missing update at the commit
            self._fill_missing()
        self._gradients_done = True

    def _buckets(self) -> List[Tuple[int, int, List[int]]]:
        """[start, end) runs of whole parameters of about bucket_elements, covering
        [0, padded_length) (the padding in the last)."""
        out: List[Tuple[int, int, List[int]]] = []
        start, members = 0, []
        for i, (shape, off) in enumerate(zip(self._shapes, self._offsets)):
            members.append(i)
            end = off + shape.numel()
            if end - start >= self.bucket_elements:
                out.append((start, end, members))
                start, members = end, []
        if start < self.padded_length:
            out.append((start, self.padded_length, members))
        return out

    def _check_param(self, index: int) -> None:
        p = self._params[index]
        off = self._offsets[index]
        if self._window is not None:
            if p.dtype != self.dtype or (p.shape != self._shapes[index] and p.numel() != 0):
                raise RuntimeError(
                    f"parameter {index} (shape {tuple(self._shapes[index])}) changed after the "
                    f"optimizer was built: it is now {p.dtype} of shape {tuple(p.shape)}; build "
                    "a new optimizer for a changed model")
            return
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
        self._speculating = False
        self._sent = [False] * len(self._params)
        self._seen = [False] * len(self._params)
        self._pending = []
        self._pending_elements = 0
        if getattr(self, "_ring", None) is not None:
            self._ring.reset()
        if getattr(self, "_reducer", None) is not None:
            self._reducer.reset()

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
        """The statistics summed over the ranks (None with one rank), and in _unused the
        parameters no rank had a gradient for (torch skips those): one all-reduce for both."""
        if self._world == 1:
            self._unused = [i for i, seen in enumerate(self._seen) if not seen]
            return None
        local = (ctypes.c_double * 2)()
        check(_lib.lib().offload_local_stats(self._handle, local))
        import torch.distributed as dist
        # On the parameters' device: NCCL reduces device tensors only.
        device = self.device if dist.get_backend(self._group) == "nccl" else "cpu"
        t = torch.tensor([local[0], local[1]] + [float(s) for s in self._seen],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self._group)
        summed = t.cpu().tolist()
        self._unused = [i for i, seen in enumerate(summed[2:]) if seen == 0]
        return (ctypes.c_double * 2)(summed[0], summed[1])

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
            if not L.offload_in_step(self._handle) and self._frozen_with_grad() is None:
                # No gradient since the last step: nothing to do, as torch.optim does nothing
                # for parameters without gradients (every rank must agree, as with DDP).
                return loss
            stats = self._gradients_out()
            unused = self._unused
            self._set_range_steps(unused)
            lrs = (ctypes.c_double * len(self._trained))(
                *[float(self.param_groups[gi]["lr"]) for gi in self._trained])
            max_norm = self._step_max_norm if self._step_max_norm is not None else -1.0
            report = _lib.StepReport()
            delayed = self._delay and self._step >= self._delay_warmup
            if delayed:
                # The update of the step before lands now, before this one leaves: the next
                # forward computes with it, one update behind the servers (the paper's DPU).
                self._apply_pending()
                rc = L.offload_commit_async(self._handle, stats, lrs, len(lrs), max_norm,
                                            self._host_ptr(self._next16), ctypes.byref(report))
            else:
                rc = L.offload_commit(self._handle, stats, lrs, len(lrs), max_norm,
                                      self._host_ptr(self._host16), ctypes.byref(report))
            error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
            # Whatever happened, this step is over on both sides (a commit refused before it
            # reached the shards leaves the library's step open: it ends here, nothing applied).
            self._abort()
            if rc == 0:
                self._step_max_norm = None
            self._agree(rc, error, "committing the step")
            self._in_flight = delayed
        self._trace("step", begin)
        self._last_micro_batches = self._micro_batches
        if report.early_rolled_back:
            # Speculation that had to be undone cost its copies for nothing: wait longer each
            # time it happens again.
            self._speculation_misses += 1
            self._speculation_pause = min(2 ** self._speculation_misses - 1, 63)
        elif report.early_updated:
            self._speculation_misses = 0
        if not report.skipped:
            for i in unused:
                self._lag[i] += 1
        self._step = int(report.step)
        if delayed:  # the shards' count comes with offload_wait_commit; this is what it will be
            self._adam_step += 0 if report.skipped else 1
            report.adam_step = self._adam_step
            report.skipped_steps = self._step - self._adam_step
        else:
            self._adam_step = int(report.adam_step)
        if not report.skipped and not delayed:
            self._gather_weights(self._host16)
        self.last_report = {f: getattr(report, f) for f, _ in _lib.StepReport._fields_}
        if _job.active():
            self._job_step()
        return loss

    def _job_step(self) -> None:
        """A torch job's step boundary (offload.job): the step count reported, and the
        controller's requests carried out by every rank at the same step, as gpu_trainer does:
        a checkpoint asked for is written to the job's directory; a pause or cancel writes one
        too, then ends the script with exit code 130 (stopped as asked)."""
        _job._optimizer_stepped(self._step, float(self.last_report["loss_scale"]))
        decided: List[Any] = list(_job.request())
        if self._world > 1:
            import torch.distributed as dist
            dist.broadcast_object_list(decided, src=self._src0(), group=self._group)
        what, wanted = decided[0], int(decided[1])
        stop = what in ("pause", "cancel")
        if (stop or wanted > _job.checkpoint_request_done()) and _job.checkpoint_dir():
            directory = self.save_checkpoint()
            _job._checkpointed(directory, self._step, wanted)
        if stop:
            _job._flush()
            raise SystemExit(130)

    def _range_step_runs(self, unused: List[int]) -> List[List[int]]:
        """[offset, n, t] runs of what torch does per parameter: a parameter without a gradient
        is not updated (t 0), and one that missed updates before takes its own bias-correction
        step; neighbours in the flat space with the same t go as one run, and the job's own t
        needs none."""
        skip = set(unused)
        runs: List[List[int]] = []
        for i, off in enumerate(self._offsets):
            t = 0 if i in skip else self._adam_step + 1 - self._lag[i]
            if t == self._adam_step + 1:
                continue  # the job's own
            n = self._shapes[i].numel()
            if runs and runs[-1][0] + runs[-1][1] == off and runs[-1][2] == t:
                runs[-1][1] += n
            else:
                runs.append([off, n, t])
        return runs

    def _set_range_steps(self, unused: List[int]) -> None:
        """Tells the commit the range steps of _range_step_runs. Any failure ends the step,
        nothing applied."""
        runs = self._range_step_runs(unused)
        if not runs:
            return  # the library starts every step with none
        array = (_lib.RangeStep * len(runs))(*[_lib.RangeStep(*r) for r in runs])
        try:
            check(_lib.lib().offload_set_range_steps(self._handle, array, len(runs)))
        except BaseException:
            self._abort()
            raise

    def _wait_commit(self) -> None:
        """The delayed commit in flight, if any, done on the servers: its weights wait in
        _next16 until _apply_pending. A commit that failed raises here; its update is lost (the
        servers applied nothing)."""
        if not self._in_flight:
            return
        self._in_flight = False
        report = _lib.StepReport()
        check(_lib.lib().offload_wait_commit(self._handle, ctypes.byref(report)))
        self._adam_step = int(report.adam_step)
        self._pending_update = not report.skipped

    def _apply_pending(self) -> None:
        """The delayed update, once its commit is done, into the parameters (every rank)."""
        self._wait_commit()
        if self._pending_update:
            self._pending_update = False
            self._gather_weights(self._next16)

    def flush(self) -> None:
        """With ``delay_update``: waits for the update in flight and puts it into the
        parameters now, so they hold every committed step (evaluation, export). Checkpoints and
        ``state_dict()`` do it themselves. Nothing to do otherwise."""
        with self._lock:
            self._live()
            self._apply_pending()

    def _frozen_with_grad(self) -> Optional[Tuple[int, torch.nn.Parameter]]:
        """(group, parameter) of the first frozen parameter that has a gradient (unfrozen
        since the optimizer was built), or None."""
        for gi, pj in self._frozen:
            p = self.param_groups[gi]["params"][pj]
            if p.grad is not None:
                return gi, p
        return None

    def _gather_weights(self, src: torch.Tensor) -> None:
        """After a commit: this rank's partition is in src; every rank's, in the parameters."""
        if src is not self._flat16:
            lo, n = self._part_offset - self._host_lo, self._part_length
            self._flat16[lo:lo + n].copy_(src[lo:lo + n])
        if self._world > 1 and not self._partitions:
            import torch.distributed as dist
            # As int32 pairs: gloo has neither bfloat16 nor int16, and a copy keeps the bits
            # (partitions are whole 64-element blocks, so the pairs never straddle two).
            flat = self._flat16.view(torch.int32)
            parts = list(flat.chunk(self._world))
            mine = parts[self._rank].clone()
            dist.all_gather(parts, mine, group=self._group)
        self._weights_changed()

    # ----------------------------------------------------------------------------- state

    def _read(self, tensor: int, offset: int, n: int) -> torch.Tensor:
        out = torch.empty(n, dtype=torch.float32)
        check(_lib.lib().offload_read_state(self._live(), tensor, offset, n, _ptr(out)))
        return out

    def master_weights(self) -> torch.Tensor:
        """(num_params,) fp32 master weights, read from the servers (4 bytes a parameter), with
        every committed step (a delayed one included, whether or not the parameters have it)."""
        with self._lock:
            self._live()
            self._wait_commit()
        return self._read(_lib.MASTER, 0, self.num_params)

    def _fixed_hyperparameters_match(self, groups: List[Dict[str, Any]],
                                     names: Optional[List[str]] = None) -> None:
        """Refuses saved groups whose number, size or fixed hyper-parameters differ: the job's
        betas, eps and weight decay are fixed on the servers when it is created. `names`: the
        groups list trained parameters by name (checkpoints), else every parameter by index."""
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"])
                for a, b in zip(groups, self._packed_groups(names))):
            raise ValueError("the state's parameter groups differ from this optimizer's in "
                             "number or size")
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            for k in _FIXED:
                a, b = saved.get(k), mine[k]
                if k == "betas":
                    a, b = tuple(a or ()), tuple(b)
                if a != b:
                    raise ValueError(f"parameter group {i}: {k} is {saved.get(k)} in the state "
                                     f"but {mine[k]} here; the servers' job fixes it: build the "
                                     "optimizer with the saved value")

    def _restore_groups(self, groups: List[Dict[str, Any]]) -> None:
        for saved, mine in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v

    def _weights_from_masters(self) -> None:
        """The 16-bit weights := the servers' master weights rounded (each rank reads its
        partition, then the ranks gather), a chunk at a time."""
        L = _lib.lib()
        lo, n = self._part_offset, self._part_length
        for a in range(lo, lo + n, _CHUNK):
            m = min(_CHUNK, lo + n - a)
            view = self._host16[a - self._host_lo:a - self._host_lo + m]
            check(L.offload_read_weights16(self._handle, a, m, _ptr(view)))
        self._gather_weights(self._host16)

    def state_dict(self) -> Dict[str, Any]:
        """torch's layout (per-parameter ``exp_avg``, ``exp_avg_sq``, ``step``) plus each
        parameter's fp32 ``master`` and an ``offload`` entry (counters, loss scale).

        It costs what torch's own costs: the whole fp32 state, 12 bytes a parameter, read from
        the servers into this process (parameter by parameter, with no second copy). For a model
        whose state should not pass through the training process, use ``save_checkpoint``,
        which streams it to files 16 MiB at a time."""
        with self._lock:
            accumulated = None
            if _lib.lib().offload_in_step(self._live()):
                # Between two backward() calls of a step: its gradients' sum so far is saved too.
                accumulated = self._accumulated()
            else:
                # The delayed update lands first: a run that resumes from this state computes
                # with the weights this one computes with from now on.
                self._apply_pending()
            adam_step = self._adam_step
            state: Dict[int, Dict[str, torch.Tensor]] = {}
            for i, off in enumerate(self._offsets):
                n, shape = self._shapes[i].numel(), self._shapes[i]
                state[self._packed[i]] = {"step": torch.tensor(float(adam_step - self._lag[i])),
                            "exp_avg": self._read(_lib.EXP_AVG, off, n).view(shape),
                            "exp_avg_sq": self._read(_lib.EXP_AVG_SQ, off, n).view(shape),
                            "master": self._read(_lib.MASTER, off, n).view(shape)}
        scale, clean, skipped = self._scaler()
        meta = {"format": 1, "dtype": str(self.dtype), "num_params": self.num_params,
                "completed_step": self._step, "adam_step": adam_step, "loss_scale": scale,
                "clean_steps": clean, "skipped_steps": skipped}
        if accumulated is not None:
            meta["accumulated"] = accumulated
        return {"state": state, "param_groups": self._packed_groups(), "offload": meta}

    def _accumulated(self) -> Dict[str, Any]:
        """Mid-accumulation (a step open between two backward() calls): _mid_accumulation's
        record and the fp32 sum of the step's micro-batches so far (as the servers hold it)."""
        acc = self._mid_accumulation("state_dict()")
        grad_sum = torch.empty(self.num_params, dtype=torch.float32)
        try:
            check(_lib.lib().offload_read_gradient_sum(self._handle, 0, self.num_params,
                                                      _ptr(grad_sum)))
        except BaseException:
            self._abort()
            raise
        acc["grad_sum"] = grad_sum
        return acc

    def _mid_accumulation(self, what: str) -> Dict[str, Any]:
        """Saving between two backward() calls of a step: refused where a resumed run could not
        go on as this one; else every gradient handed over so far is sent, and what a resumed
        run needs besides their sum: which parameters had a gradient, how many micro-batches
        ran."""
        where = f"{what} between backward() and step()"
        if self._world > 1:
            raise RuntimeError(f"{where} with several ranks: finish the step (each rank holds "
                               "only its partition's sum)")
        if self._speculate_wanted:
            raise RuntimeError(f"{where} with update_in_backward=True: finish the step (the "
                               "servers hold the step's early updates until it commits)")
        if self._gradients_done:
            raise RuntimeError(f"{where}, after clip_grad_norm_(): finish the step")
        if self._pending_update:
            raise RuntimeError(f"{where} with a delayed update still to land: finish the step")
        if self._ring is not None:
            self._ring.flush()
        self._flush()
        return {"seen": [bool(x) for x in self._seen], "micro_batches": self._micro_batches}

    def _check_accumulated(self, acc: Any) -> None:
        """A state_dict's mid-accumulation entry, checked before anything is loaded."""
        ok = (isinstance(acc, dict) and isinstance(acc.get("grad_sum"), torch.Tensor)
              and acc["grad_sum"].dtype == torch.float32
              and tuple(acc["grad_sum"].shape) == (self.num_params,)
              and isinstance(acc.get("seen"), list) and len(acc["seen"]) == len(self._params)
              and isinstance(acc.get("micro_batches"), int) and acc["micro_batches"] >= 1)
        if not ok:
            raise ValueError("the state's mid-accumulation entry is malformed: it needs grad_sum "
                             f"(float32, ({self.num_params},)), seen ({len(self._params)} "
                             "flags) and micro_batches (>= 1)")
        if self._world > 1:
            raise ValueError("a state saved mid-accumulation resumes on one rank only")

    def _resume_accumulation(self, acc: Dict[str, Any]) -> None:
        """Opens the next step with the saved micro-batches' sum as its gradients so far: the
        next backward() adds to it, as in the run that saved it."""
        sums = torch.zeros(self._part_length, dtype=torch.float32)
        sums[:self.num_params] = acc["grad_sum"]
        with self._lock:
            self._begin_step()
            self._speculating = False
            try:
                check(_lib.lib().offload_restore_gradient_sum(self._handle, _ptr(sums)))
            except BaseException:
                self._abort()
                raise
            self._seen = [bool(x) for x in acc["seen"]]
            self._sent = [False] * len(self._params)
            # The next backward is the next micro-batch; its first gradient does not start one
            # (the library adds to the sum already).
            self._micro_batches = acc["micro_batches"] + 1

    def _scaler(self) -> Tuple[float, int, int]:
        scale = ctypes.c_float()
        clean = ctypes.c_uint32()
        skipped = ctypes.c_uint64()
        _lib.lib().offload_get_scaler(self._live(), ctypes.byref(scale), ctypes.byref(clean),
                                      ctypes.byref(skipped))
        return float(scale.value), int(clean.value), int(skipped.value)

    def _packed_groups(self, names: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        """param_groups as torch packs them: every hyper-parameter, and the parameters as their
        indices (or names)."""
        groups = []
        index = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            count = len(g["params"])
            # Names are the trained parameters' (flat order); frozen ones have no state.
            packed["params"] = (list(range(index, index + count)) if names is None else
                                [names[i] for i, k in enumerate(self._packed)
                                 if index <= k < index + count])
            index += count
            groups.append(packed)
        return groups

    def _load_with_scaler(self, scaler: Tuple[float, int, int], load: Callable[[], int],
                          what: str) -> None:
        """Sets the loss scaler (every rank), then runs `load` (rank 0's, returning an rc); puts
        the scaler back if any rank failed."""
        L = _lib.lib()
        with self._lock:
            self._live()
            # The state replaces whatever the open step, or a delayed one, would have applied
            # (a delayed commit that failed has nothing to lose).
            try:
                self._wait_commit()
            except OffloadError:
                pass
            self._pending_update = False
            self._abort()
            old = self._scaler()
            # The scaler first: it checks its values, and is put back if the shards refuse.
            check(L.offload_set_scaler(self._handle, float(scaler[0]), int(scaler[1]),
                                       int(scaler[2])))
            rc, error = 0, ""
            if self._rank == 0:
                try:
                    rc = load()
                    error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
                except Exception as e:  # noqa: BLE001 - every rank must learn of it
                    rc, error = 13, f"{type(e).__name__}: {e}"
                if rc:
                    L.offload_load_abort(self._handle)
            try:
                self._agree(rc, error, what)
            except BaseException:
                L.offload_set_scaler(self._handle, *old)
                raise

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores what state_dict() returned: the servers' state, counters and loss scale, the
        groups' lrs, and the 16-bit weights (the master weights rounded). Everything is checked
        against this optimizer's parameters first, and the values as they stream to the servers,
        which apply them only when all were accepted: a refused state changes nothing."""
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
        self._fixed_hyperparameters_match(groups)
        accumulated = meta.get("accumulated")
        if accumulated is not None:
            self._check_accumulated(accumulated)
        names = ("master", "exp_avg", "exp_avg_sq")
        tensors = (_lib.MASTER, _lib.EXP_AVG, _lib.EXP_AVG_SQ)
        state = state_dict["state"]
        for i, shape in enumerate(self._shapes):
            s = state.get(self._packed[i])
            if s is None:
                raise ValueError(f"the state has nothing for parameter {self._packed[i]}")
            for name in names:
                t = s.get(name)
                if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != torch.float32:
                    raise ValueError(
                        f"parameter {self._packed[i]}: {name} is "
                        f"{None if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}"
                        f", expected float32 of shape {tuple(shape)}: the state is of another "
                        "model")
        L = _lib.lib()
        completed, adam = int(meta["completed_step"]), int(meta["adam_step"])
        lags = []
        for i in range(len(self._params)):
            step = state[self._packed[i]].get("step", adam)
            step = int(step.item() if isinstance(step, torch.Tensor) else step)
            if not 0 <= step <= adam:
                raise ValueError(f"parameter {self._packed[i]}: step {step} is outside [0, "
                                 f"{adam}], the updates applied")
            lags.append(adam - step)

        def load() -> int:
            rc = L.offload_load_begin(self._handle, 1, completed, adam)
            for i, off in enumerate(self._offsets):
                for name, tensor in zip(names, tensors):
                    if rc:
                        return rc
                    t = state[self._packed[i]][name].detach().reshape(-1).to("cpu").contiguous()
                    rc = L.offload_load_chunk(self._handle, tensor, off, t.numel(), _ptr(t))
            return rc or L.offload_load_finish(self._handle)

        self._load_with_scaler((meta["loss_scale"], meta["clean_steps"], meta["skipped_steps"]),
                               load, "loading the state")
        self._step, self._adam_step = completed, adam
        self._lag = lags
        self.last_report = None
        self._restore_groups(groups)
        with torch.no_grad():
            lo, hi = self._host_lo, self._host_lo + self._flat16.numel()
            for i, off in enumerate(self._offsets):
                a, b = max(off, lo), min(off + self._shapes[i].numel(), hi)
                if a < b:  # rounded as the servers round
                    self._flat16[a - lo:b - lo].copy_(
                        state[self._packed[i]]["master"].reshape(-1)[a - off:b - off])
        self._weights_changed()
        if accumulated is not None:
            self._resume_accumulation(accumulated)

    # ----------------------------------------------------------------------------- checkpoints

    def _param_names(self, model: Optional[torch.nn.Module]) -> List[str]:
        """The names the state is saved under: model's names for the parameters, else the names
        the optimizer was built with (named_parameters()), else each parameter's flat index."""
        if model is not None:
            by_id = {id(p): n for n, p in model.named_parameters()}
            names = []
            for i, p in enumerate(self._params):
                if id(p) not in by_id:
                    raise ValueError(f"parameter {i} (shape {tuple(self._shapes[i])}) of this "
                                     "optimizer is not a parameter of the model given")
                names.append(by_id[id(p)])
            return names
        if self._names is not None:
            return list(self._names)
        return [f"param.{i}" for i in range(len(self._params))]

    def _named_tensors(self, names: List[str]) -> Tuple[ctypes.Array, List[Any]]:
        """The C ABI's view of the parameters by name, and what must outlive the call."""
        keep: List[Any] = []
        array = (_lib.NamedTensor * len(names))()
        for i, name in enumerate(names):
            encoded = name.encode()
            shape = (ctypes.c_int64 * max(1, len(self._shapes[i])))(*self._shapes[i])
            keep += [encoded, shape]
            array[i] = _lib.NamedTensor(encoded, self._offsets[i], len(self._shapes[i]), shape)
        return array, keep

    def save_checkpoint(self, path: Optional[str] = None, model: Optional[torch.nn.Module] = None,
                        keep: int = 2) -> str:
        """Writes the servers' fp32 state (master weights, exp_avg, exp_avg_sq), the step
        counters, the loss scale and the parameter groups as a new checkpoint under ``path``
        (``path/step-<step>/``, and ``path/latest`` names it), keeping the ``keep`` newest.

        The state streams from the servers to safetensors files 16 MiB at a time, never whole
        in this process; files are written to a staging directory, fsynced, and published with
        one rename, so a crash (kill -9 included) or a full disk mid-save leaves the previous
        checkpoint whole. Tensors are named by parameter name (``model``'s, or the names the
        optimizer was built with, else ``param.<index>``), so the checkpoint loads onto any
        number of servers and ranks. ``master.safetensors`` is the fp32 model: see
        ``offload.checkpoint.load_into_torch`` to continue with plain torch. Every rank calls
        it (rank 0 writes). Returns the checkpoint's directory. In a torch job on the pool
        ``path`` defaults to the job's checkpoint directory (``$OFFLOAD_CHECKPOINT_DIR``)."""
        path = self._checkpoint_path(path, "save_checkpoint")
        names = self._param_names(model)
        array, keep_alive = self._named_tensors(names)
        L = _lib.lib()
        record = {"optimizer": type(self).__name__, "dtype": str(self.dtype),
                  "param_groups": self._packed_groups(names)}
        with self._lock:
            # Between two backward() calls of a step, the library adds the step's gradient sum
            # so far to the files, and the record says how to go on with the step.
            mid = bool(L.offload_in_step(self._live()))
            if mid:
                record["accumulated"] = self._mid_accumulation("save_checkpoint()")
            else:
                self._apply_pending()  # the counters and lags below are then the shards'
            record["param_steps"] = {names[i]: self._adam_step - lag
                                     for i, lag in enumerate(self._lag) if lag}
            front_end = json.dumps(record)
            out = ctypes.create_string_buffer(4096 + len(path.encode()))
            rc = 0
            if self._rank == 0:
                rc = L.offload_save_checkpoint(self._handle, path.encode(), array, len(names),
                                               self._step, self._adam_step, front_end.encode(),
                                               int(keep), out, len(out))
            error = L.offload_last_error().decode("utf-8", "replace") if rc else ""
            self._agree(rc, error, "saving the checkpoint")
        del keep_alive
        directory = out.value.decode()
        if self._world > 1:
            import torch.distributed as dist
            box = [directory]
            dist.broadcast_object_list(box, src=self._src0(), group=self._group)
            directory = box[0]
        if _job.active():
            _job._checkpointed(directory, self._step)
        return directory

    def load_checkpoint(self, path: Optional[str] = None,
                        model: Optional[torch.nn.Module] = None) -> Optional[str]:
        """Restores a checkpoint written by save_checkpoint: ``path`` is its directory or the
        root that holds ``latest``. The servers' state and counters, the loss scale, the groups'
        lrs and the 16-bit weights (the master weights rounded) come back as they were saved,
        onto however many servers and ranks this run has.

        It streams 4 MiB at a time, checking each file's size and CRC-32 on the way; the servers
        apply the load only when everything matched. A checkpoint of another model (a parameter
        missing, extra, or of another shape: the first is named), a file cut short or altered
        (named), or other fixed hyper-parameters are refused, and then nothing changes. Every
        rank calls it. Returns the checkpoint's directory.

        Without ``path``, the job's checkpoint directory in a torch job on the pool, and a
        directory that holds no checkpoint yet (the first attempt), or no job, returns None with
        nothing changed, so ``opt.load_checkpoint()`` at the start of a script resumes a restarted
        attempt where the last checkpoint left it (``opt.completed_steps``)."""
        if path is None:
            path = _job.checkpoint_dir()
            if path is None:
                return None  # no job directory: nothing to resume from (a script run by hand)
            found_one = [ckpt.has_checkpoint(path) if self._rank == 0 else False]
            if self._world > 1:  # rank 0's answer: the others may not see its directory
                import torch.distributed as dist
                dist.broadcast_object_list(found_one, src=self._src0(), group=self._group)
            if not found_one[0]:
                return None
        names = self._param_names(model)
        found: List[Any] = [None, None, None]  # directory, manifest text, error
        if self._rank == 0:
            try:
                found[0], found[1] = ckpt.find_manifest(path)
            except (OSError, OffloadError) as e:
                found[2] = str(e)
        if self._world > 1:
            import torch.distributed as dist
            dist.broadcast_object_list(found, src=self._src0(), group=self._group)
        if found[2] is not None:
            raise FileNotFoundError(found[2])
        directory, manifest = found[0], ckpt.parse_manifest(found[1], found[0])
        if manifest.dtype != self.dtype:
            raise ValueError(f"checkpoint {directory} is of {manifest.dtype} weights, this "
                             f"optimizer's are {self.dtype}")
        array, keep_alive = self._named_tensors(names)
        L = _lib.lib()
        check(L.offload_check_checkpoint(directory.encode(), array, len(names)))
        self._fixed_hyperparameters_match(manifest.param_groups, names)
        lags = [manifest.adam_step - manifest.step_of(name) for name in names]
        if any(not 0 <= lag <= manifest.adam_step for lag in lags):
            raise ValueError(f"checkpoint {directory}: a parameter's step is outside [0, "
                             f"{manifest.adam_step}], the updates applied")
        accumulated = None
        if manifest.accumulated is not None:
            # Saved between two micro-batches: its gradient sum so far, read (and checked)
            # before anything is loaded.
            if self._world > 1:
                raise ValueError(f"checkpoint {directory} was saved between two micro-batches of "
                                 "a step, which resumes on one rank only")
            grad_sum = torch.empty(self.num_params, dtype=torch.float32)
            check(L.offload_read_checkpoint_gradient_sum(directory.encode(), array, len(names),
                                                         self.num_params, _ptr(grad_sum)))
            accumulated = dict(manifest.accumulated, grad_sum=grad_sum)
            self._check_accumulated(accumulated)
        self._load_with_scaler(
            manifest.loss_scale,
            lambda: L.offload_load_checkpoint(self._handle, directory.encode(), array, len(names)),
            "loading the checkpoint")
        del keep_alive
        self._step, self._adam_step = manifest.step, manifest.adam_step
        self._lag = lags
        self.last_report = None
        self._restore_groups(manifest.param_groups)
        with self._lock:
            self._weights_from_masters()
        if accumulated is not None:
            self._resume_accumulation(accumulated)
        return directory


class Adam(AdamW):
    """torch.optim.Adam (weight decay added to the gradient) on the optimizer servers."""

    _kind = _lib.ADAM

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 **kwargs: Any):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


def materialize(model: torch.nn.Module, params: Any = None, *,
                init: Optional[Callable[[torch.nn.Module], None]] = None,
                optimizer: Optional[type] = None, **kwargs: Any) -> AdamW:
    """An offload.torch optimizer for a model built on the meta device (``with
    torch.device("meta"):`` on torch 2.x, ``device="meta"`` to each module on torch 1.13),
    whose fp32 weights need not fit anywhere.

    Module by module, the parameters are allocated in fp32 on the CPU, initialized by the
    module's own ``reset_parameters()`` or ``init(module)`` (e.g. a Hugging Face model's
    ``model._init_weights``), streamed to the servers as master weights and cast into the
    optimizer's 16-bit buffer (on ``device=``, else the CPU); each module's fp32 copy is freed
    before the next. The model's meta parameters are replaced by the trained ones (tied weights
    stay tied). ``params`` is what the optimizer would take (default
    ``model.named_parameters()``: groups of the meta model's parameters work too), ``optimizer``
    the class (default AdamW), and ``kwargs`` its arguments. If an init fails, the error is
    raised and nothing is left on the servers. With ``zero_stage=3`` the model is the one whose
    modules the window hooks (``model=`` need not be given)."""
    from offload.materialize import MetaValues
    cls = optimizer or AdamW
    if kwargs.get("zero_stage") == 3:
        kwargs.setdefault("model", model)
    if params is None:
        params = list(model.named_parameters())
    device = kwargs.get("device")
    values = MetaValues(model, init, torch.device(device) if device is not None else None)
    return cls(params, _values=values, **kwargs)


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
