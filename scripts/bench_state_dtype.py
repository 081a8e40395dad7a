#!/usr/bin/env python3
"""bench_state_dtype: the servers' Adam moments in bf16 against fp32, in one run.

examples/torch_gpt.py's GPT (about 100M parameters by default: 12 layers of 832 channels) trains
on the bundled Shakespeare under offload.torch.AdamW (bf16 weights, one local
cpu_optimizer_server) three times from the same initialisation on the same batches:
  fp32     state_dtype=None: fp32 master weights and moments, 12 bytes a parameter;
  bf16-sr  state_dtype=torch.bfloat16: fp32 master, bf16 moments stored with stochastic rounding;
  bf16-rn  the same, rounded to nearest even.
It prints the training loss every --every steps for each (the loss curve), the mean over the last
quarter of the steps and its gap to fp32's, the median step time, and the local server's
anonymous memory (RssAnon: the state, its allocator and buffers; the gradients arrive through
shared memory, which is not anonymous) per parameter after the first step.

    PYTHONPATH=python /usr/bin/python3 scripts/bench_state_dtype.py [--steps 60 --every 5]
        [--layers 12 --channels 832 --heads 13 --batch 4 --seq 128] [--variants fp32,bf16-sr]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import offload.torch as otorch  # noqa: E402
from bench_torch_offload import rss_anon  # noqa: E402
from torch_gpt import DATA, GPT  # noqa: E402

VARIANTS = {"fp32": dict(state_dtype=None),
            "bf16-sr": dict(state_dtype=torch.bfloat16, state_rounding="stochastic"),
            "bf16-rn": dict(state_dtype=torch.bfloat16, state_rounding="nearest")}


def train(variant: str, args: argparse.Namespace, data: torch.Tensor) -> Dict[str, object]:
    torch.manual_seed(args.seed)
    model = GPT(vocab=256, context=args.seq, layers=args.layers, heads=args.heads,
                channels=args.channels)
    num_params = sum(p.numel() for p in model.parameters())
    opt = otorch.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, **VARIANTS[variant])
    batches = torch.Generator().manual_seed(args.seed)
    losses: List[float] = []
    times: List[float] = []
    memory = 0
    try:
        for step in range(args.steps):
            starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=batches)
            x = torch.stack([data[s:s + args.seq] for s in starts.tolist()])
            y = torch.stack([data[s + 1:s + 1 + args.seq] for s in starts.tolist()])
            t = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x).float().view(-1, 256), y.view(-1))
            opt.backward(loss)
            opt.step()
            times.append(time.perf_counter() - t)
            losses.append(float(loss))
            if step == 0:
                memory = rss_anon(opt._server.pid)
    finally:
        opt.close()
    return dict(losses=losses, step_s=statistics.median(times[1:] or times),
                bytes_per_param=memory / num_params, num_params=num_params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--channels", type=int, default=832)
    ap.add_argument("--heads", type=int, default=13)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--variants", default="fp32,bf16-sr,bf16-rn")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: {v} is none of {', '.join(VARIANTS)}")
    data = torch.tensor(list(open(DATA, "rb").read()), dtype=torch.long)
    results = {}
    for v in variants:
        results[v] = train(v, args, data)
        r = results[v]
        print(f"# {v}: {r['num_params'] / 1e6:.1f}M params, median step {r['step_s']:.3f} s, "
              f"server RssAnon {r['bytes_per_param']:.2f} bytes/param", flush=True)

    print(f"\nloss every {args.every} steps (same initialisation and batches; torch threads "
          f"{torch.get_num_threads()})")
    print(f"{'step':>6} " + " ".join(f"{v:>9}" for v in variants))
    for s in range(0, args.steps, args.every):
        print(f"{s + 1:>6} " + " ".join(f"{results[v]['losses'][s]:9.4f}" for v in variants))
    tail = max(1, args.steps // 4)
    base = statistics.mean(results[variants[0]]["losses"][-tail:])
    print(f"\n{'variant':<9} {'last-quarter mean loss':>22} {'vs ' + variants[0]:>9} "
          f"{'step_s':>8} {'server bytes/param':>19}")
    for v in variants:
        r = results[v]
        mean = statistics.mean(r["losses"][-tail:])
        print(f"{v:<9} {mean:22.4f} {mean - base:+9.4f} {r['step_s']:8.3f} "
              f"{r['bytes_per_param']:19.2f}")


if __name__ == "__main__":
    main()
