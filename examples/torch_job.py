#!/usr/bin/env python3
"""A PyTorch training script as a job on the optimizer-server pool (README, "PyTorch scripts as
jobs"): submitted with a JobSpec whose ``torch.command`` runs it, e.g.

    {"name": "torch-demo",
     "torch": {"command": ["python3", "/opt/offload/examples/torch_job.py", "--steps=300"]},
     "parallel": {"ranks": 1, "optimizer_servers": 1},
     "checkpoint": {"dir": "/var/lib/offload/checkpoints/torch-demo"}, "max_restarts": 3}

Nothing in it names a server, a token or a job: ``offload.torch.AdamW`` reads them from the
environment the pool worker sets, ``opt.load_checkpoint()`` resumes a restarted attempt from the
job's checkpoint directory (and returns None on the first attempt), and ``offload.report`` sends
the step and loss to the job's status and metrics. Run by hand it trains against a server of its
own. With several ranks it meets the others through torch.distributed (gloo) and each rank
trains on its own slice of every batch.

Each step's batch is drawn from a generator seeded by the step (and rank), so an attempt that
resumes from step S sees the batches the uninterrupted run saw from S on, and ends with the same
weights, byte for byte (tests/torch_job_test.sh checks it after kill -9 of a server and of the
script).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import offload
import offload.torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--checkpoint_every", type=int, default=20)
    parser.add_argument("--step_seconds", type=float, default=0.0,
                        help="sleep this long each step (tests use it to kill mid-run)")
    parser.add_argument("--out", default="",
                        help="rank 0 writes the final 16-bit weights here (safetensors)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE: the job's. Since offload is imported, the
        # rendezvous store answers only this attempt's ranks (offload.rendezvous).
        dist.init_process_group("gloo")

    torch.manual_seed(0)  # every rank, every attempt: the same initial model
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, 8))
    opt = offload.torch.AdamW(model.named_parameters(), lr=args.lr, dtype=torch.bfloat16)
    resumed = opt.load_checkpoint()  # the job's directory; None on a first attempt
    start = opt.completed_steps
    if rank == 0:
        print(f"torch_job: {'resumed from ' + resumed if resumed else 'fresh start'} at step "
              f"{start} of {args.steps}, {world} rank(s), servers {opt.transport}", flush=True)

    loss = torch.zeros(())
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000003 * step + rank)
        x = torch.randn(args.batch, 64, generator=g).to(torch.bfloat16)
        y = torch.randn(args.batch, 8, generator=g).to(torch.bfloat16)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        offload.report(step=step + 1, loss=loss.item(), tokens=args.batch,
                       total_steps=args.steps)
        if args.checkpoint_every > 0 and (step + 1) % args.checkpoint_every == 0 and \
                offload.job.checkpoint_dir():
            opt.save_checkpoint()
        if args.step_seconds > 0:
            time.sleep(args.step_seconds)

    if offload.job.checkpoint_dir():
        opt.save_checkpoint()
    if rank == 0:
        print(f"torch_job: done at step {opt.completed_steps}, loss {loss.item():.4f}", flush=True)
        if args.out:
            offload.torch.save_safetensors(model, args.out)
    opt.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
