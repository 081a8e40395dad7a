"""Hugging Face's tools with Offload's optimizer servers.

- ``offload.hf.Trainer``: ``transformers.Trainer`` with ``offload.torch.AdamW`` by default,
  checkpoints that stream the optimizer's state, the optimizer's figures in the logs. The one
  line a script changes: ``from offload.hf import Trainer``.
- ``offload.hf.optimizer_cls_and_kwargs(args, **kwargs)``: for the plain Trainer's
  ``optimizer_cls_and_kwargs=``.
- ``offload.hf.from_deepspeed_config(config, model, args)``: the optimizer a DeepSpeed
  ZeRO-Offload config asks for.
- accelerate: ``accelerator.prepare`` takes an offload optimizer as any other; what it must do
  differently for one (clipping, loss scaling, ``save_state``) is in ``offload.hf.accelerator``,
  installed as soon as an offload optimizer is built in a process that imported accelerate.

Nothing here is imported before it is used: ``import offload.hf`` needs neither transformers nor
accelerate.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"Trainer": "trainer", "optimizer_cls_and_kwargs": "trainer",
          "from_deepspeed_config": "deepspeed_config", "OffloadConfig": "deepspeed_config"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'offload.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"offload.hf.{_WHERE[name]}"), name)
