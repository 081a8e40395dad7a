"""offload.hf.from_deepspeed_config: a DeepSpeed ZeRO-Offload config as the optimizer it asks for
(run by CTest as `hf_deepspeed_config_test_torch2`; the TrainingArguments cases need
transformers, which only the torch 2 venv has).

The configs are the ones users write: transformers' documented ZeRO-2 and ZeRO-3 offload
examples with their "auto" values, which the TrainingArguments fill as transformers' DeepSpeed
integration does. Every key the optimizer does not honour must be named in the warning; a config
that asks for what the servers cannot do is refused before anything is built.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import unittest
import warnings
from typing import Any, Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload.torch as otorch  # noqa: E402
from offload.hf.deepspeed_config import from_deepspeed_config, read_config  # noqa: E402

try:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # type: ignore
except Exception:  # noqa: BLE001 - absent (Debian's torch 1.13 has no transformers)
    TrainingArguments = None

ZERO2: Dict[str, Any] = {  # transformers' docs, "ZeRO-2 config" with offload_optimizer
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

ZERO3: Dict[str, Any] = {  # transformers' docs, "ZeRO-3 config" with both offloads
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "reduce_bucket_size": 4096,
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": 100,
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4,
}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=16, bos_token_id=0, eos_token_id=0))


def not_honoured(read: Any) -> Dict[str, str]:
    return {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in read.not_honoured}


class ReadsConfigs(unittest.TestCase):

    @unittest.skipIf(TrainingArguments is None, "transformers does not import here")
    def test_zero2_auto_values_from_the_training_arguments(self) -> None:
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), learning_rate=5e-4,
                                 adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7,
                                 weight_decay=0.05, max_grad_norm=0.5, fp16=False, bf16=True,
                                 per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 use_cpu=True, report_to=[])
        model = tiny_gpt2()
        read = read_config(ZERO2, model, args)
        self.assertIs(read.cls, otorch.AdamW)
        self.assertEqual(read.kwargs, dict(
            zero_stage=2, optimizer_state="memory", bucket_elements=32 * 32, lr=5e-4,
            betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05, max_grad_norm=0.5,
            dtype=torch.bfloat16))
        named = not_honoured(read)
        for key in ("scheduler.type", "scheduler.params.warmup_num_steps", "steps_per_print",
                    "zero_optimization.allgather_bucket_size", "zero_optimization.overlap_comm",
                    "wall_clock_breakdown", "fp16.hysteresis", "fp16.min_loss_scale"):
            self.assertIn(key, named)
        # Honoured: by the optimizer, or as the TrainingArguments' (auto, agreeing).
        for key in ("zero_optimization.stage", "optimizer.params.lr", "bf16.enabled",
                    "gradient_clipping", "zero_optimization.offload_optimizer.device",
                    "gradient_accumulation_steps", "train_batch_size",
                    "zero_optimization.reduce_bucket_size"):
            self.assertNotIn(key, named)

    def test_zero3_with_both_offloads(self) -> None:
        read = read_config(ZERO3, None, None)
        self.assertIs(read.cls, otorch.AdamW)  # DeepSpeed's "Adam" is AdamW (adam_w_mode)
        self.assertEqual(read.kwargs["zero_stage"], 3)
        self.assertEqual(read.kwargs["persist_elements"], 100)
        self.assertEqual(read.kwargs["max_resident_bytes"], 2 * 10 ** 9)
        self.assertEqual(read.kwargs["betas"], (0.9, 0.95))
        self.assertEqual(read.kwargs["max_grad_norm"], 1.0)
        named = not_honoured(read)
        self.assertIn("zero_optimization.stage3_prefetch_bucket_size", named)
        self.assertIn("zero_optimization.sub_group_size", named)
        self.assertIn("train_micro_batch_size_per_gpu", named)  # no args: the Trainer's
        self.assertNotIn("zero_optimization.offload_param.device", named)

    def test_adam_without_decoupled_decay_and_nvme_and_fp16(self) -> None:
        config = {"zero_optimization": {"stage": 2, "offload_optimizer": {
                      "device": "nvme", "nvme_path": "/local_nvme"}},
                  "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "lr": 1e-3}},
                  "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500,
                           "loss_scale": 128}}
        read = read_config(config)
        self.assertIs(read.cls, otorch.Adam)
        self.assertEqual(read.kwargs["optimizer_state"], "disk")
        self.assertEqual(read.kwargs["state_dir"], "/local_nvme")
        self.assertEqual(read.kwargs["dtype"], torch.float16)
        self.assertEqual(read.kwargs["loss_scale"], 4096.0)
        self.assertEqual(read.kwargs["loss_scale_window"], 500)
        self.assertIn("fp16.loss_scale", not_honoured(read))  # a static scale

    def test_bf16_optimizer_states_are_bf16_moments(self) -> None:
        config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                  "bf16": {"enabled": True, "bf16_optimizer_states": True,
                           "bf16_master_weights_and_grads": True}}
        read = read_config(config)
        self.assertEqual(read.kwargs["state_dtype"], torch.bfloat16)
        self.assertEqual(read.kwargs["dtype"], torch.bfloat16)
        self.assertIn("bf16.bf16_master_weights_and_grads", not_honoured(read))
        self.assertNotIn("bf16.bf16_optimizer_states", not_honoured(read))
        config["bf16"] = {"enabled": True, "bf16_optimizer_states": False}
        self.assertNotIn("state_dtype", read_config(config).kwargs)
        # With nvme, the bf16 moments go to the disk tier's files.
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/x"}
        config["bf16"] = {"enabled": True, "bf16_optimizer_states": True}
        read = read_config(config)
        self.assertEqual(read.kwargs["state_dtype"], torch.bfloat16)
        self.assertEqual(read.kwargs["optimizer_state"], "disk")

    def test_what_cannot_be_done_is_refused(self) -> None:
        for config, words in (
                ({"zero_optimization": {"stage": 0}}, "no ZeRO"),
                ({}, "no ZeRO"),
                ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}, "Adam"),
                ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
                 "nvme_path"),
                ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True},
                  "bf16": {"enabled": True}}, "both")):
            with self.subTest(config=config):
                with self.assertRaisesRegex(ValueError, words):
                    read_config(config)

    def test_builds_the_optimizer_and_warns_once_from_a_file(self) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                             "overlap_comm": True},
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}, f)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = from_deepspeed_config(f.name, model, threads=1)
        finally:
            os.unlink(f.name)
        try:
            messages = [str(w.message) for w in caught if "DeepSpeed" in str(w.message)]
            self.assertEqual(len(messages), 1, messages)
            self.assertIn("zero_optimization.overlap_comm", messages[0])
            self.assertEqual(opt.param_groups[0]["lr"], 1e-2)
            x = torch.randn(4, 8).to(torch.bfloat16)
            before = opt.master_weights().clone()
            model(x).float().pow(2).mean().backward()
            opt.step()
            self.assertFalse(torch.equal(before, opt.master_weights()))
        finally:
            opt.close()


if __name__ == "__main__":
    unittest.main()
