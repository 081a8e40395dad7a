#!/usr/bin/env python3
"""offload.torch.AdamW trains any model as plain torch does: for each model of the set (a GPT, an
LSTM language model with tied weights, a block called twice, transformers' GPT2LMHeadModel where
transformers imports, and torchvision's ResNet-18 and a VisionTransformer where torchvision
imports), step by step in lockstep with torch's AdamW on an fp32 master copy, fed the very
gradients the model's backward left (keep_grads=True): the master weights to the bit, and the
model's 16-bit weights equal to the masters rounded, after every step.

On the CPU, and on CUDA where torch has it (scripts/gpu-check runs the OnCuda class on a lent
GPU): there the forward and backward are torch's CUDA kernels, the gradients leave through the
side stream and the pinned staging ring, and the updated weights come back by the cast on the
device. One model in lockstep rather than two runs compared: both optimizers get the same
gradients, so nothing here depends on the kernels repeating their sums (cuDNN's convolutions and
atomic adds need not).
"""

from __future__ import annotations

import os
import sys
import unittest
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload.torch as otorch  # noqa: E402
from torch_adamw_test import BETAS, EPS, LR, reference_adamw, ulps  # noqa: E402
from torch_zero3_test import CASES, DTYPES, Case  # noqa: E402

STEPS = 6


class Lockstep:
    """Runs one case on one device and dtype; the test's assertions through `test`."""

    def __init__(self, test: unittest.TestCase, case: Case, dtype: torch.dtype, device: str):
        self.test, self.case, self.dtype, self.device = test, case, dtype, device

    def run(self) -> None:
        torch.manual_seed(0)
        model = self.case.build(self.dtype).to(self.device)
        params = list(model.parameters())
        masters = [p.detach().cpu().float().clone() for p in params]
        reference = reference_adamw([{"params": masters}])
        # loss_scale 1: fp16's gradients reach both optimizers unscaled (bf16 has no scale).
        opt = otorch.AdamW(params, lr=LR, betas=BETAS, eps=EPS, dtype=self.dtype,
                           servers="inprocess", threads=1, keep_grads=True, loss_scale=1.0)
        try:
            for step in range(STEPS):
                opt.zero_grad()
                opt.backward(self.case.loss(model, step, self.dtype))
                for m, p in zip(masters, params):
                    m.grad = None if p.grad is None else p.grad.detach().cpu().float()
                reference.step()
                opt.step()
                self.test.assertFalse(opt.last_report["skipped"], f"step {step} was skipped")
                self.check_weights(params, masters, step)
            self.test.assertEqual(
                ulps(opt.master_weights(), torch.cat([m.reshape(-1) for m in masters])), 0)
        finally:
            opt.close()

    def check_weights(self, params: List[torch.nn.Parameter], masters: List[torch.Tensor],
                      step: int) -> None:
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(params, masters)):
                self.test.assertEqual(p.dtype, self.dtype)
                self.test.assertEqual(p.device.type, self.device)
                want = m.to(self.dtype).view(torch.int16)
                got = p.detach().cpu().view(torch.int16)
                self.test.assertTrue(torch.equal(got, want),
                                     f"step {step}: parameter {i} {tuple(p.shape)} differs")


class OnCpu(unittest.TestCase):

    def test_every_model_trains_as_torch_adamw_trains_it(self) -> None:
        for name, case in CASES.items():
            for dtype in DTYPES:
                with self.subTest(model=name, dtype=str(dtype)):
                    Lockstep(self, case, dtype, "cpu").run()


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device here: the models on CUDA run "
                     "where torch.cuda.is_available() (scripts/gpu-check runs this class)")
class OnCuda(unittest.TestCase):

    def test_every_model_trains_as_torch_adamw_trains_it(self) -> None:
        for name, case in CASES.items():
            for dtype in (torch.bfloat16, torch.float16):
                with self.subTest(model=name, dtype=str(dtype)):
                    Lockstep(self, case, dtype, "cuda").run()


if __name__ == "__main__":
    unittest.main()
