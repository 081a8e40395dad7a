"""Hugging Face's Trainer with the front end (run by CTest as `hf_trainer_test_torch2`: transformers
needs torch 2, so only the torch 2 venv runs it).

A tiny LlamaForCausalLM and a tiny GPT2LMHeadModel, built from configs (nothing downloaded), are
trained by Trainer for 20 steps: 2 micro-batches a step, a linear warm-up, clipping at a norm
that bites, bf16. For each:

- resume: a run stopped after the save at step 10 and resumed from that checkpoint in a new
  Trainer (a new optimizer, a new server) ends with the same master and 16-bit weights, to the
  bit, as the run without the stop. Through ``offload.hf.Trainer`` (the optimizer's state
  streamed to ``checkpoint-10/offload_optimizer``, no ``optimizer.pt``), and through the plain
  ``transformers.Trainer`` with ``optimizer_cls_and_kwargs`` (``state_dict()`` pickled).
- torch: the same Trainer with torch's AdamW in its single-tensor form on fp32 masters (the
  reference below; torch 2.x's update written out with an IEEE sqrt, the servers' arithmetic,
  README "Bring your own PyTorch model") gives the same master weights to the bit, when it clips
  with the coefficient ours chose; torch's own coefficient, from its fp32 norm of the same
  gradients, differs from ours by no more than that norm's rounding can move it.

Clipping goes through Trainer's ``accelerator.clip_grad_norm_``, which finds no ``p.grad`` (the
front end frees them): ``offload.hf.accelerator`` makes it clip by the global norm, and the test
checks that it bit. The DeepSpeed config bridge trains under the Trainer too.

``OnCuda`` runs the cases whose path changes with the device (Trainer puts the model on the GPU,
so the optimizer keeps its 16-bit weights there and its gradients leave through the CUDA path;
fp16 brings accelerate's GradScaler) where ``torch.cuda.is_available()``: scripts/gpu-check runs
it, a skip there being a failure. Its bit-for-bit checks need one set of gradient bits from
every run of a model: cuBLAS's fixed workspace, torch's deterministic kernels, and eager
attention (no fused kernel whose backward adds in a varying order). The reference's masters and
arithmetic stay on the CPU, where the servers' is.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import unittest
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

# Before the first cuBLAS handle (OnCuda): its reductions in a fixed order, run to run.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_adamw_test import ContractAdamW, ulps  # noqa: E402

try:
    import transformers  # type: ignore[import]
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig,  # type: ignore[import]
                              LlamaForCausalLM, TrainerCallback, TrainingArguments)
except Exception:  # noqa: BLE001 - absent (Debian's torch 1.13 has no transformers)
    transformers = None
    TrainerCallback = object  # Record's base, so that the module loads and its classes skip

import offload.hf  # noqa: E402
import offload.torch as otorch  # noqa: E402
from offload import clipping  # noqa: E402

STEPS = 20
SAVE_AT = 10
VOCAB, SEQ = 96, 12
MAX_NORM = 0.25  # bites: the warm-up's first steps have norms of 1 to 3 here
LR, WD = 2e-3, 0.1


def attention(attn: Optional[str]) -> Dict[str, Any]:
    """A config's attention implementation: transformers' default where None."""
    return {} if attn is None else {"attn_implementation": attn}


def llama(attn: Optional[str] = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=SEQ,
                                        **attention(attn)))


def gpt2(attn: Optional[str] = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                      **attention(attn)))


def reproducible_on(test: unittest.TestCase, device: str) -> Optional[str]:
    """On CUDA, torch's deterministic kernels for the test (warnings name any op without one,
    whose bits the test's comparisons then catch) and eager attention, returned for the models'
    configs; on the CPU nothing changes (None: the default attention)."""
    if device != "cuda":
        return None
    torch.use_deterministic_algorithms(True, warn_only=True)
    test.addCleanup(torch.use_deterministic_algorithms, False)
    return "eager"


class Tokens(torch.utils.data.Dataset):
    """Fixed token sequences (labels = inputs: a causal LM shifts them itself)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out: str, **overrides: Any) -> "TrainingArguments":
    kwargs = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  max_steps=STEPS, learning_rate=LR, weight_decay=WD, warmup_steps=5,
                  lr_scheduler_type="linear", max_grad_norm=MAX_NORM, bf16=True,
                  save_strategy="steps", save_steps=SAVE_AT, logging_steps=5, report_to=[],
                  use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
                  save_only_model=False)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


class Record(TrainerCallback):
    """Each step's clip coefficient and skip (the offload optimizer's report) and the lr the step
    had, and a stop after `stop`."""

    def __init__(self, stop: Optional[int] = None) -> None:
        self.coefs: List[float] = []
        self.skipped: List[bool] = []
        self.lrs: List[float] = []
        self.stop = stop

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> Any:
        opt = clipping.owner_of(optimizer)
        if opt is not None:
            self.coefs.append(float(opt.last_report["clip_coef"]))
            self.skipped.append(bool(opt.last_report["skipped"]))
            self.lrs.append(optimizer.param_groups[0]["lr"])  # after the schedule's step
        if self.stop is not None and state.global_step >= self.stop:
            control.should_training_stop = True
        return control


class MasterAdamW(torch.optim.Optimizer):
    """The reference: torch's single-tensor AdamW (ContractAdamW: torch 2.x's form with an IEEE
    sqrt) on fp32 masters of a bf16 model. Each micro-batch's bf16 gradient is added to the
    master's fp32 gradient as autograd leaves it (as the servers sum them), and the global norm
    of the sum is clipped in fp32, with torch's coefficient (recorded) or the one given per step.
    The masters rounded go back into the model after each step. The masters, their gradients
    and the update are on the CPU whatever the model's device (the servers' arithmetic is the
    CPU's: CUDA's kernels may contract a multiply and an add that the CPU's round apart)."""

    def __init__(self, model: torch.nn.Module, groups: List[Dict[str, Any]], max_norm: float,
                 coefs: Optional[List[float]] = None) -> None:
        self.masters = {id(p): p.detach().float().cpu().clone() for g in groups
                        for p in g["params"]}
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
        super().__init__(groups, dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD))
        inner = [{**{k: v for k, v in g.items() if k != "params"},
                  "params": [self.masters[id(p)] for p in g["params"]]} for g in self.param_groups]
        self.inner = ContractAdamW(inner, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
        self.max_norm, self.coefs, self.torch_coefs, self.norms = max_norm, coefs, [], []
        self.handles = [p.register_post_accumulate_grad_hook(self._arrived)
                        for g in self.param_groups for p in g["params"]]

    def _arrived(self, p: torch.Tensor) -> None:
        m = self.masters[id(p)]
        grad = p.grad.float().cpu()
        m.grad = grad if m.grad is None else m.grad + grad
        p.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        masters = [m for g in self.inner.param_groups for m in g["params"]]
        for g, inner in zip(self.param_groups, self.inner.param_groups):
            inner["lr"] = g["lr"]
        norm = torch.nn.utils.clip_grad_norm_(masters, math.inf)  # measure only
        coef = float(torch.clamp(self.max_norm / (norm + 1e-6), max=1.0))
        self.torch_coefs.append(coef)
        self.norms.append(float(norm))
        use = coef if self.coefs is None else self.coefs[len(self.torch_coefs) - 1]
        for m in masters:
            m.grad.mul_(torch.tensor(use, dtype=torch.float32))
        self.inner.step()
        for g in self.param_groups:
            for p in g["params"]:
                p.copy_(self.masters[id(p)].to(p.dtype))  # rounded here, then moved
                self.masters[id(p)].grad = None

    def flat_masters(self) -> torch.Tensor:
        return torch.cat([self.masters[id(p)].reshape(-1) for g in self.param_groups
                          for p in g["params"]])


def trainer_groups(model: torch.nn.Module) -> List[Dict[str, Any]]:
    """Trainer's own grouping: no decay for biases and norms."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decay], "weight_decay": WD},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


class Cases:
    """The cases of a Trainer on ``device`` (a unittest.TestCase mixin)."""

    device = "cpu"
    assertEqual: Callable[..., None]
    assertTrue: Callable[..., None]
    assertLessEqual: Callable[..., None]

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="offload-hf-trainer-")
        self.data = Tokens(STEPS * 4)
        self.attn = reproducible_on(self, self.device)  # type: ignore[arg-type]
        warnings.filterwarnings("ignore", category=FutureWarning)

    def tearDown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def llama(self) -> torch.nn.Module:
        return llama(self.attn)

    def gpt2(self) -> torch.nn.Module:
        return gpt2(self.attn)

    def arguments(self, out: str, **overrides: Any) -> "TrainingArguments":
        return arguments(os.path.join(self.dir, out), use_cpu=self.device == "cpu", **overrides)

    def train(self, make_model: Callable[[], torch.nn.Module], subclass: bool, out: str,
              stop: Optional[int] = None, resume: Optional[str] = None,
              **trainer_kwargs: Any) -> Tuple[Any, torch.nn.Module, Record]:
        model = make_model()
        args = self.arguments(out)
        record = Record(stop)
        if subclass:
            trainer = offload.hf.Trainer(model=model, args=args, train_dataset=self.data,
                                         callbacks=[record], offload_kwargs=dict(threads=1),
                                         **trainer_kwargs)
        else:
            trainer = transformers.Trainer(
                model=model, args=args, train_dataset=self.data, callbacks=[record],
                optimizer_cls_and_kwargs=offload.hf.optimizer_cls_and_kwargs(args, threads=1),
                **trainer_kwargs)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, model, record

    def finish(self, trainer: Any) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        opt = clipping.owner_of(trainer.optimizer)
        masters = opt.master_weights()
        weights = [p.detach().clone() for p in trainer.model.parameters()]
        opt.close()
        return masters, weights

    def check_model(self, make_model: Callable[[], torch.nn.Module], subclass: bool) -> None:
        whole, _, record = self.train(make_model, subclass, "whole")
        self.assertEqual(whole.state.global_step, STEPS)
        coefs = record.coefs
        self.assertEqual(len(coefs), STEPS)
        self.assertTrue(any(c < 1.0 for c in coefs), f"clipping never bit: {coefs}")
        self.assertTrue(any(c == 1.0 for c in coefs) or min(coefs) < 0.5, coefs)
        masters, weights = self.finish(whole)

        # Stopped after the save at SAVE_AT, resumed in a new Trainer with a new optimizer.
        first, _, _ = self.train(make_model, subclass, "stopped", stop=SAVE_AT)
        self.assertEqual(first.state.global_step, SAVE_AT)
        self.finish(first)
        checkpoint = os.path.join(self.dir, "stopped", f"checkpoint-{SAVE_AT}")
        streamed = os.path.isdir(os.path.join(checkpoint, "offload_optimizer"))
        pickled = os.path.isfile(os.path.join(checkpoint, "optimizer.pt"))
        self.assertEqual((streamed, pickled), (subclass, not subclass), os.listdir(checkpoint))
        resumed, _, _ = self.train(make_model, subclass, "stopped", resume=checkpoint)
        self.assertEqual(resumed.state.global_step, STEPS)
        masters2, weights2 = self.finish(resumed)
        self.assertEqual(ulps(masters, masters2), 0)
        for a, b in zip(weights, weights2):
            self.assertTrue(torch.equal(a.view(torch.int16), b.view(torch.int16)))

        # torch's AdamW under the same Trainer, clipping with our coefficients: the same bits.
        model = make_model()
        ref = MasterAdamW(model, trainer_groups(model), MAX_NORM, coefs=coefs)
        trainer = transformers.Trainer(model=model, args=self.arguments("ref"),
                                       train_dataset=self.data, optimizers=(ref, None))
        trainer.train()
        for h in ref.handles:
            h.remove()
        self.assertEqual(ulps(masters, ref.flat_masters()), 0)
        for a, p in zip(weights, model.parameters()):
            self.assertTrue(torch.equal(a.view(torch.int16), p.detach().view(torch.int16)))
        # torch's own coefficient: its fp32 norm sums n squares (relative error <= n 2^-24),
        # the square root halves that, the division adds a rounding (torch_adamw_test).
        n = sum(p.numel() for p in model.parameters())
        bound = (n * 2.0 ** -24) / 2 + 2.0 ** -23
        for ours, theirs in zip(coefs, ref.torch_coefs):
            self.assertLessEqual(abs(ours - theirs), bound * theirs + 1e-12)

    def test_llama_with_offload_hf_trainer(self) -> None:
        self.check_model(self.llama, subclass=True)

    def test_gpt2_with_plain_trainer_and_optimizer_cls_and_kwargs(self) -> None:
        self.check_model(self.gpt2, subclass=False)

    def test_zero3_trains_as_stage_2_and_saves_the_gathered_model(self) -> None:
        """offload_kwargs=dict(zero_stage=3): Trainer's factory protocol hands the optimizer the
        model; the same bits as stage 2, and save_model writes every parameter (they are empty
        outside the forward) as the masters rounded."""
        masters = {}
        for stage in (2, 3):
            model = self.llama()
            trainer = offload.hf.Trainer(
                model=model, args=self.arguments(f"z{stage}", max_steps=4),
                train_dataset=self.data, offload_kwargs=dict(threads=1, zero_stage=stage))
            trainer.train()
            opt = trainer.offload_optimizer
            self.assertEqual(opt.zero_stage, stage)
            masters[stage] = opt.master_weights()
            final = os.path.join(self.dir, f"z{stage}", "final")
            trainer.save_model(final)
            names = {id(p): n for n, p in model.named_parameters()}
            opt.close()
            saved = dict(LlamaForCausalLM.from_pretrained(final).named_parameters())
            flat = torch.cat([saved[names[id(p)]].detach().reshape(-1)
                              for g in opt.param_groups for p in g["params"]])
            self.assertTrue(torch.equal(flat.to(torch.bfloat16),
                                        masters[stage].to(torch.bfloat16)), stage)
        self.assertEqual(ulps(masters[2], masters[3]), 0)

    def test_fp16_overflow_evaluation_and_the_best_model(self) -> None:
        """fp16=True: the optimizer's loss scale (once), an overflow skipped by the servers and
        seen by Trainer (the schedule does not move that step), evaluation, and
        load_best_model_at_end loading an earlier checkpoint into the model."""
        poison_at = 5

        class Poisoned(offload.hf.Trainer):
            def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[override]
                loss = super().compute_loss(model, inputs, *args, **kwargs)
                return loss * math.inf if self.state.global_step == poison_at else loss

        model = self.gpt2()
        args = self.arguments("fp16", bf16=False, fp16=True, max_steps=12, save_steps=4,
                              eval_strategy="steps", eval_steps=4, load_best_model_at_end=True,
                              metric_for_best_model="loss", greater_is_better=True,
                              logging_nan_inf_filter=False)
        record = Record()
        trainer = Poisoned(model=model, args=args, train_dataset=self.data,
                           eval_dataset=Tokens(8), callbacks=[record],
                           offload_kwargs=dict(threads=1, loss_scale=1024.0))
        trainer.train()
        opt = trainer.offload_optimizer
        try:
            self.assertEqual(opt.dtype, torch.float16)
            self.assertEqual(next(model.parameters()).dtype, torch.float16)
            self.assertEqual(record.skipped, [k == poison_at for k in range(12)])
            self.assertEqual(opt.skipped_steps, 1)
            self.assertEqual(opt.loss_scale, 512.0)  # halved once, never doubled (window 2000)
            # Trainer saw the skip: the schedule did not move at that step, and did at the others.
            moved = [a != b for a, b in zip(record.lrs, record.lrs[1:])]
            self.assertEqual(moved, [k + 1 != poison_at for k in range(11)], record.lrs)
            self.assertTrue(all(h["loss_scale"] in (1024.0, 512.0)
                                for h in trainer.state.log_history if "loss" in h))
            self.assertEqual(len([h for h in trainer.state.log_history if "eval_loss" in h]), 3)
            best = trainer.state.best_model_checkpoint
            self.assertTrue(best.endswith("checkpoint-4"), best)  # the highest loss: the first
            from safetensors.torch import load_file
            saved = load_file(os.path.join(best, "model.safetensors"))
            for name, p in model.named_parameters():
                if name in saved:
                    self.assertTrue(torch.equal(saved[name], p.detach().cpu()), name)
        finally:
            opt.close()


@unittest.skipIf(transformers is None, "transformers does not import here (scripts/build puts "
                 "it into the torch 2 venv)")
class TrainerTrains(Cases, unittest.TestCase):

    def test_an_optimizer_from_a_deepspeed_config_handed_over(self) -> None:
        """optimizers=(offload.hf.from_deepspeed_config(config, model, args), None): the config's
        "auto" values are the TrainingArguments', Trainer builds the schedule on the optimizer,
        and it trains as offload.hf.Trainer's own optimizer does (its groups aside: DeepSpeed
        decays every parameter, so both do here)."""
        config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                            "eps": "auto",
                                                            "weight_decay": "auto"}},
                  "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
                  "gradient_accumulation_steps": "auto"}
        masters = []
        for bridge in (True, False):
            model = gpt2()
            args = self.arguments(f"ds{bridge}", max_steps=6)
            if bridge:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # every key here is honoured
                    opt = offload.hf.from_deepspeed_config(config, model, args, threads=1)
            else:
                opt = otorch.AdamW(model.named_parameters(), lr=args.learning_rate,
                                   betas=(args.adam_beta1, args.adam_beta2),
                                   eps=args.adam_epsilon, weight_decay=args.weight_decay,
                                   max_grad_norm=args.max_grad_norm, threads=1)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=self.data,
                                           optimizers=(opt, None))
            trainer.train()
            self.assertEqual(opt.completed_steps, 6)
            masters.append(opt.master_weights())
            opt.close()
        self.assertEqual(ulps(masters[0], masters[1]), 0)


@unittest.skipIf(transformers is None, "transformers does not import here")
@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device here: Trainer on CUDA runs where "
                     "torch.cuda.is_available() (scripts/gpu-check runs this class)")
class OnCuda(Cases, unittest.TestCase):
    device = "cuda"


if __name__ == "__main__":
    unittest.main()
