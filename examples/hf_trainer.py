#!/usr/bin/env python3
"""Hugging Face's Trainer with Offload: a GPT-2 (or Llama) trains on the bundled Shakespeare, its
optimizer state on Offload's optimizer servers. The one changed line of a Trainer script:

    from offload.hf import Trainer          # instead of: from transformers import Trainer

Trainer's own progress bar and logs (with the optimizer's figures), its clipping, accumulation,
warm-up, checkpoints and evaluation work as they do with torch's AdamW. At the end it prints what
the training process held per parameter: the 16-bit weights, the gradients left in ``p.grad``
after backward, and the device's peak (CUDA) or this process's anonymous memory (CPU).
``--optimizer torch`` runs the same script with transformers' own Trainer and torch's AdamW on
the fp32 model, for comparison.

Run from the repository after ./scripts/build, with the torch 2 venv it makes (transformers and
accelerate), or after ``pip install 'offload[hf]'``:
    PYTHONPATH=python build/torch2-venv/bin/python examples/hf_trainer.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import transformers  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from offload.hf import Trainer  # noqa: E402  (the one line)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tinyshakespeare.txt")


class Shakespeare(torch.utils.data.Dataset):
    """Windows of the bundled text as bytes: (seq,) input_ids, the labels the same (the model
    shifts them)."""

    def __init__(self, text: torch.Tensor, seq: int, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.text, self.seq = text, seq
        self.starts = torch.randint(0, len(text) - seq, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = self.text[self.starts[i]:self.starts[i] + self.seq]
        return {"input_ids": ids, "labels": ids}


def anon_bytes() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["RssAnon"].split()[0]) * 1024


class MemoryPerParameter(TrainerCallback):
    """After each step's backward, before the optimizer's step: what the process holds."""

    def __init__(self, model: torch.nn.Module, anon_before_model: int) -> None:
        self.model, self.anon_before = model, anon_before_model
        self.n = sum(p.numel() for p in model.parameters())
        self.grads = self.weights = self.state = self.anon = 0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        params = list(self.model.parameters())
        self.grads = max(self.grads, sum(p.grad.nbytes for p in params if p.grad is not None))
        self.weights = sum(p.nbytes for p in params)
        self.anon = max(self.anon, anon_bytes() - self.anon_before)

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                    **kwargs: Any) -> None:
        tensors = [t for s in optimizer.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
        self.state = sum(t.nbytes for t in tensors)

    def report(self) -> str:
        rows = [("16-bit weights" if self.weights < 3 * self.n else "weights", self.weights),
                ("gradients in p.grad after backward", self.grads),
                ("optimizer state in this process", self.state)]
        if torch.cuda.is_available():
            rows.append(("device peak (max_memory_allocated)", torch.cuda.max_memory_allocated()))
        else:  # the device's stand-in: what the process gained since before the model
            rows.append(("process RssAnon since before the model", self.anon))
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"  {name:<{width}}  {b / self.n:8.2f} bytes a parameter"
                         for name, b in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--optimizer", choices=["offload", "torch"], default="offload")
    ap.add_argument("--out", default="", help="Trainer's output_dir (default: a temporary one)")
    args = ap.parse_args()
    torch.manual_seed(0)
    anon_before_model = anon_bytes()
    text = torch.tensor(list(open(DATA, "rb").read()), dtype=torch.long)
    split = int(len(text) * 0.9)
    seq = 128
    if args.model == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=seq, n_embd=256, n_layer=4, n_head=4,
            bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0))
    cuda = torch.cuda.is_available()
    out = args.out or tempfile.mkdtemp(prefix="offload-hf-example-")
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=2e-3, weight_decay=0.1, warmup_steps=10,
        lr_scheduler_type="cosine", max_grad_norm=1.0, bf16=True, use_cpu=not cuda,
        logging_steps=10, save_steps=max(args.steps // 2, 1), save_total_limit=1,
        eval_strategy="steps", eval_steps=max(args.steps // 2, 1), per_device_eval_batch_size=8,
        report_to=[], dataloader_num_workers=0)
    memory = MemoryPerParameter(model, anon_before_model)
    cls = Trainer if args.optimizer == "offload" else transformers.Trainer
    trainer = cls(model=model, args=training, callbacks=[memory],
                  train_dataset=Shakespeare(text[:split], seq, 16 * args.steps, seed=1),
                  eval_dataset=Shakespeare(text[split:], seq, 64, seed=2))
    trainer.train()
    n = memory.n
    print(f"\n{type(model).__name__}, {n / 1e6:.1f}M parameters, {args.optimizer} optimizer, "
          f"checkpoints in {out}")
    print(memory.report())
    opt = getattr(trainer, "offload_optimizer", None)
    if opt is not None:
        print(f"  optimizer state: on the server ({opt.transport}), "
              f"{opt.completed_steps} steps, {opt.skipped_steps} skipped")
        opt.close()


if __name__ == "__main__":
    main()
