#!/usr/bin/env python3
"""Bring your own PyTorch model: a GPT trained on the bundled Shakespeare with its optimizer state
on Offload's optimizer servers. The only change to a plain torch training loop is the optimizer:

    opt = offload.torch.AdamW(model.parameters(), lr=..., weight_decay=...)

which starts a local cpu_optimizer_server (fp32 master weights and Adam moments there, SIMD Adam,
shared memory between the two processes), casts the model to bf16 in place, sends the gradients
while backward runs and writes the updated weights back into the model at step().

Run from the repository after ./scripts/build:
    PYTHONPATH=python /usr/bin/python3 examples/torch_gpt.py [--steps 200] [--hf] [--device cuda]

--hf trains transformers' GPT2LMHeadModel (when that package is installed) instead of the GPT
defined below. On a machine whose torch sees a GPU the model runs there (--device auto).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import offload.torch  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tinyshakespeare.txt")


class Block(nn.Module):
    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(channels)
        self.attn = nn.MultiheadAttention(channels, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(channels)
        self.mlp = nn.Sequential(nn.Linear(channels, 4 * channels), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * channels, channels))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A plain GPT-2-shaped model: (B, T) bytes -> (B, T, vocab) logits."""

    def __init__(self, vocab: int = 256, context: int = 128, layers: int = 4, heads: int = 4,
                 channels: int = 128):
        super().__init__()
        self.wte = nn.Embedding(vocab, channels)
        self.wpe = nn.Embedding(context, channels)
        self.blocks = nn.ModuleList(Block(channels, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        # GPT-2's: N(0, 0.02) weights, zero biases (torch's N(0, 1) embeddings start far off).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        mask = torch.triu(torch.full((T, T), float("-inf"), device=idx.device), 1).to(x.dtype)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))  # (B, T, V)


def progress(step: int, steps: int, loss: float, tokens_per_s: float) -> None:
    width = 30
    done = int(width * step / steps)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{steps} "
                     f"loss {loss:.4f} {tokens_per_s:,.0f} tok/s")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--hf", action="store_true", help="transformers' GPT2LMHeadModel")
    ap.add_argument("--servers", default="", help="host:port,... of running servers "
                    "($OFFLOAD_TOKEN); empty: a local one")
    ap.add_argument("--sample", type=int, default=200, help="bytes to sample at the end")
    ap.add_argument("--optimizer", choices=["offload", "torch"], default="offload",
                    help="torch: the baseline, torch.optim.AdamW on the model itself (fp32 "
                    "parameters under bf16 autocast on CUDA, fused there)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--micro_batches", type=int, default=1,
                    help="backward() calls per step, each on batch / micro_batches sequences")
    ap.add_argument("--delay_update", action="store_true",
                    help="offload: the delayed parameter update (after 20 ordinary steps)")
    ap.add_argument("--update_in_backward", action="store_true",
                    help="offload: the servers update each bucket during backward")
    ap.add_argument("--zero_stage", type=int, choices=[2, 3], default=2,
                    help="offload: 3 keeps the 16-bit weights in host memory; they visit the "
                    "device --window blocks at a time")
    ap.add_argument("--window", type=int, default=2, help="--zero_stage 3: blocks on the device")
    args = ap.parse_args()
    if args.micro_batches < 1 or args.batch % args.micro_batches:
        ap.error(f"--batch {args.batch} does not split into {args.micro_batches} micro-batches")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    torch.manual_seed(0)

    data = torch.tensor(list(open(DATA, "rb").read()), dtype=torch.long)
    split = int(len(data) * 0.9)
    train, val = data[:split], data[split:]

    if args.hf:
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=256, n_positions=args.seq, n_layer=args.layers,
                         n_head=args.channels // 32, n_embd=args.channels)
        hf = GPT2LMHeadModel(cfg)
        if args.zero_stage == 2 or args.optimizer != "offload":
            hf = hf.to(device)  # ZeRO-3 leaves it on the host (and moves its buffers)
        model: nn.Module = hf
        forward = lambda idx: hf(idx).logits  # noqa: E731
    else:
        model = GPT(context=args.seq, layers=args.layers, heads=args.channels // 32,
                    channels=args.channels)
        if args.zero_stage == 2 or args.optimizer != "offload":
            model = model.to(device)  # ZeRO-3 leaves it where it was built: the host
        forward = model
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    servers = args.servers.split(",") if args.servers else None
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer == "offload":
        stage3 = (dict(zero_stage=3, model=model, window=args.window, device=device)
                  if args.zero_stage == 3 else {})
        opt = offload.torch.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), dtype=dtype,
                                  servers=servers, max_grad_norm=1.0,
                                  delay_update=args.delay_update,
                                  update_in_backward=args.update_in_backward, **stage3)
        where = f"{opt.transport} ({'local server' if servers is None else servers})"
        if args.zero_stage == 3:
            where += (f"; ZeRO-3, {len(opt.param_window.blocks)} blocks, {args.window} at a "
                      "time on the device")
    else:
        extra = {"fused": True} if device.type == "cuda" and torch.__version__ >= "2" else {}
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), **extra)
        where = f"torch.optim.AdamW{' (fused)' if extra else ''} in this process"
    autocast = (torch.autocast(device.type, dtype=dtype) if args.optimizer == "torch"
                else contextlib.nullcontext())
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    print(f"{'HF GPT2LMHeadModel' if args.hf else 'GPT'}: {n_params:,} parameters on {device}, "
          f"{args.dtype}; optimizer state: {where}")

    def batch(source: torch.Tensor, g: torch.Generator) -> tuple:
        ix = torch.randint(len(source) - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([source[i:i + args.seq] for i in ix])
        y = torch.stack([source[i + 1:i + 1 + args.seq] for i in ix])
        return x.to(device), y.to(device)

    g = torch.Generator().manual_seed(1)
    start = time.time()
    step_times = []
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        x, y = batch(train, g)
        opt.zero_grad()
        value = 0.0
        for xm, ym in zip(x.chunk(args.micro_batches), y.chunk(args.micro_batches)):
            with autocast:
                logits = forward(xm)
            # The mean over the micro-batches: the optimizer sums their gradients, as torch does.
            loss = F.cross_entropy(logits.float().view(-1, 256), ym.view(-1)) / args.micro_batches
            if args.optimizer == "offload":
                opt.backward(loss)  # loss.backward() at the loss scale (1 for bf16)
            else:
                loss.backward()
            value += loss.item()  # waits for the GPU: the step's time is its own
        if args.optimizer == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step_times.append(time.perf_counter() - t)
        progress(step, args.steps, value, step * args.batch * args.seq / (time.time() - start))
    print()
    if args.optimizer == "offload":
        opt.flush()  # the delayed update in flight, into the model
    with torch.no_grad():
        gv = torch.Generator().manual_seed(2)
        losses = [F.cross_entropy(forward(x).float().view(-1, 256), y.view(-1)).item()
                  for x, y in (batch(val, gv) for _ in range(8))]
        val_loss = sum(losses) / len(losses)
        print(f"val loss {val_loss:.4f}")
        timed = sorted(step_times[len(step_times) // 4:]) or [0.0]  # past the warm-up
        print(f"torch_gpt optimizer={args.optimizer} model={'hf' if args.hf else 'gpt'} "
              f"device={device.type} params={n_params} "
              f"batch={args.batch}x{args.seq} micro_batches={args.micro_batches} "
              f"dpu={int(args.delay_update)} uib={int(args.update_in_backward)} "
              f"zero_stage={args.zero_stage} dtype={args.dtype} "
              + (f"window={args.window} param_bytes_peak={opt.param_window.peak_resident_bytes} "
                 f"param_bytes_all={2 * n_params} "
                 if args.optimizer == "offload" and args.zero_stage == 3 else "") +
              f"step_s={timed[len(timed) // 2]:.4f} val_loss={val_loss:.4f}")
        idx = data[:args.seq // 2].view(1, -1).to(device)
        for _ in range(args.sample):
            logits = forward(idx[:, -args.seq:])[0, -1].float()
            nxt = torch.multinomial(F.softmax(logits / 0.8, dim=-1), 1, generator=None)
            idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
        print("sample:\n" + bytes(idx[0, args.seq // 2:].tolist()).decode("utf-8", "replace"))
    if args.optimizer == "offload":
        opt.close()


if __name__ == "__main__":
    main()
