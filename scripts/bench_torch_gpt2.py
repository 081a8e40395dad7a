#!/usr/bin/env python3
"""GPU-resident PyTorch training of GPT-2 124M: the baseline bench_gpu's resident row is held to.

The same model shape and batch as bench_gpu's default (vocab 50257, context 1024, 12 layers, 12
heads, 768 channels; batch 8 x 1024 random tokens), trained as a PyTorch user would on one GPU:
Hugging Face transformers' GPT2LMHeadModel (SDPA attention, random init, nothing downloaded),
fp32 weights under bf16 autocast, and torch.optim.AdamW(fused=True) on the GPU. Times
--steps steps after --warmup with CUDA events and prints one line:

  torch model=gpt2-124m dtype=bf16 step_s=S tokens_per_s=X mfu=M peak_tflops=P compile=0|1

MFU counts the FLOPs bench_gpu counts (model_spec/gpt2_config.h, Gpt2FlopsPerToken): 6 per weight
of every matrix product (12 L C^2 + V C) plus 12 L T C for attention, per token.

Needs a CUDA GPU, torch >= 2.0 and transformers (the lent GPU machines have both):

  python3 scripts/bench_torch_gpt2.py [--steps=20] [--warmup=3] [--peak_tflops=989] [--compile]
"""
import argparse
import sys

import torch


def flops_per_token(vocab: int, layers: int, channels: int, seq_len: int) -> float:
    matmul_weights = 12 * layers * channels * channels + vocab * channels
    return 6.0 * matmul_weights + 12.0 * layers * seq_len * channels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak_tflops", type=float, default=989.0,
                        help="dense bf16 peak (989: the H100 SXM datasheet)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_torch_gpt2: no CUDA GPU", file=sys.stderr)
        return 1
    from transformers import GPT2Config, GPT2LMHeadModel  # pylint: disable=import-outside-toplevel

    vocab, context, layers, heads, channels = 50257, 1024, 12, 12, 768
    config = GPT2Config(vocab_size=vocab, n_positions=context, n_layer=layers, n_head=heads,
                        n_embd=channels, attn_implementation="sdpa")
    torch.manual_seed(1337)
    model = GPT2LMHeadModel(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0, fused=True)
    step_fn = torch.compile(model) if args.compile else model
    # (4, B, T) random tokens, used in turn: made before the clock starts.
    tokens = torch.randint(0, vocab, (4, args.batch, args.seq_len), device="cuda")

    def step(i: int) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step_fn(input_ids=tokens[i % 4], labels=tokens[(i + 1) % 4])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for i in range(args.steps):
        loss = step(i)
    end.record()
    torch.cuda.synchronize()
    step_s = begin.elapsed_time(end) / 1e3 / args.steps
    tokens_per_s = args.batch * args.seq_len / step_s
    mfu = flops_per_token(vocab, layers, channels, args.seq_len) * tokens_per_s / (
        args.peak_tflops * 1e12)
    print(f"torch model=gpt2-124m dtype=bf16 step_s={step_s:.5f} tokens_per_s={tokens_per_s:.0f} "
          f"mfu={mfu:.4f} peak_tflops={args.peak_tflops:.0f} compile={int(args.compile)} "
          f"loss={float(loss):.4f} torch={torch.__version__} "
          f"cudnn={torch.backends.cudnn.version()} "
          f"device={torch.cuda.get_device_name().replace(' ', '_')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
