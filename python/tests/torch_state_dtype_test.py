"""state_dtype=torch.bfloat16: the servers keep the Adam moments in bf16 (8 bytes of state a
parameter instead of 12), run by CTest as `torch_state_dtype_test`.

- The moments the servers hold are bf16 values, and they change the run (it is not fp32 state
  under another name); stochastic and nearest rounding differ from each other.
- Every run gives the same bits: again, through a local server instead of the in-process engine,
  with the update during backward (whose early update and commit round alike), and with the
  state on the server's disk tier (bf16 moments in its state files).
- A checkpoint says which storage saved it, and resuming from it gives the uninterrupted run's
  bits; an fp32 checkpoint loads into bf16 state too.
- What cannot be honoured is refused before anything starts.
"""

from __future__ import annotations

import os
import sys
import tempfile
import unittest
import zlib
from typing import Any, Dict, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.checkpoint as ockpt  # noqa: E402
import offload.torch as otorch  # noqa: E402
from offload import native  # noqa: E402
from torch_test_util import TinyNet  # noqa: E402

VOCAB = 32


def model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet(vocab=VOCAB, width=24, hidden=40).to(torch.bfloat16)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(100 + step))


def train(net: TinyNet, opt: otorch.AdamW, first: int, last: int) -> float:
    loss = torch.tensor(0.0)
    for step in range(first, last):
        x = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x).view(-1, VOCAB), x.view(-1))
        opt.backward(loss)
        opt.step()
    return float(loss)


def run(steps: int = 6, **kwargs: Any) -> Tuple[bytes, Dict[str, Any], float]:
    """The master weights' bytes, the state_dict and the last loss after `steps` steps."""
    net = model()
    kwargs.setdefault("servers", "inprocess")
    opt = otorch.AdamW(net.parameters(), lr=3e-2, **kwargs)
    try:
        loss = train(net, opt, 0, steps)
        return opt.master_weights().numpy().tobytes(), opt.state_dict(), loss
    finally:
        opt.close()


def moments(state: Dict[str, Any]) -> torch.Tensor:
    return torch.cat([torch.cat([s["exp_avg"].flatten(), s["exp_avg_sq"].flatten()])
                      for s in state["state"].values()])


class StateDtypeTest(unittest.TestCase):
    def test_moments_are_bf16_and_change_the_run(self) -> None:
        fp32, fp32_state, fp32_loss = run()
        bf16, bf16_state, bf16_loss = run(state_dtype=torch.bfloat16)
        nearest, _, _ = run(state_dtype=torch.bfloat16, state_rounding="nearest")
        m32, m16 = moments(fp32_state), moments(bf16_state)
        self.assertEqual(m16.dtype, torch.float32)  # torch's layout, whatever the storage
        self.assertTrue(torch.equal(m16, m16.to(torch.bfloat16).float()),
                        "the bf16 run's moments are not bf16 values")
        self.assertFalse(torch.equal(m32, m32.to(torch.bfloat16).float()),
                         "the fp32 run's moments are all bf16 values: the test shows nothing")
        self.assertNotEqual(fp32, bf16)
        self.assertNotEqual(bf16, nearest)
        print(f"\nloss after 6 steps: fp32 state {fp32_loss:.4f}, bf16 state {bf16_loss:.4f}")

    def test_same_bits_every_run(self) -> None:
        first, _, _ = run(state_dtype=torch.bfloat16)
        self.assertEqual(first, run(state_dtype=torch.bfloat16)[0], "again")
        self.assertEqual(first, run(state_dtype=torch.bfloat16, servers=None)[0],
                         "through a local server")
        self.assertEqual(first, run(state_dtype=torch.bfloat16, servers=None,
                                    update_in_backward=True)[0], "with the update in backward")
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(first, run(state_dtype=torch.bfloat16, servers=None, state_dir=d,
                                        optimizer_state="disk")[0], "on the disk tier")

    def resumed(self, saving: Optional[torch.dtype], loading: Optional[torch.dtype]
                ) -> Tuple[bytes, ockpt.Manifest]:
        """Saved after 3 steps with `saving` state, loaded into a new optimizer with `loading`
        state, 3 steps more: the master weights and the checkpoint's manifest."""
        with tempfile.TemporaryDirectory() as d:
            net = model()
            opt = otorch.AdamW(net.parameters(), lr=3e-2, servers="inprocess",
                               state_dtype=saving)
            train(net, opt, 0, 3)
            saved = opt.save_checkpoint(d)
            opt.close()
            net = model()
            opt = otorch.AdamW(net.parameters(), lr=3e-2, servers="inprocess",
                               state_dtype=loading)
            try:
                opt.load_checkpoint(d)
                train(net, opt, 3, 6)
                return opt.master_weights().numpy().tobytes(), ockpt.read_manifest(saved)
            finally:
                opt.close()

    def test_checkpoint_says_which_and_resumes_exactly(self) -> None:
        whole, _, _ = run(state_dtype=torch.bfloat16)
        resumed, manifest = self.resumed(torch.bfloat16, torch.bfloat16)
        self.assertEqual(manifest.state_dtype, torch.bfloat16)
        self.assertEqual(zlib.crc32(resumed), zlib.crc32(whole), "resumed != uninterrupted")
        # An fp32 checkpoint into bf16 state: its moments rounded to nearest, then on as bf16.
        into_bf16, manifest = self.resumed(None, torch.bfloat16)
        self.assertEqual(manifest.state_dtype, torch.float32)
        self.assertNotEqual(into_bf16, run()[0])

    def test_refusals(self) -> None:
        net = model()
        for kwargs, words in [
                (dict(state_dtype=torch.float16), "state_dtype"),
                (dict(state_dtype="int8"), "state_dtype"),
                (dict(state_dtype=torch.bfloat16, state_rounding="up"), "state_rounding")]:
            with self.subTest(**{k: str(v) for k, v in kwargs.items()}):
                with self.assertRaisesRegex(ValueError, words):
                    otorch.AdamW(net.parameters(), servers="inprocess", **kwargs)

    def test_the_c_abi_refuses_what_it_does_not_know(self) -> None:
        groups = (native.OffloadGroup * 1)(native.OffloadGroup(
            offset=0, length=64, kind=native.ADAMW, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.0))
        for fields, words in [(dict(state_dtype=native.FP16), "state_dtype 2"),
                              (dict(state_dtype=native.BF16, state_rounding=5),
                               "state_rounding 5")]:
            config = native.OffloadConfig(
                abi_version=native.ABI_VERSION, job_id=b"abi-refusal", num_params=64,
                world_size=1, rank=0, create_job=1, dtype=native.BF16, num_groups=1,
                groups=groups, num_shards=0, **fields)
            with self.subTest(words=words):
                with self.assertRaisesRegex(native.OffloadError, words):
                    native.NativeOptimizer.create(config)


if __name__ == "__main__":
    unittest.main()
