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
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload.grad_hooks import HostCopies

__all__ = ["ParamWindow", "Unit", "default_blocks"]

# Fills the given managed parameters' device tensors with their 16-bit values from the host copy
# (indices into the window's parameters, the tensors to fill; copies may still be in flight
# when it returns, on the side stream the window gave).
Fill = Callable[[List[int], List[torch.Tensor]], None]
BlockSpec = Union[None, Sequence[type], Callable[[str, torch.nn.Module], bool]]


def _storage(t: torch.Tensor) -> Any:
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def default_blocks(model: torch.nn.Module) -> Callable[[str, torch.nn.Module], bool]:
    """The children of every nn.ModuleList / nn.Sequential of the model (the repeated layers)
    that hold parameters."""
    members: Set[int] = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            for child in module.children():
                if any(True for _ in child.parameters()):
                    members.add(id(child))
    return lambda _name, module: id(module) in members


class Unit:
    """Parameters fetched and released together: a block's subtree, or the root set's
    parameters of one module."""

    def __init__(self, name: str, module: torch.nn.Module, params: List[int], nbytes: int,
                 block: bool) -> None:
        self.name = name
        self.module = module
        self.params = params  # indices into the window's parameters
        self.nbytes = nbytes
        self.block = block
        self.active = 0  # forwards running inside it
        self.resident = False
        self.held = False  # fetched in backward, gradients pending
        self.event: Any = None  # the prefetch's copies (CUDA)

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {len(self.params)} parameters, {self.nbytes} bytes)"


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
        self._fill = fill
        self._copies = HostCopies(device)
        self._lock = threading.RLock()
        self._thread: Optional[int] = None  # the thread running the model's forward
        self._shapes = [p.shape for p in self.params]
        self._managed = [not keep for keep in persistent]
        self._placeholder = torch.empty(0, dtype=dtype, device=device)
        self._units, self._owner = self._cut(blocks)
        self.blocks = [u for u in self._units if u.block]
        self.root_set = [u for u in self._units if not u.block]
        self.persistent_bytes = int(persistent_bytes)
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
        # Per managed parameter: the units holding it now (several for a tied one), and its
        # gradient's arrival in this backward.
        self._holders: List[Set[int]] = [set() for _ in self.params]
        self._arrived = [False] * len(self.params)
        # The forward order of the blocks, as the last forward ran them (unit indices), and this
        # forward's so far.
        self._order: List[int] = []
        self._position: Dict[int, int] = {}  # block -> where _order first runs it
        self._recording: List[int] = []
        self._prefetched: List[int] = []  # blocks fetched ahead, not yet entered (oldest first)
        self._forward_depth = 0
        self._saved_hooks: List[Any] = []
        self._in_backward = False
        self._alive: List[Tuple[Any, int]] = []  # (weak reference to a storage, bytes)
        self._by_storage: Dict[int, int] = {}  # resident parameter's storage -> its index
        # Parameters that hold a stand-in of their shape, no values: for autograd's
        # accumulation of a gradient no saved tensor needed the parameter for.
        self._standins: Set[int] = set()
        self.peak_resident_bytes = self.persistent_bytes
        self.fetches = 0  # unit fetches, prefetches included
        self.refetches = 0  # fetches of a unit already fetched once in the same pass
        self._fetched_this_pass: Set[int] = set()
        self._handles: List[Any] = []
        self._closed = False
        self._hook()

    @property
    def root_set_bytes(self) -> int:
        """Bytes of the parameters outside the blocks: on the device for the whole forward."""
        return sum(u.nbytes for u in self.root_set)

    # ------------------------------------------------------------------------------ set-up

    def _cut(self, blocks: BlockSpec) -> Tuple[List[Unit], List[int]]:
        """The units, and per managed parameter the unit that fetches it in backward."""
        if blocks is None:
            is_block = default_blocks(self.model)
        elif callable(blocks) and not isinstance(blocks, (list, tuple)):
            is_block = blocks  # type: ignore[assignment]
        else:
            classes = tuple(blocks)
            if not all(isinstance(c, type) for c in classes):
                raise TypeError("blocks= takes module classes or a callable (name, module) -> bool")
            is_block = lambda _name, module: isinstance(module, classes)  # noqa: E731
        index = {id(p): i for i, p in enumerate(self.params)}
        units: List[Unit] = []
        owner = [-1] * len(self.params)
        inside: Set[int] = set()  # modules inside a block

        def add(name: str, module: torch.nn.Module, params: Iterable[torch.nn.Parameter],
                block: bool) -> None:
            members = []
            for p in params:
                i = index.get(id(p))
                # A root-set parameter tied to another module's is fetched by the first.
                if (i is not None and self._managed[i] and i not in members
                        and (block or owner[i] < 0 or units[owner[i]].block)):
                    members.append(i)
            if not members and not block:
                return
            nbytes = sum(self._shapes[i].numel() for i in members) * self._placeholder.element_size()
            unit = Unit(name or "(the model)", module, members, nbytes, block)
            for i in members:
                if owner[i] < 0:
                    owner[i] = len(units)
            units.append(unit)

        for name, module in self.model.named_modules():
            if id(module) in inside:
                continue
            if module is not self.model and is_block(name, module):
                for sub in module.modules():
                    inside.add(id(sub))
                add(name, module, module.parameters(), True)
        for name, module in self.model.named_modules():
            if id(module) not in inside:
                add(name, module, module._parameters.values(), False)
        for i, o in enumerate(owner):
            if self._managed[i] and o < 0:
                raise ValueError(f"parameter {i} (shape {tuple(self._shapes[i])}) is not a "
                                 "parameter of the model given: zero_stage=3 fetches parameters "
                                 "by the modules that hold them")
        return units, owner

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

    # ------------------------------------------------------------------------------ residency

    def _resident(self, i: int) -> bool:
        return bool(self._holders[i])

    def _fetch(self, u: int, prefetch: bool = False) -> None:
        """Unit u on the device: each of its parameters that is not gets a new tensor, filled
        from the host copy (asynchronously on CUDA: use() waits)."""
        unit = self._units[u]
        if unit.resident:
            return
        missing = [i for i in unit.params if not self._holders[i]]
        if missing:
            tensors = [torch.empty(self._shapes[i], dtype=self.dtype, device=self.device)
                       for i in missing]
            # The side stream waits for the compute queued so far (the new tensors' memory may
            # be memory it still reads), and the allocator keeps them until the copies land (a
            # block evicted before use).
            self._copies.after_current(*tensors)
            with self._copies.on_side():
                self._fill(missing, tensors)
            for i, t in zip(missing, tensors):
                self._standins.discard(i)
                self.params[i].data = t
                self._by_storage[_storage(t).data_ptr()] = i
                self._alive.append((StorageWeakRef(_storage(t)), t.numel() * t.element_size()))
        # After every copy issued so far: those of a unit that prefetched a parameter this one
        # shares (a tied weight) too.
        unit.event = self._copies.record()
        for i in unit.params:
            self._holders[i].add(u)
        unit.resident = True
        self.fetches += 1
        if u in self._fetched_this_pass:
            self.refetches += 1
        self._fetched_this_pass.add(u)
        if not prefetch:
            self._use(u)
        self._measure()

    def _use(self, u: int) -> None:
        unit = self._units[u]
        if unit.event is not None:
            self._copies.current_waits(unit.event)
            unit.event = None
        if u in self._prefetched:
            self._prefetched.remove(u)

    def _release(self, u: int) -> None:
        """Unit u off the device: parameters no other unit holds get their placeholder back (a
        storage a saved view still holds lives on, counted, until that view dies)."""
        unit = self._units[u]
        if not unit.resident or unit.active:
            return
        for i in unit.params:
            holders = self._holders[i]
            holders.discard(u)
            if not holders:
                p = self.params[i]
                if p.shape != self._shapes[i] or p.dtype != self.dtype:
                    raise RuntimeError(
                        f"parameter {i} of {unit.name} is {p.dtype} of shape {tuple(p.shape)} "
                        f"after the forward; it was {self.dtype} of shape "
                        f"{tuple(self._shapes[i])}: zero_stage=3 cannot keep a parameter that "
                        "the model reshapes or replaces (its values live in the optimizer)")
                self._by_storage.pop(_storage(p.data).data_ptr(), None)
                p.data = self._placeholder
        unit.resident = False
        unit.held = False
        unit.event = None
        if u in self._prefetched:
            self._prefetched.remove(u)

    def resident_bytes(self) -> int:
        """Bytes of parameter storage on the device: the window's live tensors (those the
        parameters hold, and any a saved view keeps) and the persistent set."""
        self._alive = [(w, n) for w, n in self._alive if not w.expired()]
        return self.persistent_bytes + sum(n for _, n in self._alive)

    def _measure(self) -> None:
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes())

    def reset_peak(self) -> None:
        self.peak_resident_bytes = self.resident_bytes()

    def _blocks_resident(self) -> List[int]:
        return [u for u, unit in enumerate(self._units) if unit.block and unit.resident]

    def _room(self, unit: Unit, extra_blocks: int = 1) -> bool:
        """Whether one more block fits the window and the byte limit."""
        blocks = self._blocks_resident()
        if len(blocks) + extra_blocks > self.window:
            return False
        if self.max_resident_bytes:
            used = sum(self._units[u].nbytes for u in blocks)
            used += sum(u.nbytes for u in self.root_set if u.resident)
            if used + unit.nbytes > self.max_resident_bytes:
                return False
        return True

    def _make_room(self, u: int) -> None:
        """Releases blocks that are not needed now (prefetched and not entered, then, in
        backward, ones whose gradients all arrived) until unit u fits."""
        unit = self._units[u]
        for v in list(self._prefetched):
            if self._room(unit):
                return
            if v != u:
                self._release(v)
        if self._room(unit):
            return
        for v in self._blocks_resident():
            other = self._units[v]
            if v != u and not other.active and not other.held:
                self._release(v)
                if self._room(unit):
                    return

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
            self._fetched_this_pass = set()
            self._recording = []
            for u, unit in enumerate(self._units):
                if not unit.block:
                    self._fetch(u)
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
                    self._release(u)
            for u in list(self._prefetched):
                self._release(u)
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
                self._make_room(u)
                if self.max_resident_bytes and not self._room(unit, extra_blocks=0):
                    raise RuntimeError(
                        f"zero_stage=3: block {unit.name} ({unit.nbytes} bytes) does not fit "
                        f"max_resident_bytes={self.max_resident_bytes} beside the blocks running "
                        "around it: raise the limit or cut the model into smaller blocks")
                self._fetch(u)
            else:
                self._use(u)
            unit.active += 1
            if self._forward_depth:
                self._recording.append(u)
                self._prefetch_after(len(self._recording) - 1)

    def _leave(self, u: int) -> None:
        with self._lock:
            unit = self._units[u]
            unit.active = max(0, unit.active - 1)
            if not unit.active:
                self._release(u)

    def _prefetch_after(self, position: int) -> None:
        """Fetches ahead the blocks the recorded order runs after `position` (this forward's
        count of blocks entered so far, less one), while they fit."""
        self._prefetch(self._order[position + 1:], held=False)

    def _prefetch(self, blocks: Iterable[int], held: bool) -> None:
        """Fetches `blocks` in turn, without waiting for the copies, until one does not fit.
        held: for backward, where a block stays until its gradients arrive."""
        for u in blocks:
            unit = self._units[u]
            if unit.resident:
                continue
            if not self._room(unit):
                return
            self._fetch(u, prefetch=True)
            self._prefetched.append(u)
            unit.held = held

    # ------------------------------------------------------------------------------ backward

    def _pack(self, t: torch.Tensor) -> Any:
        """A saved tensor: a view of a managed parameter's storage becomes its recipe; None for
        any other tensor."""
        if (t.numel() == 0 or t.device != self.device or t.dtype != self.dtype
                or not self._forward_depth or self._thread != threading.get_ident()):
            return None
        i = self._by_storage.get(_storage(t).data_ptr())
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
        self._fetched_this_pass = set()
        self._arrived = [False] * len(self.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _need(self, i: int) -> None:
        """Parameter i on the device now (backward): its unit fetched and held until its
        gradients arrive; the blocks before it in forward order prefetched."""
        u = self._owner[i]
        unit = self._units[u]
        # The blocks before it are prefetched once, when it is fetched or its prefetch is first
        # used, not at each of its saved tensors.
        first = not self._resident(i) or u in self._prefetched
        if not self._resident(i):
            if unit.block:
                self._make_room(u)
            self._fetch(u)
        else:
            self._use(u)
            for v in self._holders[i]:
                self._use(v)
        if not unit.held and not all(self._arrived[j] for j in unit.params):
            unit.held = True
        if first and u in self._position:
            self._prefetch_before(self._position[u])

    def _prefetch_before(self, position: int) -> None:
        """Fetches ahead, for backward, the blocks the recorded forward ran before `position`."""
        self._prefetch(reversed(self._order[:position]), held=True)

    def _before_accumulate(self, i: int) -> None:
        """Autograd is about to accumulate parameter i's gradient, which needs i's shape, not
        its values (an embedding's backward reads none): a stand-in of that shape that holds
        one element, until the gradient has arrived."""
        with self._lock:
            self._backward_begins()
            if not self._resident(i) and i not in self._standins:
                one = torch.empty(1, dtype=self.dtype, device=self.device)
                self.params[i].data = one.expand(self._shapes[i])
                self._standins.add(i)

    def arrived(self, i: int) -> None:
        """Parameter i's gradient is accumulated (and on its way): the units holding it are
        released once all of their parameters' gradients are."""
        with self._lock:
            if not self._in_backward or not self._managed[i]:
                return
            self._arrived[i] = True
            if i in self._standins:
                self._standins.discard(i)
                self.params[i].data = self._placeholder
            for u in list(self._holders[i]):
                unit = self._units[u]
                if unit.active:
                    continue  # a recomputed forward (activation checkpointing) runs in it
                if all(self._arrived[j] for j in unit.params):
                    self._release(u)

    def _backward_ends(self) -> None:
        with self._lock:
            self._in_backward = False
            if self._forward_depth:
                return
            for u, unit in enumerate(self._units):
                # No forward runs: a block still active was left by a recomputation that
                # stopped early (torch < 2.1 runs no hook after it).
                unit.active = 0
                self._release(u)
            self._prefetched = []
            for i in self._standins:
                self.params[i].data = self._placeholder
            self._standins = set()

    # ------------------------------------------------------------------------------ outside

    def release_all(self) -> None:
        """Every managed parameter off the device (its values in the host copy)."""
        with self._lock:
            for u in range(len(self._units)):
                self._units[u].active = 0
                self._release(u)
            for i, p in enumerate(self.params):
                if self._managed[i] and not self._holders[i]:
                    p.data = self._placeholder
            self._by_storage = {}
            self._standins = set()
            self._prefetched = []

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
            w._fetched_this_pass = set()
            for u, unit in enumerate(w._units):
                w._fetch(u)
                unit.active += 1
        return w

    def __exit__(self, *exc: Any) -> None:
        w = self.window
        with w._lock:
            for u, unit in enumerate(w._units):
                unit.active = max(0, unit.active - 1)
                w._release(u)
