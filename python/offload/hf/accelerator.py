"""accelerate with an offload optimizer: what ``accelerator.prepare`` and the calls around the step
must do differently for an optimizer whose gradients and state are on the servers.

accelerate assumes the optimizer's gradients sit in ``p.grad`` and its state in this process.
Neither holds here, and each assumption would go wrong silently, so while an offload optimizer
is alive (and accelerate imported), these of accelerate's methods treat one as it needs:

- ``Accelerator.clip_grad_norm_``: the global norm of the gradients sent, and the clip in the
  coming step (``offload.clipping``), where accelerate would find no ``p.grad`` and clip nothing.
- ``Accelerator.prepare_model``: the parameters stay where the optimizer put them (views of its
  16-bit buffer), and with several processes no DistributedDataParallel wraps the model (its
  all-reduce would wait for gradients the optimizer already took): the processes must be the
  optimizer's ranks (``process_group``), which reduce the gradients themselves.
- ``AcceleratedOptimizer`` (``prepare``): no device placement of the state (a round trip of the
  whole fp32 state, 12 bytes a parameter, through this process: the state is on the servers),
  and no GradScaler: the optimizer's own dynamic loss scale is the one.
- ``Accelerator.backward``: the loss multiplied by that scale (1 for bf16) instead of
  GradScaler's, so an fp16 run is scaled once, never twice.
- ``AcceleratedOptimizer.step_was_skipped``: whether the servers skipped the step (an fp16
  overflow, a non-finite gradient), which Trainer reads before it moves the lr schedule.
- ``Accelerator.save_state`` / ``load_state``: the optimizer's state streams between the servers
  and ``<dir>/offload_optimizer[_<i>]`` (``save_checkpoint`` / ``load_checkpoint``: files of any
  number of servers and ranks), where accelerate would pickle ``state_dict()`` whole; the
  rest (model, schedulers, samplers, RNG) is accelerate's own, the model's weights written by
  torch.save (the parameters are views of one buffer, which safetensors cannot hold).

Everything else, and every optimizer that is not an offload one, is accelerate's as it was.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any, Callable, List, Optional

from offload import clipping
from offload.weights import move_buffers

_lock = threading.Lock()
_installed = False

# Where save_state puts optimizer i's checkpoint, inside accelerate's checkpoint directory.
def checkpoint_dir(directory: str, index: int) -> str:
    return os.path.join(directory, "offload_optimizer" + (f"_{index}" if index else ""))


def install_if_imported() -> None:
    """Installs the patches where accelerate is imported (an offload optimizer is built after
    ``import accelerate`` / ``transformers.Trainer`` in every script that uses them)."""
    if "accelerate" in sys.modules:
        install()


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        from accelerate import Accelerator
        from accelerate.optimizer import AcceleratedOptimizer
        _wrap(Accelerator, "prepare_model", _prepare_model)
        _wrap(Accelerator, "clip_grad_norm_", _clip_grad_norm_)
        _wrap(Accelerator, "backward", _backward)
        _wrap(Accelerator, "save_state", _save_state)
        _wrap(Accelerator, "load_state", _load_state)
        _wrap(AcceleratedOptimizer, "__init__", _accelerated_optimizer_init)
        was_skipped = AcceleratedOptimizer.step_was_skipped
        AcceleratedOptimizer.step_was_skipped = property(
            functools.partial(_step_was_skipped, was_skipped.fget), doc=was_skipped.__doc__)
        _installed = True


def _wrap(cls: type, name: str, replacement: Callable[..., Any]) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return replacement(original, self, *args, **kwargs)
    setattr(cls, name, method)


def _offload_optimizers(accelerator: Any) -> List[Any]:
    """The accelerator's prepared optimizers that are offload ones, unwrapped, in order."""
    found = (clipping.owner_of(o) for o in getattr(accelerator, "_optimizers", []))
    return [o for o in found if o is not None]


def _owner_of_model(accelerator: Any, model: Any) -> Optional[Any]:
    """The live offload optimizer that trains ``model``'s parameters, checked against the
    processes accelerate runs: several processes need the optimizer's ranks to be them."""
    owners = clipping.owners_of({id(p) for p in model.parameters() if p.requires_grad})
    if not owners:
        return None
    opt = owners[0]
    _check_ranks(accelerator, opt)
    return opt


def _check_ranks(accelerator: Any, opt: Any) -> None:
    processes = int(getattr(accelerator, "num_processes", 1))
    if opt.world_size != processes:
        raise ValueError(
            f"accelerate runs {processes} processes and the offload optimizer has "
            f"{opt.world_size} rank(s): build it with process_group=torch.distributed.group.WORLD "
            "and servers=[...] every process reaches (the processes are its ZeRO-2 ranks)")


def _prepare_model(original: Callable[..., Any], self: Any, model: Any,
                   device_placement: Optional[bool] = None, evaluation_mode: bool = False) -> Any:
    opt = _owner_of_model(self, model)
    if opt is not None:
        # The parameters are views of the optimizer's 16-bit buffer, already where they train
        # (its device=): accelerate's model.to(device) would copy them out of it where the two
        # devices only look different (torchrun's "cpu:0" against "cpu"). Buffers follow.
        if opt.device.type != self.device.type:
            raise ValueError(f"the offload optimizer keeps the weights on {opt.device} and "
                             f"accelerate trains on {self.device}: build it with "
                             "device=accelerator.device")
        move_buffers(model, opt.device)
        device_placement = False
        # With several processes accelerate wraps the model in DistributedDataParallel, whose
        # all-reduce would wait for gradients the optimizer has already taken and freed: the
        # optimizer's ranks reduce them (their mean, as DDP's) on their way to the servers.
        # accelerate's evaluation mode is the same preparation without that wrapper.
        evaluation_mode = True
    return original(self, model, device_placement=device_placement,
                    evaluation_mode=evaluation_mode)


def _clip_grad_norm_(original: Callable[..., Any], self: Any, parameters: Any, max_norm: float,
                     norm_type: float = 2, **kwargs: Any) -> Any:
    params = list(parameters)
    norm = clipping.clip_owned(params, max_norm, norm_type)
    if norm is not None:
        return norm
    return original(self, params, max_norm, norm_type, **kwargs)


def _accelerated_optimizer_init(original: Callable[..., Any], self: Any, optimizer: Any,
                                device_placement: bool = True, scaler: Any = None) -> None:
    opt = clipping.owner_of(optimizer)
    if opt is not None:
        from accelerate.state import PartialState
        _check_ranks(PartialState(), opt)
        device_placement, scaler = False, None
    original(self, optimizer, device_placement=device_placement, scaler=scaler)


def _step_was_skipped(accelerate_skipped: Callable[[Any], bool], self: Any) -> bool:
    opt = clipping.owner_of(self.optimizer)
    if opt is None:
        return accelerate_skipped(self)
    report = opt.last_report
    return bool(report and report["skipped"])


def _backward(original: Callable[..., Any], self: Any, loss: Any, **kwargs: Any) -> Any:
    ours = _offload_optimizers(self)
    if not ours:
        return original(self, loss, **kwargs)
    scales = {opt.loss_scale for opt in ours}
    if len(scales) > 1:
        raise ValueError("accelerator.backward with offload optimizers at different loss "
                         f"scales {sorted(scales)}: one backward cannot scale for both")
    scale = scales.pop()
    scaler, self.scaler = self.scaler, None  # the optimizer's scale instead of GradScaler's
    try:
        return original(self, loss * scale if scale != 1.0 else loss, **kwargs)
    finally:
        self.scaler = scaler


def _without_offload_optimizers(self: Any, call: Callable[[], Any]) -> Any:
    """Runs accelerate's save or load with the offload optimizers out of its list, so it neither
    pickles their state nor looks for its files; the others keep their indices' order."""
    kept = self._optimizers
    self._optimizers = [o for o in kept if clipping.owner_of(o) is None]
    try:
        return call()
    finally:
        self._optimizers = kept


def _save_state(original: Callable[..., Any], self: Any, output_dir: Optional[str] = None,
                safe_serialization: bool = True, **kwargs: Any) -> Any:
    ours = _offload_optimizers(self)
    if not ours:
        return original(self, output_dir, safe_serialization, **kwargs)
    # The parameters are views of the optimizer's one flat 16-bit buffer: safetensors takes
    # views of one storage for tied copies and keeps one of them (dropping the rest of the
    # model from the file), and refuses to load into such a model. torch.save keeps the views
    # as they are, and accelerate's load_state reads either format.
    location = _without_offload_optimizers(self, lambda: original(self, output_dir, False,
                                                                  **kwargs))
    for i, opt in enumerate(ours):
        opt.save_checkpoint(checkpoint_dir(location, i), keep=1)
    return location


def _load_state(original: Callable[..., Any], self: Any, input_dir: Optional[str] = None,
                *args: Any, **kwargs: Any) -> Any:
    ours = _offload_optimizers(self)
    if not ours:
        return original(self, input_dir, *args, **kwargs)
    resolved: List[str] = []

    def check(models: Any, directory: str) -> None:
        # Before accelerate loads anything: a directory without the state changes nothing.
        for i in range(len(ours)):
            if not os.path.isdir(checkpoint_dir(directory, i)):
                raise FileNotFoundError(
                    f"{checkpoint_dir(directory, i)}: no offload optimizer state in {directory} "
                    "(written by accelerator.save_state with this optimizer prepared)")
        resolved.append(directory)
    handle = self.register_load_state_pre_hook(check)
    try:
        result = _without_offload_optimizers(self, lambda: original(self, input_dir, *args,
                                                                    **kwargs))
    finally:
        handle.remove()
    for i, opt in enumerate(ours):
        opt.load_checkpoint(checkpoint_dir(resolved[0], i))
    return result
