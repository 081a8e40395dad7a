"""Checkpoints of ``offload.torch`` optimizers, and how to take one to plain torch.

``AdamW.save_checkpoint(path)`` writes (the C library streams it from the servers)::

    path/step-00000100/manifest.json          counters, loss scale, parameter groups, file CRCs
    path/step-00000100/master.safetensors     fp32 master weights, by parameter name
    path/step-00000100/exp_avg.safetensors    Adam's first moment, by parameter name
    path/step-00000100/exp_avg_sq.safetensors Adam's second moment, by parameter name
    path/latest                               names the newest step directory

``master.safetensors`` is the fp32 model in torch's names (any safetensors reader opens it), and
``load_into_torch`` fills a model and a ``torch.optim.AdamW`` from a checkpoint, so training can
go on without Offload.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from offload import native

__all__ = ["Manifest", "find", "find_manifest", "parse_manifest", "read_manifest",
           "read_safetensors", "load_into_torch"]

_DTYPE_NAMES = {"DTYPE_BF16": "bfloat16", "DTYPE_FP16": "float16"}


@dataclass
class Manifest:
    """What a checkpoint's manifest.json says, as the front end uses it."""

    directory: str
    dtype: Any  # torch.dtype of the weights the run computed with
    step: int  # steps completed
    adam_step: int  # updates applied (the t of bias correction)
    loss_scale: Tuple[float, int, int]  # scale, clean steps, skipped steps
    param_groups: List[Dict[str, Any]]  # hyper-parameters; "params" holds parameter names
    params: List[Tuple[str, List[int]]]  # (name, shape) in the saving run's flat order
    # Each parameter's own count of updates (torch's state["step"]) where it differs from
    # adam_step: a parameter without a gradient in some steps was not updated in them.
    param_steps: Dict[str, int]
    # Saved between two micro-batches of a step: which parameters had a gradient and how many
    # micro-batches ran (the gradient sum so far is in grad_sum.safetensors); None between steps.
    accumulated: Optional[Dict[str, Any]] = None
    # How the servers that saved it stored the Adam moments (torch.float32 or torch.bfloat16);
    # the files hold fp32 either way, bf16 moments exactly.
    state_dtype: Any = None

    def step_of(self, name: str) -> int:
        return self.param_steps.get(name, self.adam_step)


def find(path: str) -> str:
    """The checkpoint directory ``path`` names: itself when it holds a manifest.json, else the
    step directory its ``latest`` file names."""
    return native.find_checkpoint(path)


def has_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint or a root that names one (its ``latest``)."""
    return (os.path.isfile(os.path.join(path, "manifest.json")) or
            os.path.isfile(os.path.join(path, "latest")))


def parse_manifest(text: str, directory: str) -> Manifest:
    """A manifest.json's text (protobuf's JSON mapping: 64-bit integers are strings)."""
    import torch
    m = json.loads(text)
    front_end = json.loads(m.get("front_end") or "{}")
    scale = m.get("loss_scale", {})
    dtype_name = _DTYPE_NAMES.get(m.get("param_dtype"))
    if dtype_name is None:
        raise ValueError(f"{directory}/manifest.json: param_dtype is {m.get('param_dtype')}")
    return Manifest(
        directory=directory, dtype=getattr(torch, dtype_name), step=int(m.get("step", 0)),
        adam_step=int(m.get("adam_step", 0)),
        loss_scale=(float(scale.get("scale", 1.0)), int(scale.get("clean_steps", 0)),
                    int(scale.get("skipped_steps", 0))),
        param_groups=front_end.get("param_groups", []),
        params=[(p["name"], [int(d) for d in p.get("shape", [])]) for p in m.get("params", [])],
        param_steps={str(k): int(v) for k, v in front_end.get("param_steps", {}).items()},
        accumulated=front_end.get("accumulated"),
        state_dtype=torch.bfloat16 if m.get("state_dtype") == "DTYPE_BF16" else torch.float32)


def find_manifest(path: str) -> Tuple[str, str]:
    """The checkpoint directory ``path`` names, and its manifest.json's text."""
    directory = find(path)
    with open(os.path.join(directory, "manifest.json")) as f:
        return directory, f.read()


def read_manifest(path: str) -> Manifest:
    directory, text = find_manifest(path)
    return parse_manifest(text, directory)


def read_safetensors(path: str, names: Optional[List[str]] = None) -> Dict[str, Any]:
    """The fp32 tensors of a checkpoint file (all, or those named), read into memory."""
    import torch
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        start = 8 + size
        out = {}
        for name, entry in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            if entry["dtype"] != "F32":
                raise ValueError(f"{path}: tensor {name} is {entry['dtype']}, not F32")
            begin, end = entry["data_offsets"]
            t = torch.empty(entry["shape"], dtype=torch.float32)
            f.seek(start + begin)
            view = memoryview(t.numpy()).cast("B")
            if f.readinto(view) != end - begin:
                raise ValueError(f"{path}: tensor {name} is cut short")
            out[name] = t
    return out


def load_into_torch(path: str, model: Any, optimizer: Any = None) -> Manifest:
    """Continue with plain torch: the checkpoint's fp32 master weights into ``model``'s
    parameters (which become fp32), and, given a ``torch.optim.AdamW`` (or ``Adam``) built on
    ``model.parameters()`` with the same groups, its ``exp_avg``, ``exp_avg_sq``, ``step`` and
    each group's lr. The whole state is read into memory, as plain torch holds it."""
    import torch
    manifest = read_manifest(path)
    named = dict(model.named_parameters())
    missing = [n for n, _ in manifest.params if n not in named]
    if missing:
        raise ValueError(f"the model has no parameter {missing[0]!r} of checkpoint "
                         f"{manifest.directory}")
    master = read_safetensors(os.path.join(manifest.directory, "master.safetensors"))
    with torch.no_grad():
        for name, t in master.items():
            named[name].data = t.view(named[name].shape)
    if optimizer is not None:
        m = read_safetensors(os.path.join(manifest.directory, "exp_avg.safetensors"))
        v = read_safetensors(os.path.join(manifest.directory, "exp_avg_sq.safetensors"))
        for name, _ in manifest.params:
            p = named[name]
            step = manifest.step_of(name)
            if step == 0:
                continue  # never updated: torch has no state for it yet
            optimizer.state[p] = {"step": torch.tensor(float(step)),
                                  "exp_avg": m[name], "exp_avg_sq": v[name]}
        for saved, group in zip(manifest.param_groups, optimizer.param_groups):
            group["lr"] = saved["lr"]
    return manifest
