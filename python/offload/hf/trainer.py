"""Hugging Face's Trainer with the optimizer on Offload's servers: ``offload.hf.Trainer``.

``transformers.Trainer`` already trains with an offload optimizer handed to it
(``optimizer_cls_and_kwargs=(offload.torch.AdamW, {...})`` or ``optimizers=(opt, sched)``):
clipping, accumulation, 16-bit models, schedules and evaluation go through accelerate, which
``offload.hf.accelerator`` adapts. What the subclass adds is what only the Trainer decides:

- the optimizer by default: ``offload.torch.AdamW`` from the TrainingArguments (lr, betas, eps,
  weight decay with Trainer's own no-decay groups, bf16 or fp16 from ``fp16=True``), with
  ``offload_kwargs`` passed on (servers, delay_update, zero_stage...);
- checkpoints that stream: ``save_steps`` writes the optimizer's state from the servers into
  ``checkpoint-N/offload_optimizer/`` (``save_checkpoint``'s files, 16 MiB at a time) where the
  plain Trainer pickles ``state_dict()`` whole through the process (12 bytes a parameter), and
  ``resume_from_checkpoint`` loads it back onto any number of servers and ranks;
- the optimizer's own figures in the logs: ``loss_scale`` (fp16), ``skipped_steps``;
- with ZeRO-3 (``offload_kwargs=dict(zero_stage=3)``) the model's files written with every
  parameter gathered.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import transformers

from offload import clipping
from offload.hf.accelerator import checkpoint_dir, install
from offload.torch import AdamW

_SCHEDULER_NAME = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME
_OPTIMIZER_NAME = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME: the plain Trainer's


def optimizer_cls_and_kwargs(args: Optional[transformers.TrainingArguments] = None,
                             **offload_kwargs: Any) -> Tuple[Callable[..., AdamW], Dict[str, Any]]:
    """``(offload.torch.AdamW, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``: the
    TrainingArguments' lr, betas, eps and dtype (``fp16=True``: fp16 with the optimizer's dynamic
    loss scale; else bf16), overridden by ``offload_kwargs``. Trainer groups the parameters
    itself (no decay for biases and norms) and passes them as the first argument. Run in
    several processes (``accelerate launch``, ``torchrun``), the processes are the optimizer's
    ZeRO-2 ranks (``process_group``: all of them), which need running ``servers=[...]``."""
    kwargs: Dict[str, Any] = {}
    if torch.distributed.is_available() and torch.distributed.is_initialized() and (
            torch.distributed.get_world_size() > 1):
        kwargs["process_group"] = torch.distributed.group.WORLD
    if args is not None:
        kwargs.update(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                      eps=args.adam_epsilon, weight_decay=args.weight_decay,
                      dtype=torch.float16 if args.fp16 else torch.bfloat16)
    kwargs.update(offload_kwargs)
    if kwargs.get("zero_stage") == 3:
        # ZeRO-3 needs the model, and Trainer takes a "model" keyword as the parameters
        # (LOMO's convention): its factory protocol hands the model over instead.
        kwargs.pop("model", None)
        return _ZeRO3, kwargs
    return AdamW, kwargs


class _ZeRO3:
    """Trainer's optimizer factory (``factory()(model, **kwargs)``): ZeRO-3's AdamW over the
    model Trainer trains, with Trainer's own groups (no decay for biases and norms)."""

    def __call__(self, model: torch.nn.Module, **kwargs: Any) -> AdamW:
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay]},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return AdamW([g for g in groups if g["params"]], model=model, **kwargs)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` training with ``offload.torch.AdamW`` (module docstring).

    ``offload_kwargs``: arguments of the optimizer beyond the TrainingArguments' (``servers``,
    ``delay_update``, ``zero_stage``, ``max_resident_bytes``, ...). An optimizer given in
    ``optimizers=`` or ``optimizer_cls_and_kwargs=`` is used as given."""

    def __init__(self, *args: Any, offload_kwargs: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        install()
        super().__init__(*args, **kwargs)
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs(self.args,
                                                                     **(offload_kwargs or {}))
        elif offload_kwargs:
            raise ValueError("offload_kwargs with an optimizer given to the Trainer: pass them "
                             "to the optimizer instead")

    @property
    def offload_optimizer(self) -> Optional[AdamW]:
        """The offload optimizer the Trainer steps (None before it is built, or if another)."""
        return clipping.owner_of(self.optimizer)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self.offload_optimizer
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        opt.save_checkpoint(checkpoint_dir(output_dir, 0), keep=1)  # every rank; rank 0 writes
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "save the optimizer too"
                torch.save(self.lr_scheduler.state_dict(),
                           os.path.join(output_dir, _SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        opt = self.offload_optimizer
        if opt is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        where = checkpoint_dir(checkpoint, 0)
        if not os.path.isdir(where):
            if os.path.isfile(os.path.join(checkpoint, _OPTIMIZER_NAME)):
                return super()._load_optimizer_and_scheduler(checkpoint)  # a plain Trainer's
            raise FileNotFoundError(f"{checkpoint} holds no optimizer state ({where} or "
                                    f"{_OPTIMIZER_NAME}): not a checkpoint of this training")
        scheduler = os.path.join(checkpoint, _SCHEDULER_NAME)
        scheduler_state = torch.load(scheduler, weights_only=True) if os.path.isfile(
            scheduler) else None  # read first: a bad file leaves the optimizer as it was
        opt.load_checkpoint(where)
        if scheduler_state is not None:
            self.lr_scheduler.load_state_dict(scheduler_state)

    def _save(self, output_dir: Optional[str] = None, state_dict: Any = None) -> None:
        # ZeRO-3's parameters are empty outside the model's forward: the model's files are
        # written with every parameter gathered (a no-op at stage 2).
        opt = self.offload_optimizer
        if opt is None or state_dict is not None:
            return super()._save(output_dir, state_dict)
        with opt.gathered():
            return super()._save(output_dir, state_dict)

    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        opt = self.offload_optimizer
        if opt is not None and "loss" in logs and opt.last_report is not None:
            if opt.dtype == torch.float16:
                logs["loss_scale"] = opt.loss_scale
            logs["skipped_steps"] = opt.skipped_steps
        super().log(logs, *args, **kwargs)
