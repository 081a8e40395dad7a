"""ZeRO-3 for a PyTorch model: the 16-bit weights live in host memory and visit the device in
a window of blocks (what ``offload.torch.AdamW(..., zero_stage=3)`` runs).

Every trained parameter is *managed*: between uses its ``.data`` is a 0-element placeholder of
its dtype on its device, and its values live in the optimizer's host copy (the commits write
there). A few kinds of parameter stay on the device all the time, the *persistent* set: those of
at most ``persist_elements`` elements (norms, biases; DeepSpeed's param_persistence_threshold)
and the frozen ones.

The model is cut into *units*, each fetched as a whole:

- blocks: the modules ``blocks`` names, by default the children of the model's nn.ModuleList and
  nn.Sequential containers (a GPT's layers, a ResNet's residual blocks, a ViT's encoder layers),
  outermost only. A block's unit is its whole subtree, so a block whose forward reads a
  submodule's weights without calling it (nn.MultiheadAttention's out_proj) works.
- the root set: every other managed parameter, one unit per module that holds it. The model's
  forward may use them anywhere (a tied head read as ``self.wte.weight``, a class token), so all
  of them are on the device for the whole of each forward.

Cutting the model and moving units to the device and back (``Residency``: fetch, release, the
window's room) are ``offload.param_units``'; this module decides when, from the model's hooks.

Forward: the root's pre-hook fetches the root set; each block's pre-hook fetches its unit (or
waits for its prefetch) and prefetches the next blocks in the order the last forward ran them,
as far as ``window`` blocks (and ``max_resident_bytes``) allow; its post-hook releases it. A
forward that runs another order (data-dependent control flow) only wastes its prefetches: every
unit is fetched where it is used.

Backward reads a weight only through autograd's saved tensors. During the model's forward a
``saved_tensors_hooks`` pair replaces each saved view of a managed parameter (the weight itself,
``weight.t()``, ...) by (parameter, size, stride, offset), so the saved graph holds no weight
memory; unpacking fetches the parameter's unit if it is not on the device and rebuilds the view
(then prefetches the blocks before it in forward order). A unit stays until each of its
parameters' gradients has been accumulated (autograd's AccumulateGrad needs the parameter's
shape), then it is released; a tensor hook before each accumulation fetches the parameter if
nothing did. At the end of backward everything not persistent is released.

No module backward hooks: full backward hooks break on in-place ops after a hooked module (a
ResNet's ReLU(inplace=True) after its BatchNorm) and on outputs that are not tensors, and the
saved tensors are exactly what backward needs, on torch 1.13 and 2.x alike.

``resident_bytes`` counts the storages this window materialized that are still alive (weak
references to the storages: a view something else keeps is counted), plus the persistent set;
``peak_resident_bytes`` is its high-water mark, on the CPU what the device would hold.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.grad_hooks import HostCopies
from offload.param_units import (BlockSpec, Fill, Residency, Unit, cut_units, default_blocks,
                                 storage_of)

__all__ = ["ParamWindow", "Unit", "default_blocks"]


class ParamWindow:
    """The device window of a model's managed parameters; see the module's docstring.

    params: the optimizer's trained parameters (flat order); ``persistent[i]`` keeps parameter i
    on the device all the time (its ``.data`` as the caller set it). fill: what fetches values.
    """

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                 persistent: Sequence[bool], fill: Fill, device: torch.device,
                 dtype: torch.dtype, window: int, max_resident_bytes: int = 0,
                 blocks: BlockSpec = None, persistent_bytes: int = 0) -> None:
        if window < 1:
            raise ValueError(f"window is {window}: at least one block must fit on the device")
        if max_resident_bytes < 0:
            raise ValueError(f"max_resident_bytes is {max_resident_bytes}")
        self.model = model
        self.params = list(params)
        self.window = int(window)
        self.max_resident_bytes = int(max_resident_bytes)
        self.device = device
        self.dtype = dtype
        self._lock = threading.RLock()
        self._thread: Optional[int] = None  # the thread running the model's forward
        self._shapes = [p.shape for p in self.params]
        self._managed = [not keep for keep in persistent]
        self._units, self._owner = cut_units(model, self.params, self._shapes, self._managed,
                                             torch.empty(0, dtype=dtype).element_size(), blocks)
        self.blocks = [u for u in self._units if u.block]
        self.root_set = [u for u in self._units if not u.block]
        largest = max((u.nbytes for u in self.blocks), default=0)
        root = self.root_set_bytes
        if self.max_resident_bytes and largest + root > self.max_resident_bytes:
            big = max(self.blocks, key=lambda u: u.nbytes) if self.blocks else None
            raise ValueError(
                f"max_resident_bytes={self.max_resident_bytes} cannot hold the root set "
                f"({root} bytes: parameters outside the blocks, on the device for the whole "
                f"forward) and the largest block"
                + (f" ({big.name}, {big.nbytes} bytes)" if big else "")
                + ": raise it, or cut the model into smaller blocks (blocks=)")
        self._res = Residency(self.params, self._shapes, self._units, fill, HostCopies(device),
                              device, dtype, self.window, self.max_resident_bytes,
                              persistent_bytes)
        # Per managed parameter, its gradient's arrival in this backward.
        self._arrived = [False] * len(self.params)
        # The forward order of the blocks, as the last forward ran them (unit indices), and this
        # forward's so far.
        self._order: List[int] = []
        self._position: Dict[int, int] = {}  # block -> where _order first runs it
        self._recording: List[int] = []
        self._forward_depth = 0
        self._saved_hooks: List[Any] = []
        self._in_backward = False
        self._handles: List[Any] = []
        self._closed = False
        self._hook()

    @property
    def root_set_bytes(self) -> int:
        """Bytes of the parameters outside the blocks: on the device for the whole forward."""
        return sum(u.nbytes for u in self.root_set)

    # What the device holds (Residency's counts).
    @property
    def persistent_bytes(self) -> int:
        return self._res.persistent_bytes

    @property
    def peak_resident_bytes(self) -> int:
        return self._res.peak_resident_bytes

    @property
    def fetches(self) -> int:
        """Unit fetches, prefetches included."""
        return self._res.fetches

    @property
    def refetches(self) -> int:
        """Fetches of a unit already fetched once in the same pass."""
        return self._res.refetches

    def resident_bytes(self) -> int:
        """Bytes of parameter storage on the device: the window's live tensors (those the
        parameters hold, and any a saved view keeps) and the persistent set."""
        return self._res.resident_bytes()

    def reset_peak(self) -> None:
        self._res.reset_peak()

    # ------------------------------------------------------------------------------ hooks

    def _hook(self) -> None:
        """Forward hooks on the root and on each block, saved-tensor hooks during the model's
        forward, and a hook before each managed parameter's gradient is accumulated. The hooks
        hold the window weakly: the model must not keep a closed optimizer's window alive."""
        model = self.model
        ref = weakref.ref(self)

        def call(method: str, *args: Any) -> None:
            w = ref()
            if w is not None and not w._closed:
                getattr(w, method)(*args)
        self._handles.append(model.register_forward_pre_hook(lambda m, a: call("_root_enter")))
        post = lambda m, a, out: call("_root_leave")  # noqa: E731
        try:  # torch 2.1+: also when the forward raises, so the saved-tensor hooks come off
            self._handles.append(model.register_forward_hook(post, always_call=True))
            self._leave_always = True
        except TypeError:
            self._handles.append(model.register_forward_hook(post))
            self._leave_always = False
        for u, unit in enumerate(self._units):
            if not unit.block:
                continue
            self._handles.append(unit.module.register_forward_pre_hook(
                lambda m, a, u=u: call("_enter", u)))
            leave = lambda m, a, out, u=u: call("_leave", u)  # noqa: E731
            # always_call: a recomputation for backward (non-reentrant activation
            # checkpointing) stops inside the block by raising once it has what it needs.
            self._handles.append(unit.module.register_forward_hook(leave, always_call=True)
                                 if self._leave_always else
                                 unit.module.register_forward_hook(leave))
        for i, p in enumerate(self.params):
            if self._managed[i]:
                self._handles.append(p.register_hook(
                    lambda g, i=i: call("_before_accumulate", i)))

    def remove(self) -> None:
        """Takes the hooks off (the optimizer's close()); saved-tensor hooks a failed forward
        left pushed on torch < 2.1 pass every tensor through from now on."""
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------------------ forward

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._forward_depth and self._thread != me:
            raise RuntimeError(
                "zero_stage=3: the model's forward runs in two threads at once; its "
                "parameters visit the device one block at a time for one forward: run one "
                "forward at a time (a lock around the model's call)")
        self._thread = me

    def _root_enter(self) -> None:
        with self._lock:
            if (self._forward_depth and not self._leave_always
                    and self._thread == threading.get_ident()):
                # torch < 2.1 runs no forward hook after a forward that raised: the last forward
                # of this thread never ended. Its blocks come off; its saved-tensor hooks stay
                # pushed (only the top of that stack may be popped) and pass tensors through.
                self._forward_depth = 0
                self._saved_hooks = []
                for unit in self._units:
                    unit.active = 0
                self.release_all()
            self._check_thread()
            self._forward_depth += 1
            if self._forward_depth > 1:
                return
            self._in_backward = False
            self._res.fetched_this_pass = set()
            self._recording = []
            for u, unit in enumerate(self._units):
                if not unit.block:
                    self._res.fetch(u)
                    unit.active += 1
            if torch.is_grad_enabled():
                hooks = _SavedParamHooks(self)
                torch._C._autograd._push_saved_tensors_default_hooks(hooks.pack, hooks.unpack)
                self._saved_hooks.append(hooks)
            if self._order:
                self._prefetch_after(-1)

    def _root_leave(self) -> None:
        with self._lock:
            if self._forward_depth == 0 or self._thread != threading.get_ident():
                return  # a forward refused at its start (another thread's runs)
            self._forward_depth -= 1
            if self._forward_depth:
                return
            self._explain(sys.exc_info()[1])
            if self._saved_hooks:
                self._saved_hooks.pop()
                torch._C._autograd._pop_saved_tensors_default_hooks()
            for u, unit in enumerate(self._units):
                if not unit.block:
                    unit.active = max(0, unit.active - 1)
                    self._res.release(u)
            for u in list(self._res.prefetched):
                self._res.release(u)
            self._order = self._recording
            self._position = {}
            for k, v in enumerate(self._order):
                self._position.setdefault(v, k)
            self._recording = []

    def _explain(self, error: Optional[BaseException]) -> None:
        """The model's forward raised (torch 2.1+ runs this hook then): a parameter used
        outside the forward of the block that holds it is empty there, and torch's error names
        neither, so a note does."""
        if (not isinstance(error, RuntimeError) or not hasattr(error, "add_note")
                or getattr(error, "_offload_explained", False)):
            return
        error._offload_explained = True  # type: ignore[attr-defined]
        error.add_note(
            "offload.torch zero_stage=3: outside its block's forward a parameter of a block ("
            + ", ".join(u.name for u in self.blocks[:4]) + (", ..." if len(self.blocks) > 4
                                                            else "")
            + ") is empty (0 elements). If this error is about a tensor of 0 elements, the "
            "model used such a parameter elsewhere: pass blocks= with a module that holds both "
            "the parameter and its use, or use it inside opt.gathered()")

    def _enter(self, u: int) -> None:
        with self._lock:
            if self._forward_depth:
                self._check_thread()
            unit = self._units[u]
            if not unit.resident:
                self._res.make_room(u)
                if self.max_resident_bytes and not self._res.room(unit, extra_blocks=0):
                    raise RuntimeError(
                        f"zero_stage=3: block {unit.name} ({unit.nbytes} bytes) does not fit "
                        f"max_resident_bytes={self.max_resident_bytes} beside the blocks running "
                        "around it: raise the limit or cut the model into smaller blocks")
                self._res.fetch(u)
            else:
                self._res.use(u)
            unit.active += 1
            if self._forward_depth:
                self._recording.append(u)
                self._prefetch_after(len(self._recording) - 1)

    def _leave(self, u: int) -> None:
        with self._lock:
            unit = self._units[u]
            unit.active = max(0, unit.active - 1)
            if not unit.active:
                self._res.release(u)

    def _prefetch_after(self, position: int) -> None:
        """Fetches ahead the blocks the recorded order runs after `position` (this forward's
        count of blocks entered so far, less one), while they fit."""
        self._res.prefetch(self._order[position + 1:], held=False)

    # ------------------------------------------------------------------------------ backward

    def _pack(self, t: torch.Tensor) -> Any:
        """A saved tensor: a view of a managed parameter's storage becomes its recipe; None for
        any other tensor."""
        if (t.numel() == 0 or t.device != self.device or t.dtype != self.dtype
                or not self._forward_depth or self._thread != threading.get_ident()):
            return None
        i = self._res.by_storage.get(storage_of(t).data_ptr())
        if i is None:
            return None
        d = self.params[i].data
        return _Recipe(i, t.size(), t.stride(), t.storage_offset() - d.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Recipe):
            return saved
        with self._lock:
            self._backward_begins()
            self._need(saved.param)
            d = self.params[saved.param].data
            with torch.no_grad():
                return d.as_strided(saved.size, saved.stride, d.storage_offset() + saved.offset)

    def _backward_begins(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._res.fetched_this_pass = set()
        self._arrived = [False] * len(self.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _need(self, i: int) -> None:
        """Parameter i on the device now (backward): its unit fetched and held until its
        gradients arrive; the blocks before it in forward order prefetched."""
        u = self._owner[i]
        unit = self._units[u]
        # The blocks before it are prefetched once, when it is fetched or its prefetch is first
        # used, not at each of its saved tensors.
        first = not self._res.resident(i) or u in self._res.prefetched
        if not self._res.resident(i):
            if unit.block:
                self._res.make_room(u)
            self._res.fetch(u)
        else:
            self._res.use(u)
            for v in self._res.holders[i]:
                self._res.use(v)
        if not unit.held and not all(self._arrived[j] for j in unit.params):
            unit.held = True
        if first and u in self._position:
            self._prefetch_before(self._position[u])

    def _prefetch_before(self, position: int) -> None:
        """Fetches ahead, for backward, the blocks the recorded forward ran before `position`."""
        self._res.prefetch(reversed(self._order[:position]), held=True)

    def _before_accumulate(self, i: int) -> None:
        """Autograd is about to accumulate parameter i's gradient, which needs i's shape, not
        its values (an embedding's backward reads none): a stand-in of that shape that holds
        one element, until the gradient has arrived."""
        with self._lock:
            self._backward_begins()
            if not self._res.resident(i) and i not in self._res.standins:
                one = torch.empty(1, dtype=self.dtype, device=self.device)
                self.params[i].data = one.expand(self._shapes[i])
                self._res.standins.add(i)

    def arrived(self, i: int) -> None:
        """Parameter i's gradient is accumulated (and on its way): the units holding it are
        released once all of their parameters' gradients are."""
        with self._lock:
            if not self._in_backward or not self._managed[i]:
                return
            self._arrived[i] = True
            if i in self._res.standins:
                self._res.standins.discard(i)
                self.params[i].data = self._res.placeholder
            for u in list(self._res.holders[i]):
                unit = self._units[u]
                if unit.active:
                    continue  # a recomputed forward (activation checkpointing) runs in it
                if all(self._arrived[j] for j in unit.params):
                    self._res.release(u)

    def _backward_ends(self) -> None:
        with self._lock:
            self._in_backward = False
            if self._forward_depth:
                return
            for u, unit in enumerate(self._units):
                # No forward runs: a block still active was left by a recomputation that
                # stopped early (torch < 2.1 runs no hook after it).
                unit.active = 0
                self._res.release(u)
            self._res.prefetched = []
            for i in self._res.standins:
                self.params[i].data = self._res.placeholder
            self._res.standins = set()

    # ------------------------------------------------------------------------------ outside

    def release_all(self) -> None:
        """Every managed parameter off the device (its values in the host copy)."""
        with self._lock:
            self._res.release_all(self._managed)

    def invalidate(self) -> None:
        """The host copy changed (a step, a load): copies on the device are stale. Only between
        steps: a forward or backward in flight is refused."""
        with self._lock:
            if self._forward_depth or any(u.active for u in self._units):
                raise RuntimeError("zero_stage=3: the weights changed while a forward runs")
            self.release_all()

    def gather(self) -> "_Gathered":
        """A context in which every parameter is on the device with its current values (for
        evaluation outside the model's forward, export, state_dict); released after."""
        return _Gathered(self)


class _Outer:
    """A saved tensor the hooks outside the model's call packed."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class _SavedParamHooks:
    """The saved-tensor hooks of one forward: a view of a managed parameter is saved as its
    recipe; any other tensor as the hooks around the model's call save it (torch 2.x tells which
    those are: torch.autograd.graph.save_on_cpu() and the like keep working; torch 1.13 does
    not, and they do not apply inside the model), else as itself. Holds the window weakly."""

    def __init__(self, window: ParamWindow) -> None:
        self.window = weakref.ref(window)
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self.outer = top(False) if top is not None else None

    def pack(self, t: torch.Tensor) -> Any:
        w = self.window()
        recipe = w._pack(t) if w is not None and not w._closed else None
        if recipe is not None:
            return recipe
        if self.outer is not None:
            return _Outer(self.outer[0](t))
        return t

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recipe):
            w = self.window()
            if w is None:
                raise RuntimeError("zero_stage=3: backward through a graph whose optimizer is "
                                   "gone (its parameters' values went with it)")
            return w._unpack(saved)
        if isinstance(saved, _Outer):
            return self.outer[1](saved.packed)
        return saved


class _Recipe:
    """A saved view of a managed parameter: rebuilt from the parameter when unpacked."""

    __slots__ = ("param", "size", "stride", "offset")

    def __init__(self, param: int, size: torch.Size, stride: Tuple[int, ...], offset: int):
        self.param, self.size, self.stride, self.offset = param, size, stride, offset


class _Gathered:
    def __init__(self, window: ParamWindow) -> None:
        self.window = window

    def __enter__(self) -> ParamWindow:
        w = self.window
        with w._lock:
            w._res.fetched_this_pass = set()
            for u, unit in enumerate(w._units):
                w._res.fetch(u)
                unit.active += 1
        return w

    def __exit__(self, *exc: Any) -> None:
        w = self.window
        with w._lock:
            for u, unit in enumerate(w._units):
                unit.active = max(0, unit.active - 1)
                w._res.release(u)
