"""``torch.nn.utils.clip_grad_norm_`` for parameters whose gradients went to an offload optimizer.

The front end frees each ``p.grad`` as soon as the gradient is on its way to the servers, so
torch's ``clip_grad_norm_`` would find no gradient, return 0 and clip nothing: the step would go
on unclipped without a word. Every training loop that clips by calling it (by hand, or through
accelerate and Hugging Face's Trainer, see ``offload.hf``) must clip by the global norm instead.
So while an offload optimizer is alive, ``torch.nn.utils.clip_grad_norm_`` answers for the
parameters it owns: it returns the global L2 norm of the step's (unscaled) gradients, computed
by the library from the gradients sent, and the coming ``step()`` clips them by ``max_norm``
(the optimizer's ``clip_grad_norm_``). Any other parameters go to torch's own function.

What cannot be answered exactly is refused, never approximated: another norm than L2, part of an
optimizer's parameters (its norm is over all of them), gradients of several offload optimizers,
or offload parameters mixed with others that hold gradients.

Code that took the function before the first optimizer was built (``from torch.nn.utils import
clip_grad_norm_`` at import time) keeps torch's; call the optimizer's ``clip_grad_norm_`` there.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Iterable, List, Optional, Set, Union

import torch

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_install_lock = threading.Lock()
_torch_clip_grad_norm_ = None  # torch's own, once replaced


def register(optimizer: Any) -> None:
    """Called by every offload optimizer when it is built: from then on torch's function (and
    accelerate's, where accelerate is imported) answer for its parameters."""
    _live.add(optimizer)
    _install()
    from offload.hf import accelerator  # lazy: accelerate is optional
    accelerator.install_if_imported()


def live() -> List[Any]:
    """The offload optimizers alive (not closed) in this process."""
    return [opt for opt in list(_live) if opt.alive]


def owner_of(optimizer: Any) -> Optional[Any]:
    """The offload optimizer an optimizer is or wraps (accelerate's AcceleratedOptimizer holds
    it as ``.optimizer``), or None."""
    seen = 0
    while optimizer is not None and seen < 8:
        if optimizer in _live:
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def owners_of(ids: Set[int]) -> List[Any]:
    """The live offload optimizers that train any of the parameters whose ids are given."""
    return [opt for opt in live() if ids & opt._trained_ids]


def clip_owned(params: List[torch.Tensor], max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False) -> Optional[torch.Tensor]:
    """The global norm of ``params``' gradients and the clip by ``max_norm`` in the coming step,
    when an offload optimizer owns them; None when none does (torch's function answers)."""
    ids = {id(p) for p in params}
    owners = owners_of(ids)
    if not owners:
        return None
    if len(owners) > 1:
        raise ValueError("clip_grad_norm_ over the parameters of several offload optimizers: "
                         "each clips by its own global norm; call each one's clip_grad_norm_")
    opt = owners[0]
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_ with norm_type={norm_type}: an offload optimizer "
                         "clips by the global L2 norm only (norm_type=2)")
    missing = len(opt._trained_ids - ids)
    if missing:
        raise ValueError(f"clip_grad_norm_ over part of an offload optimizer's parameters "
                         f"({missing} of its trained parameters are not among them): it clips "
                         "by the norm over all of them; pass them all (model.parameters())")
    others = [p for p in params if id(p) not in opt._trained_ids and p.grad is not None]
    if others:
        raise ValueError(f"clip_grad_norm_ over an offload optimizer's parameters and "
                         f"{len(others)} other parameters with gradients: their global norm is "
                         "not known in one place; clip them separately")
    norm = opt.clip_grad_norm_(float(max_norm))
    if error_if_nonfinite and not math.isfinite(float(norm)):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    return norm


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, answering for offload optimizers' parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm = clip_owned(params, max_norm, norm_type, error_if_nonfinite)
    if norm is not None:
        return norm
    return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, *args,
                                  **kwargs)


def _install() -> None:
    global _torch_clip_grad_norm_
    with _install_lock:
        if _torch_clip_grad_norm_ is not None:
            return
        _torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
        clip_grad_norm_.__wrapped__ = _torch_clip_grad_norm_  # type: ignore[attr-defined]
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
