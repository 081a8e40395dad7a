"""What the PyTorch memory scripts share (bench_torch_memory.py, torch_disk_tier_run.py): a linear
layer that computes in fp32 on 16-bit weights without keeping an fp32 copy of them, and readers of
a process's memory figures in /proc.

torch 1.13 has no fast bf16 matmul on the CPU, so a model with 16-bit weights computes in fp32
here. ``F.linear(x, w.float())`` would do, but autograd then saves the fp32 copy of every weight
for backward: the whole model once more in fp32 (4 bytes a parameter) across each step, which is
not what a GPU holds. ``linear`` casts one matrix at a time, in forward and again in backward, and
saves only the input and the 16-bit weight.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch


class _Linear16(torch.autograd.Function):
    """x @ w^T + b on a 16-bit w (and b), computed in fp32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor,  # type: ignore[override]
                b: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        y = x @ w.float().t()
        return y + b.float() if b is not None else y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = g @ w.float()
        grad_w = (g2.t() @ x2).to(w.dtype)
        grad_b = g2.sum(0).to(w.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear for any weight dtype: fp32 weights (and CUDA) as torch does it, 16-bit weights on
    the CPU in fp32 one matrix at a time."""
    if w.dtype == torch.float32 or w.is_cuda:
        return torch.nn.functional.linear(x.to(w.dtype), w, b)
    return _Linear16.apply(x.float(), w, b)


def kib_fields(path: str) -> Dict[str, int]:
    """The "Name: N kB" lines of a /proc file (status, smaps_rollup), in bytes."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def status(pid: Any = "self") -> Dict[str, int]:
    """/proc/PID/status: VmRSS, VmHWM, RssAnon, RssShmem, ..."""
    return kib_fields(f"/proc/{pid}/status")


def rollup(pid: Any = "self") -> Dict[str, int]:
    """/proc/PID/smaps_rollup: Rss, Pss (shared pages divided among their mappers), Anonymous,
    Shared_* (and Shared, their sum)."""
    out = kib_fields(f"/proc/{pid}/smaps_rollup")
    out["Shared"] = out.get("Shared_Clean", 0) + out.get("Shared_Dirty", 0)
    return out
