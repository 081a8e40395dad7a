"""Training loops that work with torch.optim.AdamW work the same with offload.torch.AdamW (run by
CTest as `torch_training_loop_test`): gradient accumulation over several backward() calls per
step, frozen parameters, a step() without backward, and the errors a loop can run into.

The references are torch_adamw_test's (fp32 masters, torch.optim.AdamW on them, the model's
16-bit rounding): with accumulation, each micro-batch's 16-bit gradient is added in fp32 in
micro-batch order, as the servers add them, and the step is decided on that sum.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import tempfile
import unittest
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.torch as otorch  # noqa: E402
from torch_adamw_test import (BETAS, EPS, LR, OddNet, Reference, groups_of,  # noqa: E402
                              lr_lambda, make_model, reference_adamw, ulps)

STEPS = 20
MICRO = 4


def micro_loss(model: torch.nn.Module, step: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + 31 * step + k)
    x = torch.randint(0, 37, (2, 9), generator=g)
    y = torch.randint(0, 37, (2, 9), generator=g)
    logits = model(x).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, 37), y.view(-1)) / MICRO


class AccumulatingReference(Reference):
    """Plain torch with accumulation: fp32 masters; each micro-batch's gradients (16-bit, as the
    model computes them at the loss scale) added in fp32; GradScaler's skip and scale rules on
    the sum; torch.optim.AdamW on the masters. delay_after: from that many steps on, each
    update reaches the model one step late (the update of step t lands at step t + 1)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, loss_scale: float,
                 window: int, micro: int = MICRO, delay_after: Optional[int] = None) -> None:
        super().__init__(model, dtype, loss_scale, window)
        self.micro, self.delay_after, self.pending = micro, delay_after, None
        self.steps = 0

    def step(self, step: int, poison_micro: int = -1) -> bool:
        delayed = self.delay_after is not None and self.steps >= self.delay_after
        self.steps += 1
        sums = [torch.zeros_like(m) for m in self.masters]
        for k in range(self.micro):
            for p in self.model.parameters():
                p.grad = None
            loss = micro_loss(self.model, step, k)
            if k == poison_micro:
                loss = loss * math.inf
            (loss * self.scale).backward()
            for s, p in zip(sums, self.model.parameters()):
                s.add_(p.grad.float())
        if delayed and self.pending is not None:  # the update of the step before lands now
            with torch.no_grad():
                for p, w in zip(self.model.parameters(), self.pending):
                    p.copy_(w)
        self.pending = None
        if not all(bool(torch.isfinite(s).all()) for s in sums):
            self.skipped()
            return True
        for m, s in zip(self.masters, sums):
            m.grad = s * (1.0 / self.scale)
        self.opt.step()
        self.sched.step()
        if delayed:
            self.pending = [m.detach().to(self.dtype) for m in self.masters]
        else:
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.masters):
                    p.copy_(m)
        self.applied()
        return False


class Accumulation(unittest.TestCase):

    def run_case(self, dtype: torch.dtype, servers, transport: str = "auto",
                 poison: Optional[tuple] = None) -> None:
        base = make_model()
        ours_model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
        ref = AccumulatingReference(ref_model, dtype, loss_scale=1024.0, window=5)
        opt = otorch.AdamW(groups_of(ours_model), lr=LR, betas=BETAS, eps=EPS, dtype=dtype,
                           servers=servers, transport=transport, loss_scale=1024.0,
                           loss_scale_window=5, threads=1, bucket_elements=700)
        try:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            skips = 0
            for step in range(STEPS):
                poison_micro = poison[1] if poison is not None and poison[0] == step else -1
                opt.zero_grad()
                for k in range(MICRO):
                    loss = micro_loss(ours_model, step, k)
                    if k == poison_micro:
                        loss = loss * math.inf
                    opt.backward(loss)
                opt.step()
                sched.step()
                skipped = ref.step(step, poison_micro)
                skips += skipped
                self.assertEqual(bool(opt.last_report["skipped"]), skipped, f"step {step}")
                self.assertEqual(opt.loss_scale, ref.scale, f"step {step}")
            self.assertEqual(skips, 1 if poison is not None else 0)
            self.assertEqual(ulps(opt.master_weights(), ref.flat_masters()), 0)
            for p, q in zip(ours_model.parameters(), ref_model.parameters()):
                self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)))
            # Every p.grad was freed as its gradient left: device memory stayed a bucket.
            self.assertTrue(all(p.grad is None for p in ours_model.parameters()))
        finally:
            opt.close()

    def test_bf16_four_micro_batches_per_step_over_shm(self) -> None:
        self.run_case(torch.bfloat16, None)

    def test_bf16_four_micro_batches_per_step_over_grpc(self) -> None:
        self.run_case(torch.bfloat16, None, transport="grpc")

    def test_fp16_four_micro_batches_with_an_overflow_skip(self) -> None:
        # The overflow is in the third micro-batch of step 6: the sum overflows, the step is
        # skipped and the scale halves, as GradScaler does.
        self.run_case(torch.float16, "inprocess", poison=(6, 2))

    def resume_case(self, dtype: torch.dtype, servers, save_at: tuple,
                    via: str = "state_dict") -> None:
        """Stopped at step save_at[0] after save_at[1] of its micro-batches: a state_dict, or a
        checkpoint (via), and the model's and the scheduler's state taken there, a new model and
        optimizer built from them, the step finished and training continued: the bits of the
        run never stopped."""
        base = make_model()

        def make(model):
            opt = otorch.AdamW(groups_of(model), lr=LR, betas=BETAS, eps=EPS, dtype=dtype,
                               servers=servers, loss_scale=1024.0, loss_scale_window=5,
                               threads=1, bucket_elements=700)
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

        def micro_batches(model, opt, step, ks):
            for k in ks:
                opt.backward(micro_loss(model, step, k))

        checkpoints = tempfile.TemporaryDirectory()
        whole_model = copy.deepcopy(base)
        whole, whole_sched = make(whole_model)
        model = copy.deepcopy(base)
        opt, sched = make(model)
        resumed = None
        try:
            for step in range(STEPS):
                whole.zero_grad()
                micro_batches(whole_model, whole, step, range(MICRO))
                whole.step()
                whole_sched.step()
                if step != save_at[0]:
                    opt.zero_grad()
                    micro_batches(model, opt, step, range(MICRO))
                    opt.step()
                    sched.step()
                    continue
                opt.zero_grad()
                micro_batches(model, opt, step, range(save_at[1]))
                if via == "checkpoint":
                    directory = opt.save_checkpoint(checkpoints.name)
                    self.assertTrue(os.path.exists(os.path.join(directory, "grad_sum.safetensors")))
                    state = None
                else:
                    state = opt.state_dict()
                    self.assertIn("accumulated", state["offload"])
                saved = copy.deepcopy((state, model.state_dict(), sched.state_dict()))
                opt.close()  # the run stops here; a new one takes over
                model = make_model(seed=1)  # other values, replaced by the saved ones
                model.load_state_dict(saved[1])
                opt, sched = make(model)
                resumed = opt
                if via == "checkpoint":
                    opt.load_checkpoint(checkpoints.name)
                else:
                    opt.load_state_dict(saved[0])
                sched.load_state_dict(saved[2])
                micro_batches(model, opt, step, range(save_at[1], MICRO))
                opt.step()
                sched.step()
            self.assertIsNotNone(resumed)
            self.assertEqual(ulps(opt.master_weights(), whole.master_weights()), 0)
            for p, q in zip(model.parameters(), whole_model.parameters()):
                self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)))
        finally:
            whole.close()
            opt.close()
            checkpoints.cleanup()

    def test_bf16_resume_mid_accumulation_from_a_state_dict(self) -> None:
        self.resume_case(torch.bfloat16, "inprocess", (7, 2))

    def test_bf16_resume_after_the_first_micro_batch_through_a_local_server(self) -> None:
        self.resume_case(torch.bfloat16, None, (5, 1))

    def test_fp16_resume_mid_accumulation_from_a_state_dict(self) -> None:
        self.resume_case(torch.float16, "inprocess", (9, 3))

    def test_bf16_resume_mid_accumulation_from_a_checkpoint(self) -> None:
        self.resume_case(torch.bfloat16, "inprocess", (7, 2), via="checkpoint")

    def test_fp16_resume_after_the_first_micro_batch_from_a_checkpoint_on_a_server(self) -> None:
        self.resume_case(torch.float16, None, (4, 1), via="checkpoint")

    def test_mid_accumulation_states_that_cannot_resume_are_refused(self) -> None:
        model = make_model()
        opt = otorch.AdamW(groups_of(model), lr=LR, servers="inprocess", threads=1)
        opt.backward(micro_loss(model, 0, 0))
        saved = copy.deepcopy(opt.state_dict())
        opt.close()
        other = make_model(seed=1)
        opt = otorch.AdamW(groups_of(other), lr=LR, servers="inprocess", threads=1)
        try:
            before = opt.master_weights()
            for key, value in (("grad_sum", torch.zeros(3)), ("seen", [True]),
                               ("micro_batches", 0)):
                bad = copy.deepcopy(saved)
                bad["offload"]["accumulated"][key] = value
                with self.assertRaisesRegex(ValueError, "mid-accumulation entry is malformed"):
                    opt.load_state_dict(bad)
                self.assertEqual(ulps(opt.master_weights(), before), 0)
                self.assertFalse(opt._native.in_step())
        finally:
            opt.close()
        # With the update during backward the servers hold the step's early updates.
        opt = otorch.AdamW(groups_of(model), lr=LR, servers="inprocess", threads=1,
                           update_in_backward=True)
        try:
            opt.backward(micro_loss(model, 0, 0))
            with self.assertRaisesRegex(RuntimeError, "update_in_backward"):
                opt.state_dict()
        finally:
            opt.close()

    def test_keep_grads_refuses_a_second_backward_and_the_step_can_be_redone(self) -> None:
        model = make_model()
        opt = otorch.AdamW(model.parameters(), lr=LR, servers="inprocess", threads=1,
                           keep_grads=True)
        try:
            opt.backward(micro_loss(model, 0, 0))
            with self.assertRaisesRegex(RuntimeError, "keep_grads=True"):
                opt.backward(micro_loss(model, 0, 1))
            before = opt.master_weights()
            opt.zero_grad()
            self.assertTrue(torch.equal(opt.master_weights(), before))  # nothing applied
            opt.backward(micro_loss(model, 0, 0))
            opt.step()
            self.assertEqual(opt.last_report["step"], 1)
        finally:
            opt.close()


def train_steps(model: torch.nn.Module, opt: otorch.AdamW, sched, steps: range, micro: int,
                poison: Optional[tuple] = None) -> None:
    for step in steps:
        opt.zero_grad()
        for k in range(micro):
            loss = micro_loss(model, step, k)
            if poison is not None and poison == (step, k):
                loss = loss * math.inf
            opt.backward(loss)
        opt.step()
        sched.step()


class DelayedUpdate(unittest.TestCase):
    WARMUP = 3

    def make(self, model: torch.nn.Module, dtype: torch.dtype, servers="inprocess",
             **kwargs) -> otorch.AdamW:
        return otorch.AdamW(groups_of(model), lr=LR, betas=BETAS, eps=EPS, dtype=dtype,
                            servers=servers, loss_scale=1024.0, loss_scale_window=5, threads=1,
                            delay_update=True, delay_warmup_steps=self.WARMUP, **kwargs)

    def run_case(self, dtype: torch.dtype, servers, micro: int,
                 poison: Optional[tuple] = None) -> None:
        base = make_model()
        ours_model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
        ref = AccumulatingReference(ref_model, dtype, loss_scale=1024.0, window=5, micro=micro,
                                    delay_after=self.WARMUP)
        opt = self.make(ours_model, dtype, servers)
        try:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            skips = 0
            for step in range(STEPS):
                train_steps(ours_model, opt, sched, range(step, step + 1), micro, poison)
                poison_micro = poison[1] if poison is not None and poison[0] == step else -1
                skipped = ref.step(step, poison_micro)
                skips += skipped
                self.assertEqual(bool(opt.last_report["skipped"]), skipped, f"step {step}")
                self.assertEqual(opt.loss_scale, ref.scale, f"step {step}")
                # The parameters are one update behind the servers, as the reference's.
                for p, q in zip(ours_model.parameters(), ref_model.parameters()):
                    self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)),
                                    f"step {step}")
            self.assertEqual(skips, 1 if poison is not None else 0)
            self.assertEqual(ulps(opt.master_weights(), ref.flat_masters()), 0)
            # The last update is still on its way to the parameters; flush() lands it.
            self.assertIsNotNone(ref.pending)
            opt.flush()
            for p, w in zip(ours_model.parameters(), ref.pending):
                self.assertTrue(torch.equal(p.view(torch.int16), w.view(torch.int16)))
        finally:
            opt.close()

    def test_bf16_each_update_lands_one_step_late(self) -> None:
        self.run_case(torch.bfloat16, "inprocess", micro=1)

    def test_bf16_with_accumulation_through_a_local_server(self) -> None:
        self.run_case(torch.bfloat16, None, micro=2)

    def test_fp16_overflow_in_a_delayed_step_is_skipped(self) -> None:
        self.run_case(torch.float16, "inprocess", micro=1, poison=(9, 0))

    def test_resume_mid_pipeline_gives_the_bits_of_the_run_that_saved(self) -> None:
        for how in ("checkpoint", "state_dict"):
            with self.subTest(how=how), tempfile.TemporaryDirectory() as d:
                model = make_model()
                opt = self.make(model, torch.bfloat16)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
                try:
                    train_steps(model, opt, sched, range(0, 8), micro=2)
                    if how == "checkpoint":
                        opt.save_checkpoint(d, model=model)
                    else:
                        saved = opt.state_dict()
                    sched_state = sched.state_dict()
                    train_steps(model, opt, sched, range(8, 14), micro=2)
                    want = opt.master_weights()
                    want16 = [p.detach().clone() for p in model.parameters()]
                finally:
                    opt.close()
                model = make_model(seed=3)  # other values: all of them come from the save
                opt = self.make(model, torch.bfloat16)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
                try:
                    if how == "checkpoint":
                        opt.load_checkpoint(d, model=model)
                    else:
                        opt.load_state_dict(saved)
                    sched.load_state_dict(sched_state)
                    train_steps(model, opt, sched, range(8, 14), micro=2)
                    self.assertEqual(ulps(opt.master_weights(), want), 0)
                    for p, q in zip(model.parameters(), want16):
                        self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)))
                finally:
                    opt.close()

    def test_a_checkpoint_between_micro_batches_with_an_update_to_land_is_refused(self) -> None:
        # Past the warm-up a delayed update waits to land at step(): the parameters computing
        # the remaining micro-batches are not the servers' weights, so nothing could resume.
        model = make_model()
        opt = self.make(model, torch.bfloat16)
        try:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            train_steps(model, opt, sched, range(self.WARMUP + 1), micro=1)
            opt.backward(micro_loss(model, 9, 0))
            with tempfile.TemporaryDirectory() as d, self.assertRaisesRegex(
                    RuntimeError, "between backward.*delayed update still to land"):
                opt.save_checkpoint(d)
            with self.assertRaisesRegex(RuntimeError, "delayed update still to land"):
                opt.state_dict()
        finally:
            opt.close()


class FrozenAndUnused(unittest.TestCase):

    def make(self, freeze: bool = True):
        model = make_model()
        if freeze:
            model.fc1.weight.requires_grad_(False)
            model.fc1.bias.requires_grad_(False)
        return model

    def test_a_frozen_layer_never_changes_and_the_rest_trains_as_torch(self) -> None:
        base = self.make()
        ours_model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
        frozen16 = base.fc1.weight.detach().to(torch.bfloat16)
        # The reference: torch.optim.AdamW over fp32 masters of every parameter (frozen ones
        # included, as fine-tuning scripts pass model.parameters()); it skips the frozen.
        masters = [p.detach().clone().requires_grad_(p.requires_grad)
                   for p in ref_model.parameters()]
        with torch.no_grad():
            for p in ref_model.parameters():
                p.data = p.data.to(torch.bfloat16)
        ref = reference_adamw(groups_of(ref_model, masters))
        opt = otorch.AdamW(groups_of(ours_model), lr=LR, betas=BETAS, eps=EPS,
                           servers="inprocess", threads=1)
        try:
            trained = sum(p.numel() for p in base.parameters() if p.requires_grad)
            self.assertEqual(opt.num_params, trained)  # nothing on the servers for the frozen
            self.assertEqual(ours_model.fc1.weight.dtype, torch.bfloat16)
            for step in range(6):
                opt.zero_grad()
                opt.backward(micro_loss(ours_model, step, 0))
                opt.step()
                for p in ref_model.parameters():
                    p.grad = None
                micro_loss(ref_model, step, 0).backward()
                for m, p in zip(masters, ref_model.parameters()):
                    m.grad = None if p.grad is None else p.grad.float()
                ref.step()
                with torch.no_grad():
                    for p, m in zip(ref_model.parameters(), masters):
                        p.copy_(m)
            self.assertTrue(torch.equal(ours_model.fc1.weight.view(torch.int16),
                                        frozen16.view(torch.int16)))
            for p, q in zip(ours_model.parameters(), ref_model.parameters()):
                self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)))
            want = torch.cat([m.reshape(-1) for g in ref.param_groups for m in g["params"]
                              if m.requires_grad])
            self.assertEqual(ulps(opt.master_weights(), want), 0)

            # torch's state_dict layout: the frozen parameters have no state.
            sd = opt.state_dict()
            ref_sd = ref.state_dict()
            self.assertEqual(sorted(sd["state"]), sorted(ref_sd["state"]))
            self.assertEqual([g["params"] for g in sd["param_groups"]],
                             [g["params"] for g in ref_sd["param_groups"]])
            for i, s in ref_sd["state"].items():
                self.assertEqual(ulps(sd["state"][i]["exp_avg"], s["exp_avg"]), 0)

            # The state and a checkpoint load back onto a new optimizer of the same model.
            other = otorch.AdamW(groups_of(copy.deepcopy(ours_model)), lr=LR, betas=BETAS,
                                 eps=EPS, servers="inprocess", threads=1)
            try:
                other.load_state_dict(sd)
                self.assertTrue(torch.equal(other.master_weights(), opt.master_weights()))
            finally:
                other.close()
            with tempfile.TemporaryDirectory() as d:
                opt.save_checkpoint(d, model=ours_model)
                twin = copy.deepcopy(ours_model)
                other = otorch.AdamW(groups_of(twin), lr=LR, betas=BETAS, eps=EPS,
                                     servers="inprocess", threads=1)
                try:
                    other.load_checkpoint(d, model=twin)
                    self.assertTrue(torch.equal(other.master_weights(), opt.master_weights()))
                finally:
                    other.close()
        finally:
            opt.close()

    def test_a_frozen_layer_of_a_model_on_the_meta_device(self) -> None:
        def build(device=None) -> OddNet:
            torch.manual_seed(0)
            model = OddNet(device=device)
            model.fc1.weight.requires_grad_(False)
            model.fc1.bias.requires_grad_(False)
            return model

        eager, meta = build(), build("meta")
        opts = [otorch.AdamW(eager.parameters(), lr=LR, servers="inprocess", threads=1),
                otorch.materialize(meta, lr=LR, servers="inprocess", threads=1)]
        try:
            # The frozen layer got its values too, in 16 bits, everywhere the model holds it.
            self.assertFalse(meta.fc1.weight.is_meta)
            self.assertEqual(meta.fc1.weight.dtype, torch.bfloat16)
            self.assertTrue(all(a is b for a, b in zip(opts[1].param_groups[0]["params"],
                                                       meta.parameters())))
            frozen = meta.fc1.weight.detach().clone()
            for step in range(3):
                for model, opt in zip((eager, meta), opts):
                    opt.zero_grad()
                    opt.backward(micro_loss(model, step, 0))
                    opt.step()
            self.assertTrue(torch.equal(meta.fc1.weight, frozen))
            for p, q in zip(eager.parameters(), meta.parameters()):
                self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)))
            self.assertTrue(torch.equal(opts[0].master_weights(), opts[1].master_weights()))
        finally:
            for opt in opts:
                opt.close()

    def test_unfreezing_is_refused_and_changes_nothing(self) -> None:
        model = self.make()
        opt = otorch.AdamW(model.parameters(), lr=LR, servers="inprocess", threads=1)
        try:
            model.fc1.weight.requires_grad_(True)
            before = opt.master_weights()
            opt.backward(micro_loss(model, 0, 0))
            with self.assertRaisesRegex(RuntimeError, "frozen"):
                opt.step()
            self.assertTrue(torch.equal(opt.master_weights(), before))
            self.assertEqual(opt.state_dict()["offload"]["completed_step"], 0)
        finally:
            opt.close()

    def test_only_frozen_parameters_is_refused(self) -> None:
        model = make_model()
        for p in model.parameters():
            p.requires_grad_(False)
        with self.assertRaisesRegex(ValueError, "no parameter requires a gradient"):
            otorch.AdamW(model.parameters(), servers="inprocess")

    def test_a_group_of_frozen_parameters_only(self) -> None:
        model = make_model()
        model.norm.weight.requires_grad_(False)
        model.norm.bias.requires_grad_(False)
        groups = [{"params": [model.norm.weight, model.norm.bias], "lr": 1.0},
                  {"params": [p for n, p in model.named_parameters()
                              if not n.startswith("norm.")]}]
        opt = otorch.AdamW(groups, lr=LR, servers="inprocess", threads=1)
        try:
            norm = model.norm.weight.detach().clone()
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            for step in range(3):
                opt.zero_grad()
                opt.backward(micro_loss(model, step, 0))
                opt.step()
                sched.step()
            self.assertEqual(opt.last_report["step"], 3)
            self.assertTrue(torch.equal(model.norm.weight, norm))
        finally:
            opt.close()

    def test_parameters_without_a_gradient_are_skipped_as_torch_skips_them(self) -> None:
        # fc2 has no gradient in steps 0-4 (its first update is torch's step 1 at step 5) and in
        # every third step after; the norm none in steps 1, 5, 9, ...: each skipped step leaves
        # it, its moments and its own step count as they were, as torch.optim.AdamW does.
        def branch_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
            F = torch.nn.functional
            g = torch.Generator().manual_seed(500 + step)
            x = torch.randint(0, 37, (2, 9), generator=g)
            y = torch.randint(0, 37, (2, 9), generator=g)
            f = lambda t: t.float()  # noqa: E731
            h = F.linear(F.embedding(x, f(model.emb.weight)), f(model.fc1.weight),
                         f(model.fc1.bias))
            if step % 4 != 1:
                h = F.layer_norm(h, (53,), f(model.norm.weight), f(model.norm.bias))
            if step < 5 or step % 3 == 0:
                return h.square().mean()
            logits = F.linear(torch.tanh(h), f(model.fc2.weight), f(model.fc2.bias))
            return F.cross_entropy(logits.view(-1, 37), y.view(-1))

        base = make_model()
        ours_model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
        masters = [p.detach().clone() for p in ref_model.parameters()]
        with torch.no_grad():
            for p in ref_model.parameters():
                p.data = p.data.to(torch.bfloat16)
        ref = reference_adamw(groups_of(ref_model, masters))
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lr_lambda)
        opt = otorch.AdamW(groups_of(ours_model), lr=LR, betas=BETAS, eps=EPS,
                           servers=None, threads=1)
        try:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            for step in range(STEPS):
                opt.zero_grad()
                opt.backward(branch_loss(ours_model, step))
                opt.step()
                sched.step()
                for p in ref_model.parameters():
                    p.grad = None
                branch_loss(ref_model, step).backward()
                for m, p in zip(masters, ref_model.parameters()):
                    m.grad = None if p.grad is None else p.grad.float()
                ref.step()
                ref_sched.step()
                with torch.no_grad():
                    for p, m in zip(ref_model.parameters(), masters):
                        p.copy_(m)
                for p, q in zip(ours_model.parameters(), ref_model.parameters()):
                    self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)),
                                    f"step {step}")
            want = torch.cat([m.reshape(-1) for g in ref.param_groups for m in g["params"]])
            self.assertEqual(ulps(opt.master_weights(), want), 0)
            # torch's per-parameter steps and moments, in torch's state_dict indices.
            sd, ref_sd = opt.state_dict(), ref.state_dict()
            for i, s in ref_sd["state"].items():
                self.assertEqual(float(sd["state"][i]["step"]), float(s["step"]), f"param {i}")
                self.assertEqual(ulps(sd["state"][i]["exp_avg"], s["exp_avg"]), 0)
                self.assertEqual(ulps(sd["state"][i]["exp_avg_sq"], s["exp_avg_sq"]), 0)
            steps = sorted({float(s["step"]) for s in ref_sd["state"].values()})
            self.assertGreater(len(steps), 2)  # three different counts really ran

            # The steps come back from a checkpoint and a state_dict: both continue as torch.
            with tempfile.TemporaryDirectory() as d:
                opt.save_checkpoint(d, model=ours_model)
                for how in ("checkpoint", "state_dict"):
                    twin = copy.deepcopy(ours_model)
                    other = otorch.AdamW(groups_of(twin), lr=LR, betas=BETAS, eps=EPS,
                                         servers="inprocess", threads=1)
                    try:
                        if how == "checkpoint":
                            other.load_checkpoint(d, model=twin)
                        else:
                            other.load_state_dict(sd)
                        self.assertEqual(other._commits.lag, opt._commits.lag, how)
                    finally:
                        other.close()
                plain = copy.deepcopy(base)
                plain_opt = torch.optim.AdamW(groups_of(plain), lr=LR, betas=BETAS, eps=EPS)
                from offload.checkpoint import load_into_torch
                load_into_torch(d, plain, plain_opt)
                flat = [p for g in plain_opt.param_groups for p in g["params"]]
                for i, p in enumerate(flat):
                    self.assertEqual(float(plain_opt.state[p]["step"]),
                                     float(ref_sd["state"][i]["step"]))
        finally:
            opt.close()


class StepSemantics(unittest.TestCase):

    def test_step_without_backward_does_nothing(self) -> None:
        model = make_model()
        opt = otorch.AdamW(model.parameters(), lr=LR, servers="inprocess", threads=1)
        try:
            before = opt.master_weights()
            weights = [p.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            opt.step()
            self.assertTrue(torch.equal(opt.master_weights(), before))
            self.assertTrue(all(torch.equal(a, b) for a, b in zip(weights, model.parameters())))
            self.assertEqual(opt.state_dict()["offload"]["completed_step"], 0)
            opt.backward(micro_loss(model, 0, 0))
            opt.step()
            opt.step()  # no backward since: nothing
            self.assertEqual(opt.state_dict()["offload"]["completed_step"], 1)
        finally:
            opt.close()

    def test_torch_clip_grad_norm_clips_by_the_global_norm(self) -> None:
        """torch.nn.utils.clip_grad_norm_(model.parameters(), ...), as a torch loop calls it:
        p.grad is freed during backward, so torch's own function must answer for the
        optimizer's parameters (offload.clipping): the norm of the gradients sent, returned as
        torch returns it, and the clip in the coming step, the same bits as the optimizer's own
        clip_grad_norm_. What it cannot answer exactly is refused with nothing changed."""
        max_norm = 0.05
        results = []
        for use_torch in (True, False):
            model = make_model()
            opt = otorch.AdamW(groups_of(model), lr=LR, betas=BETAS, eps=EPS,
                               servers="inprocess", threads=1)
            try:
                norms, coefs = [], []
                for step in range(6):
                    opt.zero_grad()
                    for k in range(2):
                        opt.backward(micro_loss(model, step, k))
                    if use_torch:
                        if step == 0:
                            params = list(model.parameters())
                            with self.assertRaisesRegex(ValueError, "part of an offload"):
                                torch.nn.utils.clip_grad_norm_(params[:1], max_norm)
                            with self.assertRaisesRegex(ValueError, "norm_type"):
                                torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=1.0)
                        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                    else:
                        norm = opt.clip_grad_norm_(max_norm)
                    opt.step()
                    norms.append(float(norm))
                    coefs.append(opt.last_report["clip_coef"])
                    self.assertEqual(float(norm), float(torch.tensor(
                        opt.last_report["grad_norm"], dtype=torch.float32)))
                self.assertTrue(any(c < 1.0 for c in coefs), coefs)
                results.append((opt.master_weights(), norms))
            finally:
                opt.close()
        self.assertEqual(ulps(results[0][0], results[1][0]), 0)
        self.assertEqual(results[0][1], results[1][1])
        # Parameters no offload optimizer owns still go to torch's own function.
        plain = torch.nn.Linear(3, 2)
        plain(torch.ones(1, 3)).sum().backward()
        want = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1)
                                                   for p in plain.parameters()]))
        got = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
        self.assertAlmostEqual(float(got), float(want), places=5)
        self.assertLess(float(torch.linalg.vector_norm(plain.weight.grad)), 1e-3 + 1e-6)


if __name__ == "__main__":
    unittest.main()
