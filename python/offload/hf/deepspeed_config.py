"""A DeepSpeed ZeRO-Offload config as an Offload optimizer: ``from_deepspeed_config``.

Users who offload today write a ``ds_config.json`` with ``zero_optimization.stage`` 2 or 3 and
``offload_optimizer.device: cpu`` (or ``nvme``). The same file gives the equivalent
``offload.torch.AdamW``: the stage, where the optimizer state lives, the optimizer's
hyper-parameters, the 16-bit type and its loss scale, clipping and the bucket sizes. ``"auto"``
values are filled from the TrainingArguments as transformers' DeepSpeed integration fills them,
and every key the optimizer does not honour is named in one warning: nothing is dropped
silently. Batch sizes and accumulation are the Trainer's (TrainingArguments); a value in the
config that disagrees with the arguments is named too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Dict, List, Optional, Union

import torch

from offload.torch import Adam, AdamW

_AUTO = "auto"
# Keys that are the Trainer's (TrainingArguments'), with the argument that decides each.
_TRAINER_KEYS = {
    "train_micro_batch_size_per_gpu": lambda a: a.per_device_train_batch_size,
    "gradient_accumulation_steps": lambda a: a.gradient_accumulation_steps,
    "train_batch_size": lambda a: (a.per_device_train_batch_size * a.gradient_accumulation_steps
                                   * a.world_size),
}


@dataclasses.dataclass
class OffloadConfig:
    """What a DeepSpeed config asks of the optimizer: the class, its keyword arguments, and the
    keys not honoured (dotted paths, with why)."""
    cls: type
    kwargs: Dict[str, Any]
    not_honoured: List[str]


def _leaves(node: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(node, dict):
        out: Dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def _hidden_size(model: Any) -> Optional[int]:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if size is None and config is not None and getattr(config, "hidden_sizes", None):
        size = max(config.hidden_sizes)
    return int(size) if size else None


def read_config(config: Union[str, os.PathLike, Dict[str, Any]],
                model: Any = None, args: Any = None) -> OffloadConfig:
    """The optimizer a DeepSpeed config describes, without building it."""
    if not isinstance(config, dict):
        with open(config) as f:
            config = json.load(f)
    leaves = _leaves(config)
    used: Dict[str, str] = {}  # honoured path -> "" (or a note that goes into the warning)
    notes: List[str] = []
    kwargs: Dict[str, Any] = {}
    hidden = _hidden_size(model)

    def value(path: str, from_args: Any = None, from_model: Any = None) -> Any:
        """The key's value, "auto" resolved as transformers resolves it (None: absent or not
        resolvable, in which case the optimizer's default stays and the key is named)."""
        v = leaves.get(path)
        used[path] = ""
        if v != _AUTO:
            return v
        if args is not None and from_args is not None:
            return from_args(args)
        if from_model is not None and hidden is not None:
            return from_model(hidden)
        used[path] = "auto with nothing to fill it from (pass args=): the optimizer's default"
        return None

    stage = value("zero_optimization.stage")
    stage = 0 if stage is None else int(stage)
    if stage == 0:
        raise ValueError("zero_optimization.stage is 0 (or missing): the config asks for no "
                         "ZeRO, so there is nothing to offload; use stage 2 or 3")
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_optimization.stage={stage}: DeepSpeed has stages 0 to 3")
    if stage == 1:
        used["zero_optimization.stage"] = ("stage 1 runs as stage 2 (the gradients go to the "
                                           "servers too)")
    kwargs["zero_stage"] = 3 if stage == 3 else 2
    if stage == 3:
        kwargs["model"] = model

    device = value("zero_optimization.offload_optimizer.device")
    if device in (None, "none"):
        used.setdefault("zero_optimization.offload_optimizer.device", "")
        notes.append("zero_optimization.offload_optimizer.device is "
                     f"{device or 'absent'}: the optimizer state lives on the servers anyway")
    elif device == "cpu":
        kwargs["optimizer_state"] = "memory"
    elif device == "nvme":
        path = value("zero_optimization.offload_optimizer.nvme_path")
        if not path:
            raise ValueError("offload_optimizer.device is nvme without nvme_path")
        kwargs.update(optimizer_state="disk", state_dir=str(path))
    else:
        raise ValueError(f"zero_optimization.offload_optimizer.device={device!r}: cpu, nvme or "
                         "none")
    value("zero_optimization.offload_optimizer.pin_memory")  # host copies are pinned on a GPU

    param_device = value("zero_optimization.offload_param.device")
    if param_device is not None and param_device != "none":
        if stage != 3:
            used["zero_optimization.offload_param.device"] = "offload_param needs stage 3"
        elif param_device == "nvme":
            used["zero_optimization.offload_param.device"] = (
                "nvme: ZeRO-3's parameters stay in host memory")
        value("zero_optimization.offload_param.pin_memory")

    bucket = value("zero_optimization.reduce_bucket_size", from_model=lambda h: h * h)
    if bucket is not None:
        kwargs["bucket_elements"] = int(bucket)
    if stage == 3:
        persist = value("zero_optimization.stage3_param_persistence_threshold",
                        from_model=lambda h: 10 * h)
        if persist is not None:
            kwargs["persist_elements"] = int(persist)
        live = value("zero_optimization.stage3_max_live_parameters")
        if live is not None:
            kwargs["max_resident_bytes"] = 2 * int(live)  # 16-bit elements

    cls = AdamW
    kind = value("optimizer.type")
    if kind is not None:
        kind_name = str(kind).lower()
        if kind_name not in ("adam", "adamw"):
            raise ValueError(f"optimizer.type={kind!r}: Offload's servers run Adam and AdamW")
        adam_w_mode = value("optimizer.params.adam_w_mode")
        if kind_name == "adam" and adam_w_mode is False:
            cls = Adam  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    value("optimizer.params.torch_adam")  # the servers compute torch's form either way
    for key, arg, cast in (("lr", lambda a: a.learning_rate, float),
                           ("betas", lambda a: (a.adam_beta1, a.adam_beta2), tuple),
                           ("eps", lambda a: a.adam_epsilon, float),
                           ("weight_decay", lambda a: a.weight_decay, float)):
        v = value(f"optimizer.params.{key}", from_args=arg)
        if v is not None:
            kwargs[key] = cast(v)

    clip = value("gradient_clipping", from_args=lambda a: a.max_grad_norm)
    if clip is not None:
        kwargs["max_grad_norm"] = float(clip)

    fp16 = value("fp16.enabled", from_args=lambda a: a.fp16)
    bf16 = value("bf16.enabled", from_args=lambda a: a.bf16)
    if fp16 and bf16:
        raise ValueError("fp16.enabled and bf16.enabled are both true")
    kwargs["dtype"] = torch.float16 if fp16 else torch.bfloat16
    # DeepSpeed's bf16 optimizer states (with CPU offload: bf16 Adam moments in host memory) are
    # the servers' state_dtype; its bf16 master weights are not (the master stays fp32).
    if value("bf16.bf16_optimizer_states"):
        kwargs["state_dtype"] = torch.bfloat16
    if leaves.get("bf16.bf16_master_weights_and_grads") not in (None, False, _AUTO):
        used["bf16.bf16_master_weights_and_grads"] = (
            "the master weights stay fp32 on the servers (bf16_optimizer_states makes the "
            "moments bf16)")
    else:
        value("bf16.bf16_master_weights_and_grads")
    if fp16:
        power = value("fp16.initial_scale_power")
        if power is not None:
            kwargs["loss_scale"] = 2.0 ** int(power)
        window = value("fp16.loss_scale_window")
        if window is not None:
            kwargs["loss_scale_window"] = int(window)
        static = leaves.get("fp16.loss_scale", 0)
        if static not in (0, 0.0, _AUTO):
            used["fp16.loss_scale"] = f"a static scale ({static}): the scale is dynamic"
        else:
            value("fp16.loss_scale")

    for key, arg in _TRAINER_KEYS.items():
        if key not in leaves:
            continue
        v = value(key, from_args=arg)
        if args is None and v is not None:
            used[key] = "the Trainer's (TrainingArguments), not the optimizer's"
        elif args is not None and v is not None and int(v) != int(arg(args)):
            used[key] = f"{v} here, {arg(args)} in the TrainingArguments, which decide"

    not_honoured = [f"{path}: {why}" for path, why in used.items() if why and path in leaves]
    not_honoured += notes
    not_honoured += [f"{path}: not used by Offload" for path in leaves if path not in used]
    return OffloadConfig(cls, {k: v for k, v in kwargs.items() if v is not None}, not_honoured)


def from_deepspeed_config(config: Union[str, os.PathLike, Dict[str, Any]],
                          model: torch.nn.Module, args: Any = None, params: Any = None,
                          **offload_kwargs: Any) -> AdamW:
    """The ``offload.torch.AdamW`` (or ``Adam``) a DeepSpeed config asks for, over ``model``'s
    parameters (named, so checkpoints name them; ``params`` to give groups instead). ``args``:
    the TrainingArguments that fill ``"auto"``. ``offload_kwargs`` add to or override what the
    config gives (servers, token, ...). Keys not honoured are named in one warning.

    With the Trainer: ``Trainer(model, args, optimizers=(from_deepspeed_config(path, model,
    args), None))`` (Trainer builds the lr schedule on it); drop ``deepspeed=`` from the
    arguments."""
    read = read_config(config, model, args)
    if read.not_honoured:
        warnings.warn("DeepSpeed config keys Offload does not honour:\n  "
                      + "\n  ".join(read.not_honoured), stacklevel=2)
    kwargs = {**read.kwargs, **offload_kwargs}
    if params is None:
        params = [(n, p) for n, p in model.named_parameters()]
    return read.cls(params, **kwargs)
