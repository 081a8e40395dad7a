"""Two ranks with torch.distributed (gloo) train what one rank with the whole batch trains, with
and without gradient accumulation (run by CTest as `torch_distributed_test`). Each rank computes its half of the batch; the optimizer sums
the ranks' gradients in fp32, each rank sends the mean of its partition to the shared server,
commits it and the partitions are all-gathered.

The two runs differ by the ranks' 16-bit rounding of their own gradients before the mean (one
rank rounds the whole gradient once). The bound is measured against a noise floor in the same
test: one rank run again with another loss scale (3 * 2^k instead of 2^k), which rounds every
fp16 gradient differently once. Two ranks round three times where the floor run rounds once
differently; independent roundings add in quadrature (sqrt(3) ~ 1.7 in expectation), so the
bound is 4 floors, leaving room for the maximum over elements of such a walk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_test_util import SharedBlockModel, TinyNet  # noqa: E402

STEPS = 8
ROWS = 8


def train(rank: int, world: int, address: str, token: str, out: str, loss_scale: float,
          init_file: str, micro: int = 1, trace: str = "", speculate: bool = False,
          zero_stage: int = 2, blocks: bool = False) -> None:
    import offload.torch as otorch
    group = None
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        group = dist.group.WORLD
    # Each rank its own initial values: the servers take rank 0's, and every rank computes with
    # those (the optimizer broadcasts them, as DDP does).
    torch.manual_seed(5 + rank)
    # blocks: a model of blocks in bf16, which ZeRO-3 fetches block by block (all-gathered from
    # the ranks' partitions); else TinyNet in fp16, all of it fetched for the whole forward.
    model = SharedBlockModel(31) if blocks else TinyNet(31, 20, 45)
    dtype = torch.bfloat16 if blocks else torch.float16
    # A frozen parameter: never trained, and rank 0's on every rank (the optimizer broadcasts
    # it with the rest).
    frozen = model.head.bias if blocks else model.fc1.bias
    frozen.requires_grad_(False)
    frozen0 = None
    if world > 1:
        import torch.distributed as dist
        frozen0 = frozen.detach().to(dtype).clone()
        dist.broadcast(frozen0.view(torch.uint8), src=0)
    stage3 = dict(zero_stage=3, model=model, window=1, persist_elements=0) if zero_stage == 3 else {}
    opt = otorch.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0, dtype=dtype,
                       servers=[address], token=token, loss_scale=loss_scale, process_group=group,
                       bucket_elements=500, threads=1, update_in_backward=speculate,
                       trace_file=trace if trace and rank == 0 else None, **stage3)
    if zero_stage == 3 and world > 1 and not (
            opt.param_window.fetches == 0
            and opt._weights.flat16.numel() * world == opt.padded_length):
        raise SystemExit(f"rank {rank}: ZeRO-3 should hold 1/{world} of the 16-bit weights")
    rows = ROWS // world
    early = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 31, (ROWS, 6), generator=g)[rank * rows:(rank + 1) * rows]
        opt.zero_grad()
        # `micro` backward() calls of rows / micro each: the servers add them.
        for part in x.chunk(micro):
            logits = model(part)
            # The mean over this rank's rows; the optimizer averages the ranks.
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 31),
                                                     part[:, 1:].reshape(-1)) / micro
            opt.backward(loss)
        opt.step()
        early.append(opt.last_report["early_updated"])
    if speculate and not all(early):
        raise SystemExit(f"rank {rank}: steps without an update during backward: {early}")
    if frozen0 is not None and not torch.equal(frozen, frozen0):
        raise SystemExit(f"rank {rank}: the frozen parameter is not rank 0's")
    if zero_stage == 3 and not opt.param_window.fetches:
        raise SystemExit(f"rank {rank}: ZeRO-3 fetched nothing")
    if rank == 0:
        torch.save(opt.master_weights(), out)
    opt.close()
    if world > 1:
        torch.distributed.destroy_process_group()


class TwoRanks(unittest.TestCase):

    def assert_reductions_inside_backward(self, trace_file: str) -> None:
        """Rank 0's trace: in every step, buckets' reductions started before its backward ended
        (they overlap the backward that fills them, not all at step())."""
        with open(trace_file) as f:
            events = json.load(f)
        events = events["traceEvents"] if isinstance(events, dict) else events
        spans = {}
        for e in events:
            if e.get("ph") == "X":
                spans.setdefault((e["name"], e["args"]["step"]), []).append(
                    (e["ts"], e["ts"] + e["dur"]))
        for step in range(1, STEPS + 1):
            backward_end = max(end for _, end in spans[("backward", step)])
            reductions = spans.get(("all_reduce", step), [])
            self.assertTrue(reductions, f"step {step}: no reduction traced")
            inside = [b for b, _ in reductions if b < backward_end]
            self.assertTrue(inside, f"step {step}: every reduction began after backward")

    def test_two_ranks_train_what_one_rank_trains(self) -> None:
        from offload.server import LocalServer
        server = LocalServer(threads=1)
        try:
            with tempfile.TemporaryDirectory() as d:
                def run(world: int, scale: float, micro: int = 1, trace: str = "",
                        speculate: bool = False, zero_stage: int = 2,
                        blocks: bool = False) -> torch.Tensor:
                    name = f"{world}-{int(scale)}-{micro}-{int(speculate)}-{zero_stage}-{blocks}"
                    out = os.path.join(d, f"w{name}.pt")
                    init = os.path.join(d, f"init-{name}")
                    procs = [subprocess.Popen(
                        [sys.executable, __file__, "--rank", str(r), "--world", str(world),
                         "--address", server.address, "--out", out, "--loss_scale", str(scale),
                         "--init", init, "--micro", str(micro), "--trace", trace,
                         "--zero_stage", str(zero_stage)]
                        + (["--speculate"] if speculate else [])
                        + (["--blocks"] if blocks else []),
                        env=dict(os.environ, OFFLOAD_TOKEN=server.token))
                        for r in range(world)]
                    for p in procs:
                        self.assertEqual(p.wait(timeout=300), 0)
                    return torch.load(out)

                one = run(1, 1024.0)
                floor = (run(1, 3 * 1024.0) - one).abs().max().item()
                trace = os.path.join(d, "two_ranks.json")
                two = run(2, 1024.0, trace=trace)
                self.assert_reductions_inside_backward(trace)
                diff = (two - one).abs().max().item()
                self.assertGreater(floor, 0.0)
                print(f"two ranks vs one: max |diff| {diff:.3e}, floor {floor:.3e}")
                self.assertLessEqual(diff, 4 * floor, f"two ranks {diff}, floor {floor}")
                self.assertGreater(diff, 0.0)  # the ranks really ran their own halves
                # The update during backward on both ranks (each its partition, as its reduced
                # buckets arrive): the same bits as without it.
                speculated = run(2, 1024.0, speculate=True)
                self.assertTrue(torch.equal(speculated.view(torch.int32), two.view(torch.int32)))
                # ZeRO-3 (each rank holds its partition of the 16-bit weights and the device
                # gathers them from all ranks): the same bits as ZeRO-2, so within the bound
                # against one rank too; and for a model fetched block by block.
                zero3 = run(2, 1024.0, zero_stage=3)
                self.assertTrue(torch.equal(zero3.view(torch.int32), two.view(torch.int32)))
                blocks2 = run(2, 1.0, blocks=True)
                blocks3 = run(2, 1.0, blocks=True, zero_stage=3)
                self.assertTrue(torch.equal(blocks3.view(torch.int32), blocks2.view(torch.int32)))
                # Two ranks of two micro-batches each: every micro-batch's gradients are reduced
                # between the ranks during its backward and the server adds the two means in
                # fp32: six roundings (four of the ranks' micro-batch gradients, two of the
                # means) where the floor run rounds once. In quadrature sqrt(6) ~ 2.4 floors in
                # expectation; with the same margin for the maximum over elements as above
                # (4 / sqrt(3)), the bound is 6 floors.
                accumulated = run(2, 1024.0, micro=2)
                diff = (accumulated - one).abs().max().item()
                print(f"two ranks x two micro-batches vs one: max |diff| {diff:.3e}, "
                      f"floor {floor:.3e}")
                self.assertLessEqual(diff, 6 * floor, f"accumulated {diff}, floor {floor}")
                self.assertGreater(diff, 0.0)
        finally:
            server.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--address")
    ap.add_argument("--out")
    ap.add_argument("--loss_scale", type=float, default=1024.0)
    ap.add_argument("--init")
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--trace", default="")
    ap.add_argument("--speculate", action="store_true")
    ap.add_argument("--zero_stage", type=int, default=2)
    ap.add_argument("--blocks", action="store_true")
    args, rest = ap.parse_known_args()
    if args.rank >= 0:
        train(args.rank, args.world, args.address, os.environ["OFFLOAD_TOKEN"], args.out,
              args.loss_scale, args.init, args.micro, args.trace, args.speculate,
              args.zero_stage, args.blocks)
    else:
        unittest.main(argv=[sys.argv[0]] + rest)
