"""The 16-bit weights the model computes with, and their fp32 masters' way to the servers.

The parameters become views of one flat 16-bit buffer (``flat16``) on their device; their fp32
values, as the model was built, are streamed to the servers as the master weights while each is
cast, a chunk at a time, so no fp32 copy of the model is ever made. A commit writes the updated
16-bit weights of this rank's partition into a host copy (``host16``: ``flat16`` itself on the
CPU, a pinned copy for a GPU), from which they reach ``flat16`` and, over ranks, every rank.

ZeRO-3 (``zero_stage=3``): ``flat16`` is the host copy (page-locked for a GPU), of this rank's
partition only with several ranks (flat ``[host_lo, host_lo + its length)``), and the parameters
visit the device through the window (``offload.param_window``), filled from it or gathered from
every rank's partition.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from offload import native
from offload.layout import FlatLayout
from offload.native import NativeOptimizer
from offload.param_window import ParamWindow
from offload.ranks import Ranks

# Elements converted, sent or read per call when state moves in pieces (4 MiB of fp32): what the
# process holds of the state at a time.
CHUNK = 1 << 20

# materialize()'s values source: called with the parameters, it yields (index, parameter) pairs.
Values = Callable[[List[torch.nn.Parameter]], Iterable[Tuple[int, torch.nn.Parameter]]]


def move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """The model's buffers (a BatchNorm's statistics, a causal mask) to ``device``, where the
    parameters compute: the parameters are the optimizer's, placed by it, never moved."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


class Weights:
    """The flat 16-bit buffer and its host copies, for ``layout``'s parameters on ``device``."""

    def __init__(self, layout: FlatLayout, opt: NativeOptimizer, ranks: Ranks,
                 dtype: torch.dtype, zero_stage: int, delay: bool,
                 persist_elements: Optional[int]) -> None:
        self.layout, self._native, self._ranks = layout, opt, ranks
        self.dtype, self.device, self.zero_stage = dtype, layout.device, zero_stage
        self.padded_length = opt.padded_length()
        self.part_offset, self.part_length = opt.partition()
        self.window: Optional[ParamWindow] = None
        self.persistent = [persists(p, persist_elements) for p in layout.params]
        host_only = zero_stage == 3 or self.device.type == "cpu"
        partitioned = zero_stage == 3 and ranks.world > 1
        self.host_lo = self.part_offset if partitioned else 0
        self.flat16 = torch.empty(self.part_length if partitioned else self.padded_length,
                                  dtype=dtype, device="cpu" if host_only else self.device,
                                  pin_memory=zero_stage == 3 and self.device.type == "cuda")
        self.host16 = (self.flat16 if host_only else
                       torch.empty(self.padded_length, dtype=dtype,
                                   pin_memory=torch.cuda.is_available()))
        # The delayed update's weights wait here while the parameters are in use: on a GPU the
        # host copy the commits write anyway, on the CPU a second copy (2 bytes a parameter).
        self.next16 = (self.host16 if not delay or self.host16 is not self.flat16 else
                       torch.empty_like(self.host16))
        self.partitions: List[Tuple[int, int]] = []  # every rank's, for ZeRO-3's gathers
        if partitioned:
            bounds = ranks.all_objects((self.part_offset, self.part_offset + self.part_length))
            self.partitions = [tuple(b) for b in bounds]

    # ------------------------------------------------------------------------------ set-up

    def set_up(self, param_groups: List[Dict[str, Any]], values: Optional[Values]) -> None:
        """The master weights to the servers, the parameters cast, every rank the same."""
        self._set_up_trained(param_groups, values)
        self._set_up_frozen(param_groups, values)

    def same_on_every_rank(self, param_groups: List[Dict[str, Any]]) -> None:
        """The servers hold rank 0's values: every rank computes with them (as DDP does), and
        with rank 0's frozen parameters (as bytes: gloo has no bfloat16). ZeRO-3: each rank
        reads its partition of them from the servers."""
        if self._ranks.world == 1:
            return
        import torch.distributed as dist
        if self.partitions:
            self.from_masters()
        else:
            dist.broadcast(self.flat16.view(torch.int32), src=self._ranks.src0(),
                           group=self._ranks.group)
        for gi, pj in self.layout.frozen:
            self._ranks.broadcast_bytes(param_groups[gi]["params"][pj].data)

    def _set_up_trained(self, param_groups: List[Dict[str, Any]],
                        values: Optional[Values]) -> None:
        """Each parameter in turn: its fp32 values go to the servers (rank 0) as the master
        weights, in chunks, and it becomes a view of the flat 16-bit buffer, its own storage
        freed; so no fp32 copy of the model is ever made, and a model built in fp32 on the CPU
        shrinks as it is cast. `values` (materialize's) yields (index, parameter) pairs in any
        order, the parameter replacing the optimizer's own; by default each parameter is its own
        value, in flat order."""
        opt, layout = self._native, self.layout
        loading = self._ranks.rank == 0
        _, error = native.attempt(opt.load_begin) if loading else (None, None)
        self._ranks.agree(error, "starting the load of the master weights")
        try:
            where = layout.where(param_groups)
            done = [False] * len(layout)
            source = (values(list(layout.params)) if values is not None else
                      ((k, p) for k, p in enumerate(layout.params)))
            for index, p in source:
                if done[index]:
                    raise RuntimeError(f"parameter {index} was given values twice")
                if p is not layout.params[index]:
                    gi, pj = where[layout.packed[index]]
                    param_groups[gi]["params"][pj] = p
                    layout.params[index] = p
                self._take_values(index, p, loading)
                done[index] = True
            missing = [k for k, d in enumerate(done) if not d]
            if missing:
                raise RuntimeError(f"parameters {missing[:8]} got no values")
            # The padding: the servers' is zero too.
            self.flat16[max(0, layout.num_params - self.host_lo):].zero_()
            _, error = native.attempt(opt.load_finish) if loading else (None, None)
        except BaseException:
            if loading:
                opt.load_abort()
            raise
        self._ranks.agree(error, "loading the master weights")

    def _set_up_frozen(self, param_groups: List[Dict[str, Any]], values: Any) -> None:
        """The frozen parameters (requires_grad=False when the optimizer was built) are cast to
        the 16-bit type on the optimizer's device, as the trained ones are, so the model computes
        in one type; they are never sent, stepped or changed afterwards (torch's AdamW leaves a
        parameter without a gradient alone), and the servers hold nothing for them."""
        replaced = getattr(values, "replaced", {})
        with torch.no_grad():
            for gi, pj in self.layout.frozen:
                p = param_groups[gi]["params"][pj]
                p = replaced.get(id(p), p)  # materialize()'s parameter with values
                if p.is_meta:
                    raise ValueError(f"a frozen parameter (shape {tuple(p.shape)}) is on the meta "
                                     "device but no module of the model holds it")
                param_groups[gi]["params"][pj] = p
                if p.dtype != self.dtype or p.device != self.device or not p.is_contiguous():
                    p.data = p.data.to(device=self.device, dtype=self.dtype).contiguous()

    def _take_values(self, index: int, p: torch.nn.Parameter, loading: bool) -> None:
        """p's values: to the servers as fp32 (rank 0), into the flat buffer rounded to 16 bits,
        then p becomes its view there. Conversions run a chunk at a time."""
        layout = self.layout
        off, n = layout.offsets[index], p.numel()
        if p.shape != layout.shapes[index]:
            raise RuntimeError(f"parameter {index} has shape {tuple(p.shape)}, expected "
                               f"{tuple(layout.shapes[index])}")
        src = p.detach().reshape(-1)
        # ZeRO-3 over ranks: the host copies are read from the servers once they are loaded.
        dst = self.flat16[off:off + n] if not self.partitions else None
        direct = src.device.type == "cpu" and src.dtype == torch.float32 and src.is_contiguous()
        with torch.no_grad():
            for a in range(0, n, CHUNK):
                b = min(n, a + CHUNK)
                piece = src[a:b] if direct else src[a:b].to("cpu", torch.float32)
                if loading:
                    self._native.load_chunk(native.MASTER, off + a, piece)
                if dst is None:
                    pass
                elif dst.device.type == "cpu":
                    dst[a:b].copy_(piece)  # round to nearest even, as the servers round
                else:
                    dst[a:b].copy_(piece.to(self.dtype), non_blocking=False)
            p.data = self._stage3_data(index) if self.zero_stage == 3 else dst.view(
                layout.shapes[index])
            p.grad = None

    def _stage3_data(self, index: int) -> torch.Tensor:
        """ZeRO-3: what parameter index holds once its values are in the host copy. A persistent
        one: its place on the device (on the CPU with one rank, a view of the host copy, as stage
        2's; else a tensor changed() fills); a managed one: a stand-in of its shape that holds no
        memory, until the window releases it (autograd's hooks are set up on the parameter's
        shape)."""
        off, shape = self.layout.offsets[index], self.layout.shapes[index]
        if self.persistent[index]:
            if self.device.type == "cpu" and not self.partitions:
                return self.flat16[off:off + shape.numel()].view(shape)
            # Filled by changed() once the window is built.
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        return torch.empty(1, dtype=self.dtype, device=self.device).expand(shape)

    def build_window(self, model: torch.nn.Module, window: int, max_resident_bytes: int,
                     blocks: Any) -> None:
        """ZeRO-3's device window over the model, the persistent parameters filled, and the
        model's buffers moved where it computes."""
        layout = self.layout
        self.window = ParamWindow(
            model, layout.params, self.persistent, self._fill_from_host, self.device, self.dtype,
            window, max_resident_bytes, blocks,
            persistent_bytes=sum(s.numel() for s, keep in zip(layout.shapes, self.persistent)
                                 if keep) * self.flat16.element_size())
        self.changed()
        # A model built on the host is not moved to where it computes whole: its buffers are.
        move_buffers(model, self.device)

    # ------------------------------------------------------------------------------ in use

    def check_param(self, index: int) -> None:
        """Refuses a parameter that changed since the optimizer was built: another dtype or
        shape, or (stage 2) no longer a view of the flat buffer."""
        layout = self.layout
        p, off, shape = layout.params[index], layout.offsets[index], layout.shapes[index]
        if self.window is not None:
            if p.dtype != self.dtype or (p.shape != shape and p.numel() != 0):
                raise RuntimeError(
                    f"parameter {index} (shape {tuple(shape)}) changed after the "
                    f"optimizer was built: it is now {p.dtype} of shape {tuple(p.shape)}; build "
                    "a new optimizer for a changed model")
            return
        if (p.dtype != self.dtype or p.shape != shape or
                p.data_ptr() != self.flat16.data_ptr() + 2 * off):
            raise RuntimeError(
                f"parameter {index} (shape {tuple(shape)}) changed after the "
                f"optimizer was built: it is now {p.dtype} of shape {tuple(p.shape)}"
                + ("" if p.data_ptr() == self.flat16.data_ptr() + 2 * off else
                   " and no longer a view of the optimizer's 16-bit buffer")
                + "; build a new optimizer for a changed model")

    def host_ptr(self, t: torch.Tensor) -> ctypes.c_void_p:
        """The library's (padded_length,) view of a host copy: where flat offset 0 would be
        (ZeRO-3 over ranks holds only the partition, the only part the library writes)."""
        return ctypes.c_void_p(t.data_ptr() - t.element_size() * self.host_lo)

    def gathered(self) -> Any:
        """ZeRO-3: every parameter on the device while the context lasts; stage 2: nothing."""
        if self.window is None:
            return contextlib.nullcontext()
        return self.window.gather()

    def _fill_from_host(self, indices: List[int], tensors: List[torch.Tensor]) -> None:
        """The window's fetch: the parameters' 16-bit values from the host copy, or from every
        rank's partition of it."""
        if self.partitions:
            self._gather_params(indices, tensors)
            return
        for i, t in zip(indices, tensors):
            off = self.layout.offsets[i]
            t.copy_(self.flat16[off:off + t.numel()].view(t.shape), non_blocking=True)

    def _gather_params(self, indices: List[int], tensors: List[torch.Tensor]) -> None:
        """ZeRO-3 over ranks: the parameters' values from the ranks that hold them, in one
        all_gather of the pieces each rank's partition has (as bytes: gloo has no bfloat16).
        Every rank gathers the same parameters in the same order."""
        import torch.distributed as dist
        layout = self.layout
        spans: List[List[Tuple[int, int, int, int]]] = []  # per rank: (k, start in k, n, flat)
        for lo, hi in self.partitions:
            pieces = []
            for k, i in enumerate(indices):
                off, n = layout.offsets[i], layout.numel(i)
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    pieces.append((k, a - off, b - a, a))
            spans.append(pieces)
        width = max(1, max(sum(n for _, _, n, _ in pieces) for pieces in spans))
        where = self.device if self._ranks.backend() == "nccl" else torch.device("cpu")
        mine = torch.zeros(width, dtype=self.dtype, device=where)
        pos = 0
        for _, _, n, a in spans[self._ranks.rank]:
            mine[pos:pos + n].copy_(self.flat16[a - self.host_lo:a - self.host_lo + n])
            pos += n
        out = [torch.empty(width, dtype=self.dtype, device=where) for _ in spans]
        dist.all_gather([o.view(torch.uint8) for o in out], mine.view(torch.uint8),
                        group=self._ranks.group)
        for r, pieces in enumerate(spans):
            pos = 0
            for k, start, n, _ in pieces:
                tensors[k].view(-1)[start:start + n].copy_(out[r][pos:pos + n], non_blocking=True)
                pos += n

    def changed(self) -> None:
        """ZeRO-3, after the host copy changed (a step, a load): the persistent parameters that
        are not views of it (on a GPU, or with several ranks) take the new values; copies on the
        device are stale."""
        if self.window is None:
            return
        keep = [i for i, k in enumerate(self.persistent) if k]
        if keep and (self.device.type != "cpu" or self.partitions):
            with torch.no_grad():
                self._fill_from_host(keep, [self.layout.params[i].data for i in keep])
        self.window.invalidate()

    # ------------------------------------------------------------------------------ new values

    def gather(self, src: torch.Tensor) -> None:
        """After a commit: this rank's partition is in src; every rank's, in the parameters."""
        if src is not self.flat16:
            lo, n = self.part_offset - self.host_lo, self.part_length
            self.flat16[lo:lo + n].copy_(src[lo:lo + n])
        if self._ranks.world > 1 and not self.partitions:
            import torch.distributed as dist
            # As int32 pairs: gloo has neither bfloat16 nor int16, and a copy keeps the bits
            # (partitions are whole 64-element blocks, so the pairs never straddle two).
            flat = self.flat16.view(torch.int32)
            parts = list(flat.chunk(self._ranks.world))
            mine = parts[self._ranks.rank].clone()
            dist.all_gather(parts, mine, group=self._ranks.group)
        self.changed()

    def from_masters(self) -> None:
        """The 16-bit weights := the servers' master weights rounded (each rank reads its
        partition, then the ranks gather), a chunk at a time."""
        lo, n = self.part_offset, self.part_length
        for a in range(lo, lo + n, CHUNK):
            m = min(CHUNK, lo + n - a)
            self._native.read_weights16(a, self.host16[a - self.host_lo:a - self.host_lo + m])
        self.gather(self.host16)

    def from_state(self, masters: List[torch.Tensor]) -> None:
        """The 16-bit weights := fp32 master weights given per parameter, rounded as the servers
        round (this rank's part of the host copy)."""
        layout = self.layout
        with torch.no_grad():
            lo, hi = self.host_lo, self.host_lo + self.flat16.numel()
            for i, off in enumerate(layout.offsets):
                a, b = max(off, lo), min(off + layout.numel(i), hi)
                if a < b:
                    self.flat16[a - lo:b - lo].copy_(masters[i].reshape(-1)[a - off:b - off])
        self.changed()


def persists(p: torch.nn.Parameter, persist_elements: Optional[int]) -> bool:
    """Whether ZeRO-3 keeps p on the device all the time: by default the small 1-D ones (norms,
    biases), else those of at most persist_elements elements."""
    if persist_elements is None:
        return p.dim() <= 1 and p.numel() <= 1 << 16
    return p.numel() <= persist_elements
