"""ZeRO-3's units and their residency: what ``offload.param_window`` fetches and releases.

The model is cut into *units*, each fetched as a whole: a block's subtree, or the root set's
parameters of one module (see ``param_window``'s docstring). ``Residency`` knows which units are
on the device and moves them: a fetch gives each parameter of a unit that is not on the device a
new tensor and fills it from the host copy (on CUDA on a side stream, waited for at first use),
a release gives it back its 0-element placeholder. It keeps the window's limits (how many blocks,
how many bytes) and counts what the device holds.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Sequence, Set, Tuple, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload.grad_hooks import HostCopies

__all__ = ["BlockSpec", "Fill", "Residency", "Unit", "cut_units", "default_blocks", "storage_of"]

# Fills the given managed parameters' device tensors with their 16-bit values from the host copy
# (indices into the window's parameters, the tensors to fill; copies may still be in flight
# when it returns, on the side stream the window gave).
Fill = Callable[[List[int], List[torch.Tensor]], None]
BlockSpec = Union[None, Sequence[type], Callable[[str, torch.nn.Module], bool]]


def storage_of(t: torch.Tensor) -> Any:
    """t's storage (torch 2.x's untyped one, or 1.13's)."""
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


def cut_units(model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
              shapes: Sequence[torch.Size], managed: Sequence[bool], element_size: int,
              blocks: BlockSpec) -> Tuple[List[Unit], List[int]]:
    """The model's units (the blocks, then the root set's), and per managed parameter the unit
    that fetches it in backward."""
    if blocks is None:
        is_block = default_blocks(model)
    elif callable(blocks) and not isinstance(blocks, (list, tuple)):
        is_block = blocks  # type: ignore[assignment]
    else:
        classes = tuple(blocks)
        if not all(isinstance(c, type) for c in classes):
            raise TypeError("blocks= takes module classes or a callable (name, module) -> bool")
        is_block = lambda _name, module: isinstance(module, classes)  # noqa: E731
    index = {id(p): i for i, p in enumerate(params)}
    units: List[Unit] = []
    owner = [-1] * len(params)
    inside: Set[int] = set()  # modules inside a block

    def add(name: str, module: torch.nn.Module, held: Iterable[torch.nn.Parameter],
            block: bool) -> None:
        members = []
        for p in held:
            i = index.get(id(p))
            # A root-set parameter tied to another module's is fetched by the first.
            if (i is not None and managed[i] and i not in members
                    and (block or owner[i] < 0 or units[owner[i]].block)):
                members.append(i)
        if not members and not block:
            return
        nbytes = sum(shapes[i].numel() for i in members) * element_size
        unit = Unit(name or "(the model)", module, members, nbytes, block)
        for i in members:
            if owner[i] < 0:
                owner[i] = len(units)
        units.append(unit)

    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if module is not model and is_block(name, module):
            for sub in module.modules():
                inside.add(id(sub))
            add(name, module, module.parameters(), True)
    for name, module in model.named_modules():
        if id(module) not in inside:
            add(name, module, module._parameters.values(), False)
    for i, o in enumerate(owner):
        if managed[i] and o < 0:
            raise ValueError(f"parameter {i} (shape {tuple(shapes[i])}) is not a "
                             "parameter of the model given: zero_stage=3 fetches parameters "
                             "by the modules that hold them")
    return units, owner


class Residency:
    """Which of ``units`` are on the device, and moving them there and back.

    params, shapes: the window's parameters; fill: what fetches values; window: the most blocks
    on the device at once; max_resident_bytes: the most bytes of blocks and root set (0: no
    limit); persistent_bytes: what stays on the device all the time, counted in resident_bytes.
    """

    def __init__(self, params: List[torch.nn.Parameter], shapes: List[torch.Size],
                 units: List[Unit], fill: Fill, copies: HostCopies, device: torch.device,
                 dtype: torch.dtype, window: int, max_resident_bytes: int,
                 persistent_bytes: int) -> None:
        self.params, self._shapes, self.units = params, shapes, units
        self._fill, self._copies = fill, copies
        self.device, self.dtype = device, dtype
        self.window, self.max_resident_bytes = window, max_resident_bytes
        self.root_set = [u for u in units if not u.block]
        self.placeholder = torch.empty(0, dtype=dtype, device=device)
        # Per managed parameter: the units holding it now (several for a tied one).
        self.holders: List[Set[int]] = [set() for _ in params]
        self.prefetched: List[int] = []  # blocks fetched ahead, not yet entered (oldest first)
        self._alive: List[Tuple[Any, int]] = []  # (weak reference to a storage, bytes)
        self.by_storage: Dict[int, int] = {}  # resident parameter's storage -> its index
        # Parameters that hold a stand-in of their shape, no values: for autograd's
        # accumulation of a gradient no saved tensor needed the parameter for.
        self.standins: Set[int] = set()
        self.persistent_bytes = int(persistent_bytes)
        self.peak_resident_bytes = self.persistent_bytes
        self.fetches = 0  # unit fetches, prefetches included
        self.refetches = 0  # fetches of a unit already fetched once in the same pass
        self.fetched_this_pass: Set[int] = set()

    def resident(self, i: int) -> bool:
        return bool(self.holders[i])

    def fetch(self, u: int, prefetch: bool = False) -> None:
        """Unit u on the device: each of its parameters that is not gets a new tensor, filled
        from the host copy (asynchronously on CUDA: use() waits)."""
        unit = self.units[u]
        if unit.resident:
            return
        missing = [i for i in unit.params if not self.holders[i]]
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
                self.standins.discard(i)
                self.params[i].data = t
                self.by_storage[storage_of(t).data_ptr()] = i
                self._alive.append((StorageWeakRef(storage_of(t)), t.numel() * t.element_size()))
        # After every copy issued so far: those of a unit that prefetched a parameter this one
        # shares (a tied weight) too.
        unit.event = self._copies.record()
        for i in unit.params:
            self.holders[i].add(u)
        unit.resident = True
        self.fetches += 1
        if u in self.fetched_this_pass:
            self.refetches += 1
        self.fetched_this_pass.add(u)
        if not prefetch:
            self.use(u)
        self._measure()

    def use(self, u: int) -> None:
        """Unit u is used now: the current stream waits for its copies."""
        unit = self.units[u]
        if unit.event is not None:
            self._copies.current_waits(unit.event)
            unit.event = None
        if u in self.prefetched:
            self.prefetched.remove(u)

    def release(self, u: int) -> None:
        """Unit u off the device: parameters no other unit holds get their placeholder back (a
        storage a saved view still holds lives on, counted, until that view dies)."""
        unit = self.units[u]
        if not unit.resident or unit.active:
            return
        for i in unit.params:
            holders = self.holders[i]
            holders.discard(u)
            if not holders:
                p = self.params[i]
                if p.shape != self._shapes[i] or p.dtype != self.dtype:
                    raise RuntimeError(
                        f"parameter {i} of {unit.name} is {p.dtype} of shape {tuple(p.shape)} "
                        f"after the forward; it was {self.dtype} of shape "
                        f"{tuple(self._shapes[i])}: zero_stage=3 cannot keep a parameter that "
                        "the model reshapes or replaces (its values live in the optimizer)")
                self.by_storage.pop(storage_of(p.data).data_ptr(), None)
                p.data = self.placeholder
        unit.resident = False
        unit.held = False
        unit.event = None
        if u in self.prefetched:
            self.prefetched.remove(u)

    def resident_bytes(self) -> int:
        """Bytes of parameter storage on the device: the window's live tensors (those the
        parameters hold, and any a saved view keeps) and the persistent set."""
        self._alive = [(w, n) for w, n in self._alive if not w.expired()]
        return self.persistent_bytes + sum(n for _, n in self._alive)

    def _measure(self) -> None:
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes())

    def reset_peak(self) -> None:
        self.peak_resident_bytes = self.resident_bytes()

    def blocks_resident(self) -> List[int]:
        return [u for u, unit in enumerate(self.units) if unit.block and unit.resident]

    def room(self, unit: Unit, extra_blocks: int = 1) -> bool:
        """Whether one more block fits the window and the byte limit."""
        blocks = self.blocks_resident()
        if len(blocks) + extra_blocks > self.window:
            return False
        if self.max_resident_bytes:
            used = sum(self.units[u].nbytes for u in blocks)
            used += sum(u.nbytes for u in self.root_set if u.resident)
            if used + unit.nbytes > self.max_resident_bytes:
                return False
        return True

    def make_room(self, u: int) -> None:
        """Releases blocks that are not needed now (prefetched and not entered, then, in
        backward, ones whose gradients all arrived) until unit u fits."""
        unit = self.units[u]
        for v in list(self.prefetched):
            if self.room(unit):
                return
            if v != u:
                self.release(v)
        if self.room(unit):
            return
        for v in self.blocks_resident():
            other = self.units[v]
            if v != u and not other.active and not other.held:
                self.release(v)
                if self.room(unit):
                    return

    def prefetch(self, blocks: Iterable[int], held: bool) -> None:
        """Fetches `blocks` in turn, without waiting for the copies, until one does not fit.
        held: for backward, where a block stays until its gradients arrive."""
        for u in blocks:
            unit = self.units[u]
            if unit.resident:
                continue
            if not self.room(unit):
                return
            self.fetch(u, prefetch=True)
            self.prefetched.append(u)
            unit.held = held

    def release_all(self, managed: Sequence[bool]) -> None:
        """Every managed parameter off the device (its values in the host copy)."""
        for u in range(len(self.units)):
            self.units[u].active = 0
            self.release(u)
        for i, p in enumerate(self.params):
            if managed[i] and not self.holders[i]:
                p.data = self.placeholder
        self.by_storage = {}
        self.standins = set()
        self.prefetched = []
