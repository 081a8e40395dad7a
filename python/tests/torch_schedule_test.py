"""offload.torch.AdamW / Adam against plain torch with hyper-parameters that fp32 cannot hold and
an lr that changes every step (run by CTest as `torch_schedule_test`).

betas (0.9, 0.95), lr 3e-4 from a LambdaLR warm-up (5 steps) and cosine decay, weight decay 0.1,
eps 1e-8, bf16, 20 steps. torch computes each step's scalars from Python doubles and rounds each
once into its fp32 op; the servers take the same doubles and do the same (ARCHITECTURE.md section
5), so the master weights must match to the bit:

- torch 1.13: against torch.optim.AdamW / Adam themselves (foreach=False).
- torch 2.x: against ContractAdamW, torch 2.x's single-tensor update (exp_avg.lerp_) written out
  in plain torch with an IEEE sqrt, and, for AdamW, against torch 2.x's own torch.optim.AdamW
  within a bound derived from its sqrt: its CPU sqrt is not correctly rounded (measured here, up
  to 1 ulp), which moves the denominator and so each update by that relative amount.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import unittest
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.torch as otorch  # noqa: E402
from torch_adamw_test import TORCH2, ContractAdamW, OddNet, loss_of, ulps  # noqa: E402

LR = 3e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WD = 0.1
WARMUP = 5
STEPS = 20
U = 2.0 ** -24  # unit roundoff of fp32


def lr_lambda(step: int) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to 0 at STEPS."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1.0 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def groups_of(model: torch.nn.Module, params: Optional[List[torch.Tensor]] = None) -> List[dict]:
    """Matrices with weight decay, biases and norms without: two groups, so two group lrs."""
    named = list(model.named_parameters())
    ps = params if params is not None else [p for _, p in named]
    return [{"params": [p for (_, q), p in zip(named, ps) if q.dim() >= 2], "weight_decay": WD},
            {"params": [p for (_, q), p in zip(named, ps) if q.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(cls, params: List[dict], lerp: bool):
    """The installed torch's single-tensor Adam / AdamW (torch 1.13), or the written-out 2.x
    form with an IEEE sqrt (lerp)."""
    decoupled = cls is torch.optim.AdamW
    if lerp:
        return ContractAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, lerp=True,
                             decoupled=decoupled)
    return cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)


def ieee_sqrt(t: torch.Tensor) -> torch.Tensor:
    return t.double().sqrt().float()  # exact in double, then one rounding


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of fp32 at |x|, as float64."""
    a = x.float().abs()
    return (torch.nextafter(a, torch.tensor(math.inf)) - a).double()


class Reference:
    """Plain torch: a bf16 model computing in fp32, fp32 masters holding the bf16 gradients, the
    reference optimizer on the masters. With `own`, torch's own optimizer also runs on a second
    copy of the masters, fed the same gradients (so the two differ only by the update's
    rounding), and `bound` accumulates how far apart they may drift (see step)."""

    def __init__(self, model: torch.nn.Module, cls, lerp: bool, own: bool = False):
        self.model = model
        self.masters = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        self.opt = make_optimizer(cls, groups_of(model, self.masters), lerp)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.own_masters = self.own = None
        if own:
            self.own_masters = [m.clone() for m in self.masters]
            self.own = cls(groups_of(model, self.own_masters), lr=LR, betas=BETAS, eps=EPS,
                           weight_decay=WD, foreach=False)
            self.own_sched = torch.optim.lr_scheduler.LambdaLR(self.own, lr_lambda)
            self.bound = [torch.zeros(m.shape, dtype=torch.float64) for m in self.masters]
            self.sqrt_rel = 0.0  # largest |torch sqrt - IEEE sqrt| / IEEE sqrt seen

    def step(self, step: int) -> None:
        for p in self.model.parameters():
            p.grad = None
        loss_of(self.model, step).backward()
        grads = [p.grad.float() for p in self.model.parameters()]
        for m, g in zip(self.masters, grads):
            m.grad = g.clone()
        self.opt.step()
        self.sched.step()
        if self.own is not None:
            self.own_step(step, grads)
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)

    def own_step(self, step: int, grads: List[torch.Tensor]) -> None:
        """torch's own AdamW on the same gradients. Its m and v are then the reference's to the
        bit (they do not depend on the weights in AdamW); only denom = sqrt(v) / bc2 + eps
        differs, by the sqrt's relative error rho (measured on this step's v). That moves
        denom by at most rho + 2u after its two roundings, and the update u_t = step_size *
        m / denom by rho + 4u after the division (each rounding may go either way: 2u between
        the two runs per operation). Each step adds |u_t| * (rho + 4u) plus one ulp for each of
        the decay and the add, whose roundings may differ; the decay (< 1) shrinks what was
        there."""
        lr = self.own.param_groups[0]["lr"]
        for m, g in zip(self.own_masters, grads):
            m.grad = g.clone()
        self.own.step()
        self.own_sched.step()
        b1, b2 = BETAS
        for k, (group, own_group) in enumerate(zip(self.opt.param_groups,
                                                   self.own.param_groups)):
            for m, own_m in zip(group["params"], own_group["params"]):
                st = self.opt.state[m]
                v, avg = st["exp_avg_sq"], st["exp_avg"]
                ieee = ieee_sqrt(v)
                theirs = v.sqrt()
                nz = ieee > 0
                if bool(nz.any()):
                    rel = ((theirs.double() - ieee.double()).abs()[nz] / ieee.double()[nz]).max()
                    self.sqrt_rel = max(self.sqrt_rel, float(rel))
                t = step + 1
                bc2_sqrt = (1 - b2 ** t) ** 0.5
                update = (lr / (1 - b1 ** t)) * avg.double().abs() / (
                    ieee.double() / bc2_sqrt + EPS)
                i = self.index(m)
                self.bound[i] += (update * (self.sqrt_rel + 4 * U) +
                                  2 * ulp(torch.maximum(m.abs(), own_m.abs())))

    def index(self, m: torch.Tensor) -> int:
        return next(i for i, x in enumerate(self.masters) if x is m)

    def flat_masters(self) -> torch.Tensor:
        """In the optimizer's flat order: group by group."""
        return torch.cat([m.detach().reshape(-1) for g in self.opt.param_groups
                          for m in g["params"]])

    def flat(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[self.index(m)].reshape(-1) for g in self.opt.param_groups
                          for m in g["params"]])


def make_model() -> OddNet:
    torch.manual_seed(0)
    return OddNet()


class ScheduleSameBits(unittest.TestCase):

    def run_case(self, ours_cls, torch_cls, servers, transport: str, lerp: bool,
                 own: bool = False):
        base = make_model()
        ours_model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
        ref = Reference(ref_model, torch_cls, lerp, own)
        opt = ours_cls(groups_of(ours_model), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                       dtype=torch.bfloat16, servers=servers, transport=transport, threads=1)
        try:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            lrs = []
            for step in range(STEPS):
                lrs.append(opt.param_groups[0]["lr"])
                opt.zero_grad(set_to_none=True)
                opt.backward(loss_of(ours_model, step))
                opt.step()
                sched.step()
                ref.step(step)
                # The 16-bit weights are the masters rounded: the same, step after step.
                for p, q in zip(ours_model.parameters(), ref_model.parameters()):
                    self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)),
                                    f"step {step}")
            # Not exact in fp32, and changing: the case this test is for.
            self.assertTrue(any(float(torch.tensor(x, dtype=torch.float32)) != x for x in lrs))
            self.assertEqual(len(set(lrs)), STEPS - 1)  # the cosine's first value is 1.0 again
            if servers != "inprocess":
                self.assertIn(transport, opt.transport)
            return opt.master_weights(), ref
        finally:
            opt.close()

    def check_all(self, ours_cls, torch_cls) -> None:
        for servers, transport in (("inprocess", "auto"), (None, "shm")):
            with self.subTest(servers=servers, transport=transport):
                got, ref = self.run_case(ours_cls, torch_cls, servers, transport, lerp=TORCH2)
                self.assertEqual(ulps(got, ref.flat_masters()), 0)

    def test_adamw(self) -> None:
        self.check_all(otorch.AdamW, torch.optim.AdamW)

    def test_adam(self) -> None:
        self.check_all(otorch.Adam, torch.optim.Adam)

    @unittest.skipUnless(TORCH2, "torch 1.13's own AdamW is the bit-for-bit reference there")
    def test_torch2_own_adamw_within_its_sqrt_error(self) -> None:
        got, ref = self.run_case(otorch.AdamW, torch.optim.AdamW, "inprocess", "auto",
                                 lerp=True, own=True)
        self.assertEqual(ulps(got, ref.flat_masters()), 0)
        theirs = ref.flat(ref.own_masters)
        bound = ref.flat(ref.bound)
        diff = (got.double() - theirs.double()).abs()
        # The premise of the bound: torch's sqrt is off by at most 1 ulp (2^-23 relative).
        self.assertLessEqual(ref.sqrt_rel, 2.0 ** -23)
        worst = float((diff / bound).max())
        print(f"\ntorch {torch.__version__} own AdamW: sqrt rel. error {ref.sqrt_rel:.3g}, "
              f"{int((diff > 0).sum())} of {diff.numel()} weights differ, max {ulps(got, theirs)} "
              f"ulp, {worst:.3g} of the bound", file=sys.stderr)
        self.assertTrue(bool((diff <= bound).all()), f"{worst} of the bound")


if __name__ == "__main__":
    unittest.main()
