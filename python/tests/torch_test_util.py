"""What the python/ tests share: a tiny model that computes in fp32 on 16-bit weights, and whether
a process is alive."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch


class TinyNet(torch.nn.Module):
    """(B, T) tokens -> (B, T, vocab) logits: an embedding and two linears. It computes in fp32 on
    its 16-bit weights (CPU torch 1.13 has no fp16 matmul), as the C++ CPU backend does, so the
    gradients reach the parameters rounded to their 16-bit type."""

    def __init__(self, vocab: int, width: int, hidden: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = torch.tanh,
                 device: Any = None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width, device=device)
        self.fc1 = torch.nn.Linear(width, hidden, device=device)
        self.fc2 = torch.nn.Linear(hidden, vocab, device=device)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        h = F.linear(F.embedding(x, self.emb.weight.float()), self.fc1.weight.float(),
                     self.fc1.bias.float())
        return F.linear(self.activation(h), self.fc2.weight.float(), self.fc2.bias.float())


class Block(torch.nn.Module):
    """(B, T, C) -> (B, T, C): a pre-norm residual MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 2 * width)
        self.proj = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class SharedBlockModel(torch.nn.Module):
    """(B, T) tokens -> (B, T, vocab): blocks in a ModuleList, the first called twice in one
    forward (a shared block); ``order`` picks the blocks' order per call (data-dependent
    control flow)."""

    def __init__(self, vocab: int = 40, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, vocab)
        self.order: Optional[List[int]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for k in (self.order if self.order is not None else [0, 1, 0, 2]):
            h = self.blocks[k](h)
        return self.head(h)


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
