"""accelerate with the front end, one process (run by CTest as `hf_accelerate_test_torch2`: the
torch 2 venv has accelerate).

A loop as accelerate's docs write it, ``accelerator.prepare(model, opt, dataloader,
scheduler)``, ``accumulate``, ``accelerator.backward``, ``accelerator.clip_grad_norm_`` on a
sync step, trains a tiny GPT2LMHeadModel with ``offload.torch.AdamW``:

- as torch's AdamW (single-tensor form, IEEE sqrt) on fp32 masters does in the same loop when it
  clips with our coefficients: the same master weights to the bit; the clip bites, and the norm
  ``clip_grad_norm_`` returns is the one the step used;
- ``save_state`` mid-run and ``load_state`` into a new accelerator, model and optimizer resume to
  the same bits, the optimizer's state streamed (``offload_optimizer/``, no ``optimizer.bin``);
- ``mixed_precision="fp16"``: the loss is scaled once, by the optimizer's own scale (not also by
  accelerate's GradScaler): the same bits as the hand-written loop with ``opt.backward(loss)``;
- clipping what the optimizer cannot answer exactly (part of its parameters, another norm) is
  refused with a clear error, never skipped;
- two processes (torchrun, what ``accelerate launch`` runs for several processes; gloo): the
  processes are the optimizer's ZeRO-2 ranks on one shared server, the model is not wrapped in
  DistributedDataParallel, both ranks hold the same weights after every step, and a stop after
  ``save_state`` and a resume by ``load_state`` end with the same bits as the run without the stop.

``OnCuda`` runs the one-process loops (torch's bits, save_state and load_state, fp16) on the GPU
where ``torch.cuda.is_available()`` (scripts/gpu-check runs it, a skip there being a failure):
the optimizer built with ``device=accelerator.device``, as the refusal of a CPU optimizer under a
GPU accelerator asks, and fp16 with accelerate's GradScaler, which exists only on a GPU. The same
reproducible kernels as hf_trainer_test's ``OnCuda``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer_test import LR, WD, MasterAdamW, Tokens, gpt2, reproducible_on  # noqa: E402
from torch_adamw_test import ulps  # noqa: E402

try:
    import accelerate  # type: ignore[import]
    from accelerate import Accelerator  # type: ignore[import]
    from accelerate.state import AcceleratorState, GradientState  # type: ignore[import]
except Exception:  # noqa: BLE001 - absent (Debian's torch 1.13 has no accelerate)
    accelerate = None

import offload.torch as otorch  # noqa: E402
from offload.server import LocalServer  # noqa: E402

STEPS = 10
ACCUMULATE = 2
MAX_NORM = 0.25


def fresh_accelerator(device: str = "cpu", **kwargs: Any) -> "Accelerator":
    """accelerate keeps its state in singletons: each run starts from none."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=device == "cpu", gradient_accumulation_steps=ACCUMULATE, **kwargs)


def fp32(x: float) -> float:
    """The norm as clip_grad_norm_ returns it: an fp32 tensor, as torch's own for fp32 grads."""
    return float(torch.tensor(x, dtype=torch.float32))


def lr_lambda(step: int) -> float:
    return min(1.0, (step + 1) / 4)


class Cases:
    """The cases of accelerate on ``device`` (a unittest.TestCase mixin)."""

    device = "cpu"
    assertEqual: Callable[..., None]
    assertTrue: Callable[..., None]
    assertFalse: Callable[..., None]
    assertGreater: Callable[..., None]

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="offload-hf-accelerate-")
        self.attn = reproducible_on(self, self.device)  # type: ignore[arg-type]
        warnings.filterwarnings("ignore", category=FutureWarning)

    def tearDown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_loop(self, opt_of, steps: Tuple[int, int] = (0, STEPS), save_at: Optional[int] = None,
                 load: Optional[str] = None, mixed_precision: str = "bf16"
                 ) -> Tuple[Any, torch.nn.Module, List[float], List[float]]:
        accelerator = fresh_accelerator(self.device, mixed_precision=mixed_precision)
        model = gpt2(self.attn)
        opt = opt_of(model)
        data = torch.utils.data.DataLoader(Tokens(STEPS * ACCUMULATE * 2), batch_size=2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
        if load is not None:
            accelerator.load_state(load)
        norms, coefs = [], []
        batches = list(data)
        for step in range(*steps):
            for micro in range(ACCUMULATE):
                with accelerator.accumulate(model):
                    batch = batches[step * ACCUMULATE + micro]
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(),
                                                                       MAX_NORM)))
                    opt.step()
                    sched.step()
                    opt.zero_grad()
            inner = opt.optimizer
            if isinstance(inner, otorch.AdamW):
                coefs.append(float(inner.last_report["clip_coef"]))
                self.assertEqual(norms[-1], fp32(inner.last_report["grad_norm"]))
            if save_at is not None and step + 1 == save_at:
                accelerator.save_state(os.path.join(self.dir, "state"))
        return opt.optimizer, model, norms, coefs

    def ours(self, model: torch.nn.Module, **kwargs: Any) -> otorch.AdamW:
        return otorch.AdamW(model.named_parameters(), lr=LR, weight_decay=WD, threads=1,
                            device=self.device, **kwargs)

    def test_trains_as_torch_and_resumes_from_save_state(self) -> None:
        opt, model, norms, coefs = self.run_loop(self.ours, save_at=STEPS // 2)
        self.assertTrue(any(c < 1.0 for c in coefs), f"clipping never bit: {coefs}")
        masters = opt.master_weights()
        opt.close()
        state = os.path.join(self.dir, "state")
        self.assertTrue(os.path.isdir(os.path.join(state, "offload_optimizer")),
                        os.listdir(state))
        self.assertFalse(any(f.startswith("optimizer") for f in os.listdir(state)))

        resumed, _, _, _ = self.run_loop(self.ours, steps=(STEPS // 2, STEPS), load=state)
        self.assertEqual(resumed.completed_steps, STEPS)
        self.assertEqual(ulps(masters, resumed.master_weights()), 0)
        resumed.close()

        ref = []
        _, ref_model, _, _ = self.run_loop(
            lambda m: ref.append(MasterAdamW(m, [{"params": list(m.parameters())}], MAX_NORM,
                                             coefs)) or ref[0])
        self.assertEqual(ulps(masters, ref[0].flat_masters()), 0)

    def test_fp16_is_scaled_once_by_the_optimizer(self) -> None:
        opt, _, _, _ = self.run_loop(lambda m: self.ours(m, dtype=torch.float16,
                                                         loss_scale=1024.0),
                                     mixed_precision="fp16")
        masters = opt.master_weights()
        self.assertGreater(opt.loss_scale, 1.0)
        opt.close()
        # The hand-written loop: the loss times the optimizer's scale, nothing else.
        model = gpt2(self.attn).to(self.device)
        hand = self.ours(model, dtype=torch.float16, loss_scale=1024.0)
        sched = torch.optim.lr_scheduler.LambdaLR(hand, lr_lambda)
        batches = list(torch.utils.data.DataLoader(Tokens(STEPS * ACCUMULATE * 2), batch_size=2))
        try:
            for step in range(STEPS):
                for micro in range(ACCUMULATE):
                    batch = {k: v.to(self.device)
                             for k, v in batches[step * ACCUMULATE + micro].items()}
                    with torch.autocast(self.device, dtype=torch.float16):
                        loss = model(**batch).loss
                    hand.backward(loss.float() / ACCUMULATE)
                hand.clip_grad_norm_(MAX_NORM)
                hand.step()
                sched.step()
                hand.zero_grad()
            self.assertEqual(ulps(masters, hand.master_weights()), 0)
        finally:
            hand.close()


@unittest.skipIf(accelerate is None, "accelerate does not import here (scripts/build puts it "
                 "into the torch 2 venv)")
class AccelerateTrains(Cases, unittest.TestCase):

    def test_two_processes_are_the_optimizers_ranks(self) -> None:
        token = "t0k3n-" + "b" * 20
        server = LocalServer(threads=1, token=token)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_accelerate_rank.py")
        env = dict(os.environ, OFFLOAD_TEST_SERVER=server.address, OFFLOAD_TOKEN=token,
                   OMP_NUM_THREADS="1")
        try:
            for mode in ("whole", "first", "resume"):
                run = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", worker,
                                      self.dir, mode], env=env, capture_output=True, text=True,
                                     timeout=600)
                self.assertEqual(run.returncode, 0, f"{mode}:\n{run.stdout}\n{run.stderr}")
        finally:
            server.close()
        got = {(mode, r): torch.load(os.path.join(self.dir, f"{mode}-rank{r}.pt"))
               for mode in ("whole", "resume") for r in (0, 1)}
        whole, resumed = got["whole", 0], got["resume", 0]
        self.assertTrue(any(c < 1.0 for c in whole["coefs"]), whole["coefs"])
        self.assertEqual((whole["steps"], resumed["steps"]), (10, 10))
        self.assertEqual(ulps(whole["masters"], resumed["masters"]), 0)
        for key in got:
            for a, b in zip(whole["weights"], got[key]["weights"]):
                self.assertTrue(torch.equal(a.view(torch.int16), b.view(torch.int16)), key)
        # The masters rounded are what both ranks compute with.
        flat = torch.cat([w.float().reshape(-1) for w in whole["weights"]])
        self.assertTrue(torch.equal(whole["masters"].to(torch.bfloat16).float(), flat))

    def test_clipping_it_cannot_answer_is_refused(self) -> None:
        accelerator = fresh_accelerator()
        model = gpt2()
        opt = self.ours(model)
        try:
            model, opt = accelerator.prepare(model, opt)
            batch = next(iter(torch.utils.data.DataLoader(Tokens(2), batch_size=2)))
            accelerator.backward(model(**batch).loss)
            head = list(model.parameters())[:2]
            with self.assertRaisesRegex(ValueError, "part of an offload optimizer"):
                accelerator.clip_grad_norm_(head, 1.0)
            with self.assertRaisesRegex(ValueError, "norm_type"):
                accelerator.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)
            with self.assertRaisesRegex(ValueError, "part of an offload optimizer"):
                torch.nn.utils.clip_grad_norm_(head, 1.0)
            # torch's own function answers for the whole model, as accelerate's does.
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.assertGreater(float(norm), 0.0)
            opt.step()
            self.assertEqual(fp32(opt.optimizer.last_report["grad_norm"]), float(norm))
        finally:
            opt.optimizer.close()


@unittest.skipIf(accelerate is None, "accelerate does not import here")
@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device here: accelerate on CUDA runs "
                     "where torch.cuda.is_available() (scripts/gpu-check runs this class)")
class OnCuda(Cases, unittest.TestCase):
    device = "cuda"


if __name__ == "__main__":
    unittest.main()
