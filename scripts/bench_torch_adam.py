#!/usr/bin/python3
"""Times torch.optim.AdamW (foreach=True) on CPU, the baseline of ARCHITECTURE.md section 9.

Same sizes as bench_adam (fp32 params and fp32 grads, n default 64M), at 1 thread and at all
cores (torch.set_num_threads). Reports the best of --iters steps after one warm-up step, one line
per thread count:

  torch_adamw foreach=1 threads=T n=N gparams_per_s=X

Run with Debian's python3-torch (torch 1.13), not another python3 on PATH:

  /usr/bin/python3 scripts/bench_torch_adam.py [--n=67108864] [--iters=3] [--threads=1,2]
"""
import argparse
import os
import time

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1 << 26)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", default="1,%d" % os.cpu_count(),
                        help="comma-separated thread counts")
    args = parser.parse_args()
    threads = sorted({int(t) for t in args.threads.split(",") if t})

    torch.manual_seed(0)
    for t in threads:
        torch.set_num_threads(t)
        param = torch.nn.Parameter(torch.randn(args.n, dtype=torch.float32))
        param.grad = torch.randn(args.n, dtype=torch.float32) * 1e-2
        opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.01, foreach=True)
        opt.step()  # warm-up: allocates exp_avg / exp_avg_sq
        best = float("inf")
        for _ in range(args.iters):
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
        print("torch_adamw foreach=1 threads=%d n=%d gparams_per_s=%.4f"
              % (torch.get_num_threads(), args.n, args.n / best / 1e9), flush=True)
        del opt, param


if __name__ == "__main__":
    main()
