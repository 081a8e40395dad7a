"""The gradient path: from autograd's hooks to the library's sender, step by step.

While backward runs, each parameter's hook (``grad_hooks.GradientHooks``) hands its accumulated
16-bit gradient to ``GradientPath.on_gradient``, which opens the step on its first gradient and
puts the gradient on its way: one rank on the CPU copies it straight to where the library says
(``offload_gradient_buffer``) and hands full buckets to the sender thread; a GPU's goes through
the staging ring; several ranks sum each bucket over the ranks first (the bucket reducer), and
this rank's share leaves as fp32 for the library to round. ``p.grad`` is freed unless keep_grads.

A second gradient of a parameter in one step starts the next micro-batch (gradient
accumulation: the servers sum them in fp32). Before the commit every element of the partition
must have left exactly once: parameters without a gradient, and the padding, leave as zeros.

The update during backward (``update_in_backward``): the step speculates on its commit (the
groups' lrs, every parameter updated, nothing skipped or clipped), and each run of gradients
handed over is offered for an early update; after a step that had to be undone it pauses.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from offload.commits import Commits
from offload.grad_hooks import BucketReducer, GradientHooks, HostCopies, Piece, StagingRing
from offload.layout import FlatLayout
from offload.native import NativeOptimizer, OffloadStepReport
from offload.ranks import Ranks
from offload.weights import Weights


def _host_view(address: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """(n,) CPU tensor over memory the library owns (no copy)."""
    buf = (ctypes.c_uint8 * (n * 2)).from_address(address)
    return torch.frombuffer(buf, dtype=dtype, count=n)


class GradientPath:
    """One optimizer's gradients, from the hooks to the library, and the open step's record of
    them. ``lock`` is the optimizer's: autograd's threads and the step share it."""

    def __init__(self, opt: NativeOptimizer, layout: FlatLayout, ranks: Ranks, weights: Weights,
                 commits: Commits, param_groups: List[Dict[str, Any]], lock: threading.RLock,
                 bucket_elements: int, keep_grads: bool, update_in_backward: bool,
                 hook_path: Optional[str], stage_on_cpu: bool, staging_slots: int) -> None:
        self._native, self._layout, self._ranks = opt, layout, ranks
        self._weights, self._commits, self._param_groups = weights, commits, param_groups
        self._lock = lock
        self.bucket_elements = bucket_elements
        self.keep_grads = bool(keep_grads)
        n = len(layout)
        self.sent = [False] * n  # in the current micro-batch
        self.seen = [False] * n  # in any micro-batch of the step
        self.unused: List[int] = []  # of the step being decided (global_stats)
        self.done = False  # every gradient of the step on its way
        self._pending: List[Tuple[int, int, int]] = []  # (offset, n, where)
        self._pending_elements = 0
        # The update during backward: wanted, on in the open step, micro-batches of the open
        # and of the last step, and the pause after undone speculation (steps left, undos in
        # a row).
        self.speculate_wanted = bool(update_in_backward)
        self.speculating = False
        self.micro_batches = 0
        self.last_micro_batches = 1
        self._speculation_pause = 0
        self._speculation_misses = 0
        # Weak references: the model's parameters must not keep the optimizer (its job, its
        # server) alive, and a collected or closed optimizer's hooks do nothing; nor should the
        # ring and the reducer keep this path (a cycle would keep it until the collector runs).
        ref = weakref.ref(self)
        self.ring: Optional[StagingRing] = None
        self.reducer: Optional[BucketReducer] = None
        copies = HostCopies(weights.device)
        if ranks.world > 1:
            lo = weights.part_offset
            self.reducer = BucketReducer(
                layout.buckets(bucket_elements, weights.padded_length), layout.offsets,
                weights.device, lo, lo + weights.part_length, copies,
                lambda flat: ref()._all_reduce(flat),
                lambda offset, grads, complete: ref()._send_share(offset, grads, complete),
                lambda name, begin: ref()._commits.trace(name, begin))
        elif weights.device.type == "cuda" or stage_on_cpu:
            self.ring = StagingRing(staging_slots,
                                    min(bucket_elements, weights.padded_length), weights.dtype,
                                    copies, lambda pieces: ref()._hand_over(pieces))

        def arrived(index: int) -> None:
            path = ref()
            if path is not None and path._native.handle:
                path.on_gradient(index)
        self.hooks = GradientHooks(layout.params, arrived, hook_path)

    def remove(self) -> None:
        self.hooks.remove()

    # ------------------------------------------------------------------------------ the step

    def begin_step(self) -> None:
        """Opens the step on the library unless it is open."""
        if not self._native.in_step():
            # The delayed commit must be done on the servers before this step opens there; its
            # update waits for step() (the parameters must not change under backward).
            self._commits.wait()
            self._native.begin_step(self._commits.step + 1)
            self.micro_batches = 1
            if self._speculation_due():
                self._speculate()

    def _speculation_due(self) -> bool:
        """Whether the step opening now updates during backward."""
        if not self.speculate_wanted or self.last_micro_batches != 1:
            return False
        if self._speculation_pause > 0:
            self._speculation_pause -= 1
            return False
        return True

    def _speculate(self) -> None:
        """The commit this step will most likely make: every parameter gets its gradient (each
        its own t), the groups' lrs as they are now, nothing skipped or clipped."""
        self._native.speculate(self._layout.lrs(self._param_groups),
                               self._commits.range_step_runs([]))
        self.speculating = True

    def after_step(self, report: OffloadStepReport) -> None:
        """Speculation that had to be undone cost its copies for nothing: it pauses longer each
        time it happens again."""
        self.last_micro_batches = self.micro_batches
        if report.early_rolled_back:
            self._speculation_misses += 1
            self._speculation_pause = min(2 ** self._speculation_misses - 1, 63)
        elif report.early_updated:
            self._speculation_misses = 0

    def on_gradient(self, index: int) -> None:
        """Parameter index's gradient is in p.grad, accumulated over every use of p in the
        graph: on its way, then freed (unless keep_grads)."""
        layout, window = self._layout, self._weights.window
        p = layout.params[index]
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError(f"parameter {index} got a sparse gradient: offload.torch optimizers "
                               "take dense gradients only")
        if grad.shape != layout.shapes[index]:
            raise RuntimeError(
                f"parameter {index} (shape {tuple(layout.shapes[index])}) got a gradient of shape "
                f"{tuple(grad.shape)}"
                + ("; with zero_stage=3 a parameter is empty outside the forward of the block "
                   "that holds it: was it used elsewhere? (blocks= can name a module that holds "
                   "both the parameter and its use)" if window is not None else ""))
        with self._lock:
            self._weights.check_param(index)
            self.begin_step()
            if self.sent[index]:
                self._next_micro_batch(index)
            self.sent[index] = True
            self.seen[index] = True
            off = layout.offsets[index]
            if self.reducer is not None:
                self.reducer.add(index, grad)
            elif self.ring is not None:
                self.ring.put(off, grad)
            else:
                self._place(off, grad.numel()).copy_(grad.detach().reshape(-1))
                self._pending_elements += grad.numel()
                if self._pending_elements >= self.bucket_elements:
                    self.flush()
            if not self.keep_grads:
                p.grad = None
            if window is not None:
                window.arrived(index)

    def _next_micro_batch(self, index: int) -> None:
        """Parameter index has a gradient again: another backward() of the same step began (a
        parameter's hook runs once per backward). Everything of the micro-batch before leaves
        first; the library then adds what follows to it (the servers sum in fp32)."""
        if self.keep_grads:
            self.abort()
            raise RuntimeError(
                f"parameter {index} got a second gradient before step(): with keep_grads=True, "
                "torch accumulates p.grad in 16 bits, which the servers cannot undo; accumulate "
                "gradients over several backward() calls with keep_grads=False (the servers sum "
                "the micro-batches in fp32)")
        try:
            if self.reducer is not None:
                self.reducer.finish()
                self.reducer.reset()
            elif self.ring is not None:
                self.ring.flush()
            self.flush()
            self.speculating = False  # the library and the servers undo what it updated
            self.micro_batches += 1
            self._native.next_micro_batch()
        except BaseException:
            self.abort()  # the step ends, nothing applied: zero_grad() and retry
            raise
        self.sent = [False] * len(self._layout)

    # ------------------------------------------------------------------------------ to the library

    def _hand_over(self, pieces: List[Piece]) -> None:
        """A staging slot whose copies have landed: into the library's place, then ready."""
        for off, src in pieces:
            self._place(off, src.numel()).copy_(src)
        self.flush()

    def _place(self, off: int, n: int) -> torch.Tensor:
        """(n,) host view of where flat [off, off + n)'s 16-bit gradients go (the shared-memory
        segment, or the library's buffer), queued for the next flush."""
        where = self._native.gradient_buffer(off, n)
        self._pending.append((off, n, where))
        return _host_view(where, n, self._weights.dtype)

    def _all_reduce(self, flat: torch.Tensor) -> Any:
        import torch.distributed as dist
        return dist.all_reduce(flat, group=self._ranks.group, async_op=True)

    def _send_share(self, offset: int, grads: torch.Tensor, complete: bool) -> None:
        """This rank's share of a bucket's fp32 sum over the ranks (host memory): the library
        takes the mean and rounds it to 16 bits in one pass. complete: every parameter of the
        bucket had its gradient (not zeros of finish()), so it may be updated early."""
        self._native.send_gradients_f32(offset, grads, 1.0 / self._ranks.world)
        if self.speculating and complete:
            self._native.update_ready(offset, grads.numel())

    def flush(self) -> None:
        """Hands the pending gradients to the sender, contiguous runs merged."""
        runs: List[List[int]] = []
        for off, n, where in sorted(self._pending):
            # One run only where the pieces are neighbours in the flat space and in memory (one
            # shard's segment, or the library's buffer).
            if runs and runs[-1][0] + runs[-1][1] == off and runs[-1][2] + 2 * runs[-1][1] == where:
                runs[-1][1] += n
            else:
                runs.append([off, n, where])
        for off, n, where in runs:
            self._native.gradients_ready(off, n, where)
            if self.speculating:
                self._native.update_ready(off, n)
        self._pending = []
        self._pending_elements = 0

    def flush_all(self) -> None:
        """Every gradient handed over so far on its way (the ring's too)."""
        if self.ring is not None:
            self.ring.flush()
        self.flush()

    def _fill_missing(self) -> None:
        """Zeros for parameters backward gave no gradient this step, and for the padding."""
        layout, padded = self._layout, self._weights.padded_length
        missing = [(layout.offsets[i], layout.numel(i))
                   for i, seen in enumerate(self.seen) if not seen]
        if padded > layout.num_params:
            missing.append((layout.num_params, padded - layout.num_params))
        for off, n in missing:
            self._place(off, n).zero_()
        for i in range(len(self.sent)):
            self.sent[i] = True
        self.flush()

    def finish(self) -> None:
        """Every gradient of this rank's partition on its way (once per step)."""
        if self.done:
            return
        unfrozen = self.frozen_with_grad()
        if unfrozen is not None:
            gi, p = unfrozen
            raise RuntimeError(
                f"a parameter of group {gi} (shape {tuple(p.shape)}) was frozen "
                "(requires_grad=False) when the optimizer was built and has a gradient now: "
                "the servers hold no state for it and the job's parameters are fixed. "
                "Build a new optimizer after unfreezing, or set its .grad to None to keep "
                "it frozen")
        if self.reducer is not None:
            # The buckets finish() fills with zeros say so (complete=False): they update at
            # the commit.
            self.reducer.finish()
            self.speculating = False
            self.sent = [True] * len(self._layout)
        else:
            if self.ring is not None:
                self.ring.flush()
            self.flush()  # backward's last bucket: still updated early, before the commit
            self.speculating = False  # the zeros of _fill_missing update at the commit
            self._fill_missing()
        self.done = True

    def frozen_with_grad(self) -> Optional[Tuple[int, torch.nn.Parameter]]:
        """(group, parameter) of the first frozen parameter that has a gradient (unfrozen
        since the optimizer was built), or None."""
        for gi, pj in self._layout.frozen:
            p = self._param_groups[gi]["params"][pj]
            if p.grad is not None:
                return gi, p
        return None

    def abort(self) -> None:
        """Ends the open step, nothing applied, and forgets its gradients."""
        self._native.abort_step()
        n = len(self._layout)
        self.done = False
        self.speculating = False
        self.sent = [False] * n
        self.seen = [False] * n
        self._pending = []
        self._pending_elements = 0
        if self.ring is not None:
            self.ring.reset()
        if self.reducer is not None:
            self.reducer.reset()

    # ------------------------------------------------------------------------------ the decision

    def _global_stats(self) -> Optional[ctypes.Array]:
        """The statistics summed over the ranks (None with one rank), and in unused the
        parameters no rank had a gradient for (torch skips those): one all-reduce for both."""
        if self._ranks.world == 1:
            self.unused = [i for i, seen in enumerate(self.seen) if not seen]
            return None
        local = self._native.local_stats()
        import torch.distributed as dist
        # On the parameters' device: NCCL reduces device tensors only.
        device = self._weights.device if self._ranks.backend() == "nccl" else "cpu"
        t = torch.tensor([local[0], local[1]] + [float(s) for s in self.seen],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self._ranks.group)
        summed = t.cpu().tolist()
        self.unused = [i for i, seen in enumerate(summed[2:]) if seen == 0]
        return (ctypes.c_double * 2)(summed[0], summed[1])

    def out(self) -> Optional[ctypes.Array]:
        """Every gradient of the step on its way, and the statistics to decide it by (summed
        over the ranks; None with one rank). Any failure ends the step, nothing applied."""
        try:
            for i in range(len(self._layout)):
                self._weights.check_param(i)
            self.begin_step()
            self.finish()
            return self._global_stats()
        except BaseException:
            self.abort()
            raise

    def resume(self, seen: List[bool], micro_batches: int) -> None:
        """The open step continues a saved one's micro-batches: which parameters had a gradient,
        and the next backward is the next micro-batch (the library adds to the sum already)."""
        self.seen = list(seen)
        self.sent = [False] * len(self._layout)
        self.micro_batches = micro_batches + 1
