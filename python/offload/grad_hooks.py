"""How gradients leave the model while backward runs: the hooks, the staging ring, the reducer.

``offload.torch.AdamW`` uses three pieces, each torch-only and free of numerics (rounding and the
gradients' statistics stay in the C library):

- ``GradientHooks`` runs a callback once autograd has accumulated a parameter's gradient into
  ``p.grad``: torch 2.1+'s ``register_post_accumulate_grad_hook``, or on torch 1.13 a hook on the
  parameter's ``AccumulateGrad`` node. A parameter used twice in one forward (tied weights, a
  reused module) is summed by autograd first, so the callback sees the sum, once.
- ``StagingRing`` moves 16-bit gradients from a CUDA device to host memory without blocking: a
  side stream copies them into a few page-locked slots, and a slot's contents are handed over
  only once its copies have landed.
- ``BucketReducer`` sums gradients over ranks bucket by bucket as backward completes the
  buckets, in one launch order on every rank, and hands this rank's share on.

``HostCopies`` holds the side stream and its events; on the CPU it is a stand-in whose copies
have landed when they return, so the ring's and the reducer's bookkeeping runs (and is tested)
without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["GradientHooks", "HostCopies", "StagingRing", "BucketReducer", "POST_ACCUMULATE",
           "ACCUMULATE_GRAD_NODE", "hook_path"]

# The two ways of running after accumulation, as GradientHooks.path names them.
POST_ACCUMULATE = "post_accumulate_grad_hook"
ACCUMULATE_GRAD_NODE = "accumulate_grad_node"


def hook_path() -> str:
    """The way this torch runs a hook after a gradient is accumulated."""
    if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        return POST_ACCUMULATE
    return ACCUMULATE_GRAD_NODE


class GradientHooks:
    """Calls ``arrived(i)`` after autograd has written parameter i's gradient into ``p.grad``.

    Parameters with ``requires_grad=False`` are not hooked (``hooked`` says which are). The
    callback is held strongly: give one that holds its owner weakly. ``path`` forces one of the
    two ways (torch 2.x has both; tests run each).
    """

    def __init__(self, params: Sequence[torch.Tensor], arrived: Callable[[int], None],
                 path: Optional[str] = None) -> None:
        self.path = path or hook_path()
        if self.path not in (POST_ACCUMULATE, ACCUMULATE_GRAD_NODE):
            raise ValueError(f"no hook path {self.path!r}")
        self.hooked: List[bool] = []
        self._handles: List[Any] = []
        # torch 1.13: autograd holds a parameter's AccumulateGrad node weakly and makes a new one
        # (without our hook) once it is gone, so the nodes are kept here (as DeepSpeed's
        # grad_accs are).
        self._nodes: List[Any] = []
        for i, p in enumerate(params):
            if not p.requires_grad:
                self.hooked.append(False)
                continue
            if self.path == POST_ACCUMULATE:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(lambda _p, i=i: arrived(i)))
            else:
                with torch.enable_grad():  # no graph, no grad_fn, under no_grad
                    node = p.expand_as(p).grad_fn.next_functions[0][0]
                self._handles.append(node.register_hook(lambda *_, i=i: arrived(i)))
                self._nodes.append(node)
            self.hooked.append(True)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._nodes = []


class _Landed:
    """A stand-in event for a copy that has landed when it returned (the CPU's)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class HostCopies:
    """Copies between host and device memory ordered after the work queued so far on the
    current stream: gradients down (the ring, the reducer), ZeRO-3's weights up
    (``offload.param_window``).

    On CUDA: a side stream (``torch.cuda.Stream``), so the copies overlap the compute, and an
    event after each batch of them. On the CPU: stand-ins, a copy being done when it returns.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def pinned(self) -> bool:
        """Whether host buffers should be page-locked (what an asynchronous D2H copy needs)."""
        return self._side is not None

    def after_current(self, *tensors: torch.Tensor) -> None:
        """The coming copies wait for the current stream (the producers of ``tensors``), and the
        caching allocator keeps ``tensors``' memory until the side stream is done with it."""
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            for t in tensors:
                t.record_stream(self._side)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._side is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._side):
            dst.copy_(src, non_blocking=True)

    def on_side(self) -> Any:
        """A context in which the copies a caller issues itself run on the side stream."""
        if self._side is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._side)

    def record(self) -> Any:
        """An event that completes once every copy issued so far has landed."""
        if self._side is None:
            return _Landed()
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    def current_waits(self, event: Any) -> None:
        """The current stream's coming work waits for `event`'s copies (what record() gave)."""
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


# (flat offset, host tensor): a piece of 16-bit gradients of the flat space, ready to be read.
Piece = Tuple[int, torch.Tensor]


class StagingRing:
    """A ring of ``slots`` host buffers of ``slot_elements`` 16-bit elements each.

    ``put(offset, grad)`` queues the copy of a gradient (flat ``[offset, offset + numel)``) into
    the slot being filled, splitting it across slots where it does not fit. A full slot is
    sealed: an event is recorded after its copies. A sealed slot is handed over (``hand_over``
    with its pieces, in the order they were put) once its event has completed: when ``poll``
    finds it so, when the ring comes round to it with more to write (it then waits for the
    event), or at ``flush``. A slot is written again only after it was handed over.
    """

    def __init__(self, slots: int, slot_elements: int, dtype: torch.dtype, copies: HostCopies,
                 hand_over: Callable[[List[Piece]], None]) -> None:
        if slots < 1 or slot_elements < 1:
            raise ValueError(f"a ring of {slots} slots of {slot_elements} elements")
        self.slot_elements = int(slot_elements)
        self._copies = copies
        self._hand_over = hand_over
        self._buffers = [torch.empty(self.slot_elements, dtype=dtype, pin_memory=copies.pinned)
                         for _ in range(slots)]
        # Per slot: the pieces written into it, (flat offset, position in the slot, n).
        self._pieces: List[List[Tuple[int, int, int]]] = [[] for _ in range(slots)]
        self._events: List[Optional[Any]] = [None] * slots  # set while sealed, not handed over
        self._sealed: Deque[int] = collections.deque()  # in sealing order
        self._current = 0
        self._fill = 0

    def put(self, offset: int, grad: torch.Tensor) -> None:
        src = grad.detach().reshape(-1)
        self._copies.after_current(grad, src)
        done, n = 0, src.numel()
        while done < n:
            if self._fill == self.slot_elements:
                self._seal()
            if self._events[self._current] is not None:
                # The ring came round to a slot not yet handed over: the oldest, as slots are
                # sealed in turn. Its copies must land before it is written again.
                slot = self._sealed.popleft()
                self._events[slot].synchronize()
                self._release(slot)
            take = min(n - done, self.slot_elements - self._fill)
            self._copies.copy(self._buffers[self._current][self._fill:self._fill + take],
                              src[done:done + take])
            self._pieces[self._current].append((offset + done, self._fill, take))
            self._fill += take
            done += take
        if self._fill == self.slot_elements:
            self._seal()  # now, so that its hand-over need not wait for the next put
        self.poll()

    def poll(self) -> None:
        """Hands over the sealed slots whose copies have landed, oldest first."""
        while self._sealed and self._events[self._sealed[0]].query():
            self._release(self._sealed.popleft())

    def flush(self) -> None:
        """Seals the slot being filled, waits for every copy and hands everything over."""
        if self._fill:
            self._seal()
        while self._sealed:
            slot = self._sealed.popleft()
            self._events[slot].synchronize()
            self._release(slot)

    def reset(self) -> None:
        """Drops what was not handed over, once the copies into the slots have landed."""
        if self._fill:
            self._seal()
        while self._sealed:
            slot = self._sealed.popleft()
            self._events[slot].synchronize()
            self._events[slot] = None
            self._pieces[slot] = []

    def _seal(self) -> None:
        self._events[self._current] = self._copies.record()
        self._sealed.append(self._current)
        self._current = (self._current + 1) % len(self._buffers)
        self._fill = 0

    def _release(self, slot: int) -> None:
        buf = self._buffers[slot]
        pieces = [(off, buf[at:at + n]) for off, at, n in self._pieces[slot]]
        self._pieces[slot] = []
        self._events[slot] = None
        self._hand_over(pieces)


class BucketReducer:
    """Several ranks: the fp32 sum over ranks of each bucket, launched as backward completes it.

    ``buckets`` are ``(start, end, members)`` runs of the flat space (whole parameters, the same
    on every rank). A bucket's fp32 buffer is allocated when its first gradient arrives.
    ``all_reduce(buffer)`` starts the sum (a ``torch.distributed`` work, ``async_op=True``). The
    buckets are launched in reverse flat order, the order backward usually completes them, and
    bucket j only once every bucket before it in that order was launched (DDP's rule: every rank
    launches the same collectives in the same order, whatever order its gradients came in). Once
    a sum is done, this rank's share of it (``[lo, hi)``) is copied to host memory and handed to
    ``send(offset, host_fp32, complete)``, and the buffer is dropped: memory holds the buckets in
    flight, not every gradient. ``finish`` completes the buckets some parameter never filled with
    zeros, launches them in the same order and waits for everything; ``complete`` is False for
    those (a parameter without a gradient this step is in them).
    """

    def __init__(self, buckets: Sequence[Tuple[int, int, Sequence[int]]],
                 offsets: Sequence[int], device: torch.device, lo: int, hi: int,
                 copies: HostCopies, all_reduce: Callable[[torch.Tensor], Any],
                 send: Callable[[int, torch.Tensor, bool], None],
                 trace: Optional[Callable[[str, float], None]] = None) -> None:
        self._buckets = [(start, end) for start, end, _ in buckets]
        self._size = [len(members) for _, _, members in buckets]
        self._bucket_of: Dict[int, int] = {i: j for j, (_, _, members) in enumerate(buckets)
                                           for i in members}
        self._offsets = offsets
        self._device = device
        self._lo, self._hi = lo, hi
        self._copies = copies
        self._all_reduce = all_reduce
        self._send = send
        # trace(name, begin): a span from `begin` (time.monotonic()) to now, for the step's trace:
        # each bucket's reduction from its launch until its sum is handed on.
        self._trace = trace
        self.order = list(reversed(range(len(self._buckets))))
        self.reset()

    def reset(self) -> None:
        """Forgets the step's buckets (an in-flight sum is the process group's to finish)."""
        self._missing = list(self._size)
        self._flat: Dict[int, torch.Tensor] = {}
        self._next = 0  # the position in `order` of the next bucket to launch
        self._launched: Dict[int, float] = {}  # bucket -> when its reduction was launched
        self._zero_filled: set = set()  # buckets finish() completed with zeros
        self._reducing: Deque[Tuple[int, Any, torch.Tensor]] = collections.deque()
        # (offset, host share, event, complete)
        self._landing: Deque[Tuple[int, torch.Tensor, Any, bool]] = collections.deque()

    @property
    def buffers(self) -> int:
        """How many buckets' buffers are alive: filling, reducing or on their way out."""
        return len(self._flat) + len(self._reducing) + len(self._landing)

    def add(self, index: int, grad: torch.Tensor) -> None:
        """Parameter index's gradient of this step (each parameter at most once a step)."""
        j = self._bucket_of[index]
        flat = self._buffer(j)
        at = self._offsets[index] - self._buckets[j][0]
        flat[at:at + grad.numel()].copy_(grad.detach().reshape(-1))
        self._missing[j] -= 1
        self._launch_ready()
        self.poll()

    def poll(self) -> None:
        """Hands on the sums that are done, in launch order, without waiting."""
        while self._reducing and self._reducing[0][1].is_completed():
            self._land(*self._reducing.popleft())
        while self._landing and self._landing[0][2].query():
            offset, host, _, complete = self._landing.popleft()
            self._send(offset, host, complete)

    def finish(self) -> None:
        """Zeros for the buckets not complete, every bucket launched, and everything handed on."""
        for j in self.order[self._next:]:
            self._buffer(j)  # zeros where no gradient came
            if self._missing[j] > 0:
                self._zero_filled.add(j)
            self._missing[j] = 0
        self._launch_ready()
        while self._reducing:
            self._land(*self._reducing.popleft())
        while self._landing:
            offset, host, event, complete = self._landing.popleft()
            event.synchronize()
            self._send(offset, host, complete)

    def _buffer(self, j: int) -> torch.Tensor:
        flat = self._flat.get(j)
        if flat is None:
            start, end = self._buckets[j]
            # Zeros: the parameters that get no gradient (and the padding) add nothing.
            flat = self._flat[j] = torch.zeros(end - start, dtype=torch.float32,
                                               device=self._device)
        return flat

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._missing[self.order[self._next]] == 0:
            j = self.order[self._next]
            flat = self._buffer(j)
            del self._flat[j]
            self._launched[j] = time.monotonic()
            self._reducing.append((j, self._all_reduce(flat), flat))
            self._next += 1

    def _land(self, j: int, work: Any, flat: torch.Tensor) -> None:
        work.wait()  # its error, if any; on NCCL, the current stream waits for the sum
        if self._trace is not None:
            self._trace("all_reduce", self._launched.pop(j))
        start, end = self._buckets[j]
        a, b = max(start, self._lo), min(end, self._hi)
        if a >= b:
            return
        share = flat[a - start:b - start]
        complete = j not in self._zero_filled
        if share.device.type == "cpu":
            self._landing.append((a, share, _Landed(), complete))
            return
        host = torch.empty(b - a, dtype=torch.float32, pin_memory=self._copies.pinned)
        self._copies.after_current(flat)
        self._copies.copy(host, share)
        self._landing.append((a, host, self._copies.record(), complete))
