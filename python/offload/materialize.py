"""Giving values to a model built on the meta device, module by module, straight into the
optimizer servers (what ``offload.torch.materialize`` runs).

A model whose fp32 weights fit nowhere is built without storage (``with torch.device("meta"):``
on torch 2.x, or ``device="meta"`` to each module on torch 1.13). Then, one module at a time, its
parameters are allocated in fp32 on the CPU, initialized by the module's own
``reset_parameters()`` or the user's ``init(module)``, streamed to the servers as master weights,
and cast into the optimizer's 16-bit buffer; the fp32 copy is freed before the next module. The
process holds the 16-bit model and one module in fp32 at most.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

Init = Callable[[torch.nn.Module], None]


def _fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=device)


class MetaValues:
    """The values source of AdamW's set-up for a model on the meta device: called with the
    optimizer's parameters, it yields (index, parameter) pairs, each parameter a new one with
    values that replaces the meta one everywhere the model holds it (tied weights included)."""

    def __init__(self, model: torch.nn.Module, init: Optional[Init],
                 device: Optional[torch.device]) -> None:
        self.model = model
        self.init = init
        # Where parameters the optimizer does not train, and buffers, go.
        self.device = device if device is not None else torch.device("cpu")
        # id(meta parameter) -> its replacement, for the parameters the optimizer does not train
        # (its frozen ones, which it then casts): they are not yielded.
        self.replaced: Dict[int, torch.nn.Parameter] = {}

    def __call__(self, params: List[torch.nn.Parameter]
                 ) -> Iterator[Tuple[int, torch.nn.Parameter]]:
        index = {id(p): i for i, p in enumerate(params)}
        given = set()
        owners: Dict[int, List[Tuple[torch.nn.Module, str]]] = {}
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((module, name))
        for qualname, module in self.model.named_modules():
            metas = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_meta]
            buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            if not metas and not buffers:
                continue
            label = f"module '{qualname or '(the model)'}' ({type(module).__name__})"
            if self.init is None and not hasattr(module, "reset_parameters"):
                raise ValueError(f"{label} has tensors on the meta device and no "
                                 "reset_parameters(): pass init= to say how to initialize it")
            if self.init is not None and buffers:
                raise ValueError(f"{label} has buffers on the meta device ({', '.join(buffers)}), "
                                 "which init= does not set: build the model's buffers for real "
                                 "(only parameters on the meta device), or let the module's own "
                                 "reset_parameters() run (no init=)")
            fresh: List[Tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
            for name, old in metas:
                new = torch.nn.Parameter(_fresh(old, torch.device("cpu")),
                                         requires_grad=old.requires_grad)
                for owner, owner_name in owners.get(id(old), [(module, name)]):
                    owner._parameters[owner_name] = new
                fresh.append((old, new))
            for name in buffers:
                module._buffers[name] = _fresh(module._buffers[name], self.device)
            # Parameters an earlier module gave values (tied weights) keep them: the init sees
            # stand-ins in their place.
            made = {id(new) for _, new in fresh}
            kept = {n: p for n, p in module._parameters.items()
                    if p is not None and id(p) not in made}
            for name, p in kept.items():
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
            try:
                with torch.no_grad():
                    if self.init is not None:
                        self.init(module)
                    else:
                        module.reset_parameters()  # type: ignore[operator]
            except Exception as e:
                raise RuntimeError(f"initializing {label} failed: {type(e).__name__}: {e}") from e
            finally:
                for name, p in kept.items():
                    module._parameters[name] = p
            for old, new in fresh:
                i = index.get(id(old))
                if i is not None:
                    given.add(i)
                    yield i, new
                else:
                    self.replaced[id(old)] = new
                    if self.device.type != "cpu":
                        new.data = new.data.to(self.device)  # not trained here: kept as built
        # Parameters built for real take their own values.
        for i, p in enumerate(params):
            if i not in given:
                if p.is_meta:
                    raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is on the meta "
                                     "device but no module of the model holds it")
                yield i, p
