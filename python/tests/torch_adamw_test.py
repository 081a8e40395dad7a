"""offload.torch.AdamW against plain torch, bit for bit (run by CTest as `torch_adamw_test`).

The reference is written in plain torch: an fp32 master copy of every parameter,
torch.optim.AdamW on the masters, the same 16-bit rounding of weights and gradients, and
GradScaler's rules for fp16. The optimizer under test must give the same master weights to the
bit, through one local server and three, over shared memory and over gRPC.

The hyper-parameters here happen to be exact in fp32 (powers of two, 1 - 2^-10), but they need
not be: the servers take them as doubles and compute each step's scalars as torch does, from
Python floats rounded once (torch_schedule_test uses betas (0.9, 0.95), lr 3e-4, wd 0.1).

The servers compute AdamW in the installed torch's single-tensor form (ARCHITECTURE.md section
5): torch 1.13's torch.optim.AdamW is the reference there. torch 2.x moves exp_avg by lerp_,
which the servers do too, but its CPU sqrt is not correctly rounded (about one value in five is
1 ulp off); there the reference is ContractAdamW, torch 2.x's update written out in plain torch
with an IEEE square root.
"""

from __future__ import annotations

import copy
import math
import os
import re
import sys
import unittest
from typing import Any, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import offload.torch as otorch  # noqa: E402
from offload.server import LocalServer  # noqa: E402

LR = 2.0 ** -8
BETAS = (0.875, 1.0 - 2.0 ** -10)
EPS = 2.0 ** -20
WD = 2.0 ** -5
STEPS = 20


class OddNet(torch.nn.Module):
    """A shape no other test uses: an embedding, two linears, a LayerNorm, odd sizes. It computes
    in fp32 on its 16-bit weights (CPU torch 1.13 has no fp16 matmul), as the C++ CPU backend
    does: the gradients reach the parameters rounded to their 16-bit type."""

    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(37, 24, device=device)
        self.fc1 = torch.nn.Linear(24, 53, device=device)
        self.norm = torch.nn.LayerNorm(53, device=device)
        self.fc2 = torch.nn.Linear(53, 37, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        f = lambda t: t.float()  # noqa: E731
        h = F.linear(F.embedding(x, f(self.emb.weight)), f(self.fc1.weight), f(self.fc1.bias))
        h = F.layer_norm(h, (53,), f(self.norm.weight), f(self.norm.bias))
        return F.linear(torch.tanh(h), f(self.fc2.weight), f(self.fc2.bias))


TORCH2 = int(re.match(r"\d+", torch.__version__).group()) >= 2


class ContractAdamW(torch.optim.Optimizer):
    """torch's single-tensor AdamW (no amsgrad, no maximize), step by step, with a correctly
    rounded square root: what the servers compute, for a torch whose own AdamW rounds otherwise.
    lerp: torch 2.x's form (exp_avg.lerp_, bias_correction2 ** 0.5), else torch 1.13's.
    decoupled=False: torch.optim.Adam (L2 on the gradient) instead."""

    def __init__(self, params, lr: float, betas: Tuple[float, float], eps: float,
                 weight_decay: float = 1e-2, lerp: bool = TORCH2,
                 decoupled: bool = True) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.lerp, self.decoupled = lerp, decoupled

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                wd, grad = group["weight_decay"], p.grad
                if self.decoupled:
                    p.mul_(1 - lr * wd)
                elif wd != 0:
                    grad = grad.add(p, alpha=wd)
                if self.lerp:
                    m.lerp_(grad, 1 - beta1)
                else:
                    m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                sqrt_v = v.double().sqrt().float()  # exact in double, then one rounding
                bc2 = 1 - beta2 ** step
                bc2_sqrt = bc2 ** 0.5 if self.lerp else math.sqrt(bc2)
                denom = (sqrt_v / bc2_sqrt).add_(group["eps"])
                p.addcdiv_(m, denom, value=-(lr / (1 - beta1 ** step)))


def reference_adamw(params: List[dict]) -> torch.optim.Optimizer:
    """torch.optim.AdamW where it is the servers' method (torch 1.x), else ContractAdamW."""
    if not TORCH2:
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    return ContractAdamW(params, lr=LR, betas=BETAS, eps=EPS)


def make_model(seed: int = 0) -> OddNet:
    torch.manual_seed(seed)
    return OddNet()


def groups_of(model: torch.nn.Module, params: Optional[List[torch.Tensor]] = None) -> List[dict]:
    """Two groups: matrices with decay, biases and norms without."""
    named = list(model.named_parameters())
    ps = params if params is not None else [p for _, p in named]
    decay = [p for (n, _), p in zip(named, ps) if p.dim() >= 2]
    no_decay = [p for (n, _), p in zip(named, ps) if p.dim() < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(step: int) -> float:
    return 1.0 - step / 64.0  # exact in fp32 times LR


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 37, (4, 9), generator=g)
    y = torch.randint(0, 37, (4, 9), generator=g)
    return x, y


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    logits = model(x).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, 37), y.view(-1))


class Reference:
    """Plain torch: fp32 masters, torch.optim.AdamW (reference_adamw), 16-bit model,
    GradScaler's rules."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, loss_scale: float,
                 window: int, max_norm: float = 0.0):
        self.model = model
        self.masters = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(dtype)
        self.opt = reference_adamw(groups_of(model, self.masters))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.scale = loss_scale if dtype == torch.float16 else 1.0
        self.window, self.clean, self.max_norm = window, 0, max_norm
        self.dtype = dtype

    def step(self, step: int, poison: bool = False,
             clip_coef: Optional[float] = None) -> Tuple[bool, float]:
        """One step; clip_coef, when given, replaces torch's (to compare the rest bit for bit).
        Returns (skipped, torch's clip coefficient)."""
        for p in self.model.parameters():
            p.grad = None
        loss = loss_of(self.model, step)
        if poison:
            loss = loss * math.inf
        (loss * self.scale).backward()
        grads = [p.grad for p in self.model.parameters()]
        if not all(bool(torch.isfinite(g.float()).all()) for g in grads):
            self.skipped()
            return True, 1.0
        for m, g in zip(self.masters, grads):
            m.grad = g.float() * (1.0 / self.scale)
        coef = 1.0
        if self.max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.masters, math.inf)  # measure only
            coef = float(torch.clamp(self.max_norm / (norm + 1e-6), max=1.0))
            use = coef if clip_coef is None else clip_coef
            for m in self.masters:
                m.grad.mul_(torch.tensor(use, dtype=torch.float32))
        self.opt.step()
        self.sched.step()
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.masters):
                p.copy_(m)
        self.applied()
        return False, coef

    def skipped(self) -> None:
        """GradScaler after an overflow: the scale halves (bf16: stays 1), the step is lost."""
        self.scale = max(1.0, self.scale / 2) if self.dtype == torch.float16 else 1.0
        self.clean = 0
        self.sched.step()

    def applied(self) -> None:
        """GradScaler after a clean step: the scale doubles after `window` of them."""
        if self.dtype == torch.float16:
            self.clean += 1
            if self.clean >= self.window:
                self.scale *= 2
                self.clean = 0

    def flat_masters(self) -> torch.Tensor:
        """In the optimizer's flat order: group by group."""
        return torch.cat([m.detach().reshape(-1) for g in self.opt.param_groups
                          for m in g["params"]])


def train_offload(model: torch.nn.Module, opt: otorch.AdamW, sched, step: int,
                  poison: bool = False) -> None:
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, step)
    if poison:
        loss = loss * math.inf
    opt.backward(loss)
    opt.step()
    sched.step()


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    ia = a.view(torch.int32).to(torch.int64)
    ib = b.view(torch.int32).to(torch.int64)
    return int((ia - ib).abs().max())


class SameBitsAsTorch(unittest.TestCase):

    def run_case(self, dtype: torch.dtype, servers, transport: str, poison_step: int = -1,
                 max_norm: float = 0.0, reuse_coef: bool = False) -> Tuple[int, list]:
        base = make_model()
        ours_model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
        ref = Reference(ref_model, dtype, loss_scale=1024.0, window=5, max_norm=max_norm)
        opt = otorch.AdamW(groups_of(ours_model), lr=LR, betas=BETAS, eps=EPS, dtype=dtype,
                           servers=servers, transport=transport, loss_scale=1024.0,
                           loss_scale_window=5, max_grad_norm=max_norm, threads=1)
        try:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            coefs = []
            for step in range(STEPS):
                poison = step == poison_step
                train_offload(ours_model, opt, sched, step, poison)
                ours_coef = opt.last_report["clip_coef"]
                skipped, torch_coef = ref.step(step, poison, ours_coef if reuse_coef else None)
                self.assertEqual(bool(opt.last_report["skipped"]), skipped, f"step {step}")
                self.assertEqual(opt.loss_scale, ref.scale, f"step {step}")
                coefs.append((ours_coef, torch_coef))
            if servers != "inprocess":
                self.assertIn(transport if transport != "auto" else "shm", opt.transport)
            got = opt.master_weights()
            want = ref.flat_masters()
            # The 16-bit weights in the model are the masters rounded, as in the reference.
            for p, q in zip(ours_model.parameters(), ref_model.parameters()):
                self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)))
            return ulps(got, want), coefs
        finally:
            opt.close()

    def test_bf16_one_local_server_over_shm(self) -> None:
        diff, _ = self.run_case(torch.bfloat16, None, "auto")
        self.assertEqual(diff, 0)

    def test_fp16_with_a_skipped_overflow(self) -> None:
        diff, _ = self.run_case(torch.float16, None, "shm", poison_step=6)
        self.assertEqual(diff, 0)

    def test_bf16_with_a_skipped_nonfinite_step(self) -> None:
        diff, _ = self.run_case(torch.bfloat16, None, "shm", poison_step=3)
        self.assertEqual(diff, 0)

    def test_three_servers_over_grpc_and_shm(self) -> None:
        token = "t0k3n-" + "a" * 20
        servers = [LocalServer(threads=1, token=token) for _ in range(3)]
        try:
            os.environ["OFFLOAD_TOKEN"] = token
            for dtype in (torch.bfloat16, torch.float16):
                for transport in ("grpc", "shm"):
                    with self.subTest(dtype=dtype, transport=transport):
                        diff, _ = self.run_case(dtype, [s.address for s in servers], transport,
                                                poison_step=4)
                        self.assertEqual(diff, 0)
        finally:
            os.environ.pop("OFFLOAD_TOKEN", None)
            for s in servers:
                s.close()

    def test_in_process_engine(self) -> None:
        diff, _ = self.run_case(torch.bfloat16, "inprocess", "auto")
        self.assertEqual(diff, 0)

    def test_clipping_that_triggers(self) -> None:
        # Given torch's own clip coefficient... ours is computed from the norm summed in another
        # order (double over 16-bit values; torch: fp32 norms per tensor). With the coefficient
        # ours chose, the rest is the same to the bit:
        diff, coefs = self.run_case(torch.bfloat16, None, "auto", max_norm=0.05,
                                    reuse_coef=True)
        self.assertEqual(diff, 0)
        self.assertTrue(any(c < 1.0 for c, _ in coefs), "clipping never triggered")
        # ...and the two coefficients differ by at most what the norm's summation can move:
        # torch sums n squares in fp32 (relative error <= n * 2^-24, the recursive-summation
        # bound), then takes a square root (halves it) and divides (one more rounding).
        n = sum(p.numel() for p in make_model().parameters())
        bound = (n * 2.0 ** -24) / 2 + 2.0 ** -23
        for ours, theirs in coefs:
            self.assertLessEqual(abs(ours - theirs), bound * theirs + 1e-12)


class Export(unittest.TestCase):

    def test_save_safetensors_writes_the_trained_16_bit_weights(self) -> None:
        import json
        import tempfile
        model = make_model()
        opt = otorch.AdamW(groups_of(model), lr=LR, betas=BETAS, eps=EPS, servers="inprocess")
        try:
            train_offload(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), 0)
        finally:
            opt.close()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "model.safetensors")
            otorch.save_safetensors(model, path)
            data = open(path, "rb").read()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
        body = data[8 + size:]
        self.assertEqual(set(header), set(model.state_dict()))
        for name, t in model.state_dict().items():
            entry = header[name]
            self.assertEqual(entry["dtype"], "BF16")
            self.assertEqual(entry["shape"], list(t.shape))
            lo, hi = entry["data_offsets"]
            got = torch.frombuffer(bytearray(body[lo:hi]), dtype=torch.bfloat16).view(t.shape)
            self.assertTrue(torch.equal(got.view(torch.int16), t.view(torch.int16)), name)


class Overlap(unittest.TestCase):

    def test_gradients_leave_before_backward_ends(self) -> None:
        """The step's trace: the sender's spans of the later layers' gradients begin before the
        "backward" span ends. The first layer's backward is made slow (a hook that sleeps, as
        its compute would take time on a big model) so the sender has a core meanwhile on any
        machine; nothing waits for a send to happen."""
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 64) for _ in range(6)]
        model = torch.nn.Sequential(*layers)
        import json
        import tempfile
        import time as _time
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess",
                               bucket_elements=64 * 64, trace_file=path, threads=1)
            layers[0].weight.register_hook(lambda g: _time.sleep(0.2))
            x = torch.randn(8, 64).to(torch.bfloat16)
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.close()
            events = json.load(open(path))
        backward = [e for e in events if e["name"] == "backward" and e["args"]["step"] == 1]
        sends = [e for e in events if e["name"] == "send_gradients" and e["args"]["step"] == 1]
        self.assertEqual(len(backward), 1)
        end = backward[0]["ts"] + backward[0]["dur"]
        early = [e for e in sends if e["ts"] + e["dur"] < end]
        self.assertGreaterEqual(len(early), 4, f"sends {sends}, backward ends at {end}")


if __name__ == "__main__":
    unittest.main()
