#!/usr/bin/env python3
"""A PyTorch model larger than torch can train on this machine, through offload.torch.AdamW with
its optimizer state on the local server's disk tier (what scripts/torch-disk-tier-run runs).

The model, a GPT-like stack of about 2.5B parameters (d = 2560, 32 blocks of attention-shaped and
MLP matrices), is built on the meta device and given values module by module by
offload.torch.materialize: each module is allocated in fp32, initialized, streamed to the server
and cast to bf16, so the process never holds the fp32 model (10 GB). The server keeps the fp32
master weights and both moments (30 GB) in files under --state_dir, streamed through a small ring
with io_uring. torch.optim.AdamW would need 16 bytes a parameter in memory: 40 GB.

Printed: the parameters, the set-up and each step's seconds, and the peak memory of the training
process and of the server with shared pages counted once (the shared-memory segment between the
two is mapped by both), against the bound 6 B/parameter (the 16-bit weights, the segment's
gradient and weight areas) + the ring + 2 GiB. Exits 1 when a step fails or the peak is over.

On the CPU the blocks compute in fp32 on their bf16 weights one matrix at a time (cpu16.linear),
so no fp32 copy of the model lives across a step (torch 1.13 has no fast bf16 matmul on the CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.torch as otorch  # noqa: E402
from cpu16 import linear, rollup, status  # noqa: E402


class Block(torch.nn.Module):
    """The parameter shapes of a GPT block (qkv, projection, MLP up and down, two norms); the
    computation keeps only what a memory test needs: every matrix used once, a residual."""

    def __init__(self, d: int, device: torch.device) -> None:
        super().__init__()
        kw = dict(device=device, bias=False)
        self.ln1 = torch.nn.LayerNorm(d, device=device)
        self.qkv = torch.nn.Linear(d, 3 * d, **kw)
        self.proj = torch.nn.Linear(d, d, **kw)
        self.ln2 = torch.nn.LayerNorm(d, device=device)
        self.up = torch.nn.Linear(d, 4 * d, **kw)
        self.down = torch.nn.Linear(4 * d, d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        d = x.shape[-1]
        h = F.layer_norm(x, (d,), self.ln1.weight.float(), self.ln1.bias.float())
        q, k, v = linear(h, self.qkv.weight).split(d, dim=-1)
        att = torch.softmax((q @ k.transpose(-1, -2)) / d ** 0.5, dim=-1) @ v
        x = x + linear(att, self.proj.weight)
        h = F.layer_norm(x, (d,), self.ln2.weight.float(), self.ln2.bias.float())
        return x + linear(F.gelu(linear(h, self.up.weight)), self.down.weight)


class Model(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, device: torch.device) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d, device=device)
        self.blocks = torch.nn.ModuleList(Block(d, device) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(tokens, self.emb.weight).float()
        for block in self.blocks:
            x = block(x)
        return linear(x, self.head.weight)


class Peak:
    """The peak of the two processes' memory with the shared segment counted once (each one's
    anonymous memory plus the shared pages once), sampled twice a second on a thread of its own
    and at the calls to sample()."""

    def __init__(self, server_pid: int) -> None:
        import threading
        self.server_pid = server_pid
        self.peak = 0
        self.at = "set-up"
        self.where = "set-up"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.sample(self.where)
            except OSError:
                return

    def sample(self, where: str) -> int:
        me, server = rollup(os.getpid()), rollup(self.server_pid)
        shared = max(me["Shared"], server["Shared"])
        total = me.get("Anonymous", 0) + server.get("Anonymous", 0) + shared
        if total > self.peak:
            self.peak, self.at = total, where
        return total

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d", type=int, default=2560)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--state_dir", default="")
    ap.add_argument("--state_memory_mib", type=int, default=192)
    args = ap.parse_args()

    vocab = 256
    state_dir = args.state_dir or tempfile.mkdtemp(prefix="torch-disk-tier-")
    torch.manual_seed(0)
    model = Model(vocab, args.d, args.layers, torch.device("meta"))
    n = sum(p.numel() for p in model.parameters())
    need = 16 * n  # the state (12 B/param) and the initial load's staging of the master weights
    free = shutil.disk_usage(state_dir).free
    print(f"torch-disk-tier-run: {n / 1e6:,.1f}M parameters ({args.layers} blocks, d={args.d}); "
          f"state on disk {12 * n / 1e9:.1f} GB under {state_dir} ({free / 1e9:.0f} GB free); "
          f"torch.optim.AdamW would hold {16 * n / 1e9:.0f} GB", flush=True)
    if free < need:
        print(f"torch-disk-tier-run: needs {need / 1e9:.0f} GB free under {state_dir}")
        return 1
    begin = time.monotonic()
    # The shared-memory segment (the gradient and the weight areas, 2 bytes a parameter each) and
    # the ring count in the server's memory budget; the state does not.
    memory_mib = (4 * n >> 20) + args.state_memory_mib + 1024
    opt = otorch.materialize(model, lr=1e-5, weight_decay=0.1, max_grad_norm=1.0, state_dir=state_dir,
                             optimizer_state="disk", server_memory_mib=memory_mib,
                             bucket_elements=1 << 24)
    peak = Peak(opt._server.pid)
    peak.sample("set-up")
    print(f"torch-disk-tier-run: materialized and loaded in {time.monotonic() - begin:.0f} s",
          flush=True)
    ok = True
    for step in range(args.steps):
        t0 = time.monotonic()
        # One batch again and again: its loss falls when the steps really train the model.
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (1, args.tokens + 1), generator=g)
        peak.where = f"step {step + 1}"
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.backward(loss)
        peak.sample(f"step {step + 1} after backward")
        held = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                   if p.grad is not None)
        opt.step()
        peak.sample(f"step {step + 1}")
        report = opt.last_report or {}
        print(f"torch-disk-tier-run: step {step + 1}: loss {loss.item():.4f}, "
              f"{time.monotonic() - t0:.1f} s, grad norm {report.get('grad_norm', 0):.3f}, "
              f"gradients held after backward {held / n:.3f} B/param", flush=True)
        ok = ok and not report.get("skipped", 1)
    peak.stop()
    me, server = status(), status(opt._server.pid)
    # Each VmHWM counts the segment's pages it touched; once is enough: a bound on the true peak.
    both = me["VmHWM"] + server["VmHWM"] - min(me.get("RssShmem", 0), server.get("RssShmem", 0))
    bound = 6 * n + (args.state_memory_mib << 20) + (2 << 30)
    print(f"torch-disk-tier-run: peak of both processes, shared pages once: sampled "
          f"{peak.peak / 2**30:.2f} GiB ({peak.at}); from the high-water marks at most "
          f"{both / 2**30:.2f} GiB (training process {me['VmHWM'] / 2**30:.2f} GiB, server "
          f"{server['VmHWM'] / 2**30:.2f} GiB, segment {me.get('RssShmem', 0) / 2**30:.2f} GiB "
          f"counted once); bound 6 B/param + ring + 2 GiB = {bound / 2**30:.2f} GiB: "
          f"{'within' if both <= bound else 'OVER'}")
    opt.close()
    if not args.state_dir:
        shutil.rmtree(state_dir, ignore_errors=True)
    return 0 if ok and both <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
