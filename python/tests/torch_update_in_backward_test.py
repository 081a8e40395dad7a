"""The update during backward (``update_in_backward=True``, run by CTest as
`torch_update_in_backward_test`): the servers run Adam on each bucket once backward has produced
all of its gradients, speculating on the step's decision, and restore exactly what the commit
decides otherwise. So every run here must give the bits of the same run without it (which
torch_adamw_test and torch_training_loop_test hold to plain torch), and the first one the bits of
plain torch itself; the reports say how much was updated early and how much was undone.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import tempfile
import time
import unittest
from typing import Callable, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.torch as otorch  # noqa: E402
from offload import native  # noqa: E402
from torch_adamw_test import (BETAS, EPS, LR, Reference, groups_of, loss_of,  # noqa: E402
                              lr_lambda, make_model, ulps)

STEPS = 20
BUCKET = 700  # elements: OddNet's parameters leave in several buckets


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


class Loop:
    """One offload.torch.AdamW over a copy of `base`, trained with a LambdaLR warm-up."""

    def __init__(self, base: torch.nn.Module, speculate: bool, dtype: torch.dtype = torch.bfloat16,
                 servers="inprocess", **kwargs) -> None:
        self.model = copy.deepcopy(base)
        self.opt = otorch.AdamW(groups_of(self.model), lr=LR, betas=BETAS, eps=EPS, dtype=dtype,
                                servers=servers, threads=1, bucket_elements=BUCKET,
                                loss_scale=1024.0, loss_scale_window=5,
                                update_in_backward=speculate, **kwargs)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.reports: List[dict] = []

    def step(self, step: int, micro: int = 1,
             between: Optional[Callable[["Loop"], None]] = None) -> None:
        self.opt.zero_grad()
        for k in range(micro):
            self.opt.backward(loss_of(self.model, step + 1000 * k) / micro)
        if between is not None:
            between(self)
        self.opt.step()
        self.sched.step()
        self.reports.append(dict(self.opt.last_report))


class SameBits(unittest.TestCase):

    def run_pair(self, dtype: torch.dtype = torch.bfloat16, servers="inprocess", micro: int = 1,
                 between: Optional[Callable[[Loop, int], None]] = None,
                 hook: Optional[Callable[[torch.nn.Module, int], None]] = None,
                 **kwargs) -> List[dict]:
        """Trains with and without the update during backward; returns the speculating run's
        reports after checking both ended in the same bits (masters, moments, 16-bit weights)."""
        base = make_model()
        runs = [Loop(base, True, dtype, servers, **kwargs), Loop(base, False, dtype, servers,
                                                                 **kwargs)]
        try:
            if "transport" in kwargs:
                self.assertEqual(runs[0].opt.transport, kwargs["transport"])
            for step in range(STEPS):
                for run in runs:
                    if hook is not None:
                        hook(run.model, step)
                    run.step(step, micro,
                             None if between is None else (lambda r, s=step: between(r, s)))
                self.assertEqual(runs[0].reports[-1]["skipped"], runs[1].reports[-1]["skipped"])
                self.assertEqual(runs[1].reports[-1]["early_updated"], 0)
            ours, plain = runs
            self.assertEqual(ulps(ours.opt.master_weights(), plain.opt.master_weights()), 0)
            a, b = ours.opt.state_dict()["state"], plain.opt.state_dict()["state"]
            for i in a:
                for key in ("exp_avg", "exp_avg_sq"):
                    self.assertEqual(ulps(a[i][key], b[i][key]), 0, f"{key} of parameter {i}")
                self.assertEqual(a[i]["step"], b[i]["step"])
            for p, q in zip(ours.model.parameters(), plain.model.parameters()):
                self.assertTrue(same_bits(p, q))
            return ours.reports
        finally:
            for run in runs:
                run.opt.close()

    def test_bf16_matches_plain_torch_and_updates_everything_early(self) -> None:
        base = make_model()
        ours = Loop(base, True)
        ref_model = copy.deepcopy(base)
        ref = Reference(ref_model, torch.bfloat16, loss_scale=1.0, window=5)
        try:
            for step in range(STEPS):
                ours.step(step)
                ref.step(step)
                # Every parameter got its gradient and the commit agreed: all of it was updated
                # before the commit (only the padding waits for it).
                self.assertEqual(ours.reports[-1]["early_updated"], ours.opt.num_params,
                                 f"step {step}")
                self.assertEqual(ours.reports[-1]["early_rolled_back"], 0)
            self.assertEqual(ulps(ours.opt.master_weights(), ref.flat_masters()), 0)
            for p, q in zip(ours.model.parameters(), ref_model.parameters()):
                self.assertTrue(same_bits(p, q))
        finally:
            ours.opt.close()

    def test_bf16_through_a_local_server_over_shared_memory(self) -> None:
        reports = self.run_pair(servers=None, transport="shm")
        self.assertTrue(all(r["early_updated"] > 0 for r in reports), reports)

    def test_fp16_through_a_local_server_over_grpc(self) -> None:
        # gRPC carries the update as a StepUpdate message behind the bucket's gradients, which
        # leave from the plane's gradient area.
        reports = self.run_pair(torch.float16, servers=None, transport="grpc")
        self.assertTrue(all(r["early_updated"] > 0 for r in reports), reports)

    def test_fp16_overflow_in_the_last_gradients_undoes_the_early_update(self) -> None:
        # Step 6: the first layer's gradient (the last backward produces) is inf, so the later
        # layers were updated early on finite gradients; the step must be skipped whole.
        def poison(model: torch.nn.Module, step: int) -> None:
            for h in getattr(model, "_poison", []):
                h.remove()
            model._poison = []
            if step == 6:
                first = next(model.parameters())
                model._poison.append(first.register_hook(lambda g: g * math.inf))

        reports = self.run_pair(torch.float16, hook=poison)
        self.assertTrue(reports[6]["skipped"])
        self.assertGreater(reports[6]["early_rolled_back"], 0)
        self.assertEqual(reports[6]["early_updated"], 0)
        self.assertFalse(reports[5]["skipped"])
        self.assertEqual(reports[5]["early_rolled_back"], 0)

    def test_clipping_that_bites_is_undone_and_speculation_pauses(self) -> None:
        reports = self.run_pair(max_grad_norm=1e-3)
        self.assertGreater(reports[0]["early_rolled_back"], 0)
        self.assertEqual(reports[0]["early_updated"], 0)
        # One step's pause, then another try, undone again, then three steps' pause.
        self.assertEqual([r["early_rolled_back"] > 0 for r in reports[:7]],
                         [True, False, True, False, False, False, True])

    def test_an_lr_changed_after_backward_is_taken_as_torch_takes_it(self) -> None:
        def change_lr(run: Loop, step: int) -> None:
            if step == 3:
                for g in run.opt.param_groups:
                    g["lr"] = g["lr"] * 0.5

        reports = self.run_pair(between=change_lr)
        self.assertGreater(reports[3]["early_rolled_back"], 0)
        self.assertEqual(reports[2]["early_rolled_back"], 0)

    def test_two_micro_batches_undo_the_first_and_then_stay_off(self) -> None:
        reports = self.run_pair(micro=2)
        self.assertGreater(reports[0]["early_rolled_back"], 0)
        self.assertTrue(all(r["early_updated"] == 0 and r["early_rolled_back"] == 0
                            for r in reports[1:]), reports)

    def test_with_delay_update_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "choose one"):
            otorch.AdamW(make_model().parameters(), servers="inprocess", delay_update=True,
                         update_in_backward=True)


class BadInput(unittest.TestCase):
    """The C ABI's two calls refuse what is malformed, with the code and a message, and the step
    still commits the bits of a step without them."""

    def test_refusals(self) -> None:
        import ctypes
        base = make_model()
        ours, plain = Loop(base, False), Loop(base, False)
        L = native.lib()
        h = ours.opt._native.handle
        lrs = (ctypes.c_double * 2)(LR, LR)
        none = (native.OffloadRangeStep * 1)()
        try:
            self.assertEqual(L.offload_speculate(h, lrs, 2, none, 0), 9)  # no step is open
            self.assertIn(b"no step", L.offload_last_error())
            self.assertEqual(L.offload_update_ready(h, 0, 10), 9)
            ours.opt.zero_grad()
            ours.opt.backward(loss_of(ours.model, 0))  # the step is open now
            self.assertEqual(L.offload_speculate(h, lrs, 1, none, 0), 3)  # one lr, two groups
            bad = (ctypes.c_double * 2)(LR, math.nan)
            self.assertEqual(L.offload_speculate(h, bad, 2, none, 0), 3)
            backwards = (native.OffloadRangeStep * 2)(native.OffloadRangeStep(100, 10, 1),
                                                     native.OffloadRangeStep(0, 10, 1))
            self.assertEqual(L.offload_speculate(h, lrs, 2, backwards, 2), 3)
            self.assertIn(b"sorted", L.offload_last_error())
            padded = ours.opt.padded_length
            self.assertEqual(L.offload_update_ready(h, padded, 1), 11)  # OUT_OF_RANGE
            self.assertEqual(L.offload_update_ready(h, 0, 0), 11)
            # Not speculating: an update offered is ignored.
            self.assertEqual(L.offload_update_ready(h, 0, 10), 0)
            ours.opt.step()
            plain.step(0)
            self.assertEqual(ours.opt.last_report["early_updated"], 0)
            self.assertEqual(ulps(ours.opt.master_weights(), plain.opt.master_weights()), 0)
        finally:
            ours.opt.close()
            plain.opt.close()


class Trace(unittest.TestCase):

    def test_the_update_runs_inside_backward(self) -> None:
        """The step's trace: the shard engine's early updates (in this process, on the sender's
        thread) end before the "backward" span does. The first layer's backward is made slow, as
        its compute would be on a big model, so the engine has a core meanwhile."""
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 64) for _ in range(6)]
        model = torch.nn.Sequential(*layers)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess",
                               bucket_elements=64 * 64, trace_file=path, threads=1,
                               update_in_backward=True)
            layers[0].weight.register_hook(lambda g: time.sleep(0.2))
            x = torch.randn(8, 64).to(torch.bfloat16)
            opt.backward(model(x).float().square().mean())
            opt.step()
            report = opt.last_report
            opt.close()
            events = json.load(open(path))
        self.assertEqual(report["early_updated"], opt.num_params)
        backward = [e for e in events if e["name"] == "backward" and e["args"]["step"] == 1]
        updates = [e for e in events if e["name"] == "update_early" and e["args"]["step"] == 1]
        self.assertEqual(len(backward), 1)
        end = backward[0]["ts"] + backward[0]["dur"]
        inside = [e for e in updates if e["ts"] + e["dur"] < end]
        self.assertGreaterEqual(len(inside), 4, f"updates {updates}, backward ends at {end}")


if __name__ == "__main__":
    unittest.main()
