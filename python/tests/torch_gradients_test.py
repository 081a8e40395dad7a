"""How gradients leave the model (run by CTest as `torch_gradients_test`): hooked after autograd
has accumulated them, handed over, and freed.

Against plain torch, bit for bit (torch_adamw_test's Reference): p.grad is None after backward
and the weights are the same; keep_grads=True leaves p.grad as plain torch does; a tied weight
and a module used twice in one forward are summed by autograd before the hook sees them. The
CUDA staging ring and the several-rank reducer are checked on the CPU with stand-ins for the
streams, events and collectives; a CUDA run is compared with the CPU path where a GPU is present.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
import tempfile
import unittest
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.torch as otorch  # noqa: E402
from offload import grad_hooks  # noqa: E402
from offload.grad_hooks import BucketReducer, StagingRing  # noqa: E402
from torch_adamw_test import (BETAS, EPS, LR, Reference, groups_of, loss_of,  # noqa: E402
                              lr_lambda, make_model, train_offload, ulps)

STEPS = 6
TORCH = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
# The hook paths this torch has: the AccumulateGrad node's everywhere, the post-accumulate hook
# from torch 2.1.
PATHS = [grad_hooks.ACCUMULATE_GRAD_NODE] + (
    [grad_hooks.POST_ACCUMULATE] if hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
    else [])


class TiedNet(torch.nn.Module):
    """The embedding's weight is also the output projection, and one linear runs twice: both
    parameters get two gradients in one backward, which autograd sums. Computes in fp32 on its
    16-bit weights, as torch_adamw_test's OddNet."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(37, 24)
        self.mix = torch.nn.Linear(24, 24)
        self.norm = torch.nn.LayerNorm(24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        f = lambda t: t.float()  # noqa: E731
        h = F.embedding(x, f(self.emb.weight))
        for _ in range(2):  # one module, two uses
            h = torch.tanh(F.linear(h, f(self.mix.weight), f(self.mix.bias)))
        h = F.layer_norm(h, (24,), f(self.norm.weight), f(self.norm.bias))
        return F.linear(h, f(self.emb.weight))  # tied


def make_tied(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def optimizer(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16,
              cls: type = otorch.AdamW, **kwargs) -> otorch.AdamW:
    return cls(groups_of(model), lr=LR, betas=BETAS, eps=EPS, dtype=dtype, servers="inprocess",
               loss_scale=1024.0, loss_scale_window=5, threads=1, **kwargs)


def with_path(path: str) -> type:
    return type(f"AdamW_{path}", (otorch.AdamW,), {"_hook_path": path})


class StagedAdamW(otorch.AdamW):
    """The CUDA path's staging ring on a CPU model (stand-in streams)."""
    _stage_on_cpu = True


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16)


class AgainstTorch(unittest.TestCase):
    """Our optimizer and torch_adamw_test's Reference trained side by side."""

    def train(self, base: torch.nn.Module, dtype: torch.dtype = torch.bfloat16,
              cls: type = otorch.AdamW, keep_grads: bool = False, **kwargs) -> None:
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        ref = Reference(theirs, dtype, loss_scale=1024.0, window=5)
        opt = optimizer(ours, dtype, cls, keep_grads=keep_grads, **kwargs)
        try:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            for step in range(STEPS):
                # One step of train_offload, with a look at p.grad between backward and step.
                opt.zero_grad(set_to_none=True)
                opt.backward(loss_of(ours, step))
                ref.step(step)
                for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
                    if keep_grads:
                        self.assertIsNotNone(p.grad, name)
                        self.assertTrue(torch.equal(bits(p.grad), bits(q.grad)),
                                        f"step {step}: {name}'s gradient")
                    else:
                        self.assertIsNone(p.grad, f"step {step}: {name}")
                opt.step()
                sched.step()
                self.assertFalse(opt.last_report["skipped"])
            self.assertEqual(ulps(opt.master_weights(), ref.flat_masters()), 0)
            for p, q in zip(ours.parameters(), theirs.parameters()):
                self.assertTrue(torch.equal(bits(p), bits(q)))
        finally:
            opt.close()

    def test_grads_are_freed_and_the_bits_are_torchs(self) -> None:
        for path in PATHS:
            for dtype in (torch.bfloat16, torch.float16):
                with self.subTest(path=path, dtype=dtype):
                    print(f"hook path {path}, {dtype}")
                    self.train(make_model(), dtype, with_path(path))

    def test_keep_grads_leaves_torchs_gradients(self) -> None:
        for path in PATHS:
            with self.subTest(path=path):
                self.train(make_model(), cls=with_path(path), keep_grads=True)

    def test_a_tied_weight_and_a_module_used_twice(self) -> None:
        for path in PATHS:
            for keep_grads in (False, True):
                with self.subTest(path=path, keep_grads=keep_grads):
                    self.train(make_tied(), cls=with_path(path), keep_grads=keep_grads)

    def test_through_the_staging_ring_on_the_cpu(self) -> None:
        # Slots of 300 elements: most parameters are split over two slots or more, and the
        # ring comes round several times a step.
        self.train(make_model(), cls=StagedAdamW, bucket_elements=300)
        self.train(make_tied(), cls=StagedAdamW, bucket_elements=300, keep_grads=True)

    def test_the_hook_path_of_this_torch(self) -> None:
        opt = optimizer(make_model())
        try:
            print(f"torch {torch.__version__}: gradients hooked by {opt._grads.hooks.path}")
            if TORCH >= (2, 1):
                self.assertEqual(opt._grads.hooks.path, grad_hooks.POST_ACCUMULATE)
            else:
                self.assertEqual(opt._grads.hooks.path, grad_hooks.ACCUMULATE_GRAD_NODE)
        finally:
            opt.close()


class Hooks(unittest.TestCase):

    def test_a_frozen_parameter_builds_and_never_changes(self) -> None:
        for path in PATHS:
            with self.subTest(path=path):
                model = make_model()
                model.norm.bias.requires_grad_(False)
                opt = optimizer(model, cls=with_path(path))
                try:
                    self.assertTrue(all(p is not model.norm.bias for p in opt._layout.params))
                    self.assertTrue(all(opt._grads.hooks.hooked))
                    frozen = model.norm.bias.detach().clone()
                    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
                    for step in range(2):
                        train_offload(model, opt, sched, step)
                    self.assertTrue(torch.equal(bits(model.norm.bias), bits(frozen)))
                    self.assertTrue(all(p.grad is None for p in model.parameters()))
                    # Unfrozen since: refused (the servers hold nothing for it), nothing applied.
                    model.norm.bias.requires_grad_(True)
                    before = opt.master_weights()
                    with self.assertRaisesRegex(RuntimeError, "frozen"):
                        train_offload(model, opt, sched, 2)
                    self.assertTrue(torch.equal(opt.master_weights(), before))
                finally:
                    opt.close()

    def test_a_second_backward_adds_on_each_hook_path(self) -> None:
        results = []
        for path in PATHS:
            with self.subTest(path=path):
                model = make_model()
                opt = optimizer(model, cls=with_path(path))
                try:
                    for step in range(2):
                        opt.zero_grad()
                        opt.backward(loss_of(model, 2 * step))
                        opt.backward(loss_of(model, 2 * step + 1))
                        self.assertTrue(all(p.grad is None for p in model.parameters()))
                        opt.step()
                    self.assertEqual(opt.last_report["step"], 2)
                    results.append(opt.master_weights())
                finally:
                    opt.close()
        for r in results[1:]:
            self.assertTrue(torch.equal(r, results[0]))

    def test_close_removes_the_hooks(self) -> None:
        for path in PATHS:
            with self.subTest(path=path):
                model = make_model()
                opt = optimizer(model, cls=with_path(path))
                opt.close()
                loss_of(model, 0).backward()  # plain torch again: the gradients stay
                self.assertTrue(all(p.grad is not None for p in model.parameters()))


class Buckets(unittest.TestCase):
    """The layout's buckets (the library's planner, offload_plan_buckets, that the C++ trainer's
    buckets use too): greedy runs of whole parameters in flat order, the padding in the last, or
    alone after a last bucket that is full."""

    @staticmethod
    def greedy(sizes: List[int], offsets: List[int], bucket_elements: int,
               padded: int) -> List[Tuple[int, int, List[int]]]:
        out, start, members = [], 0, []
        for i, (n, off) in enumerate(zip(sizes, offsets)):
            members.append(i)
            end = off + n
            if end - start >= bucket_elements:
                out.append((start, end, members))
                start, members = end, []
        if start < padded:
            out.append((start, padded, members))
        return out

    def test_greedy_runs_of_whole_parameters(self) -> None:
        opt = optimizer(make_model())
        try:
            layout = opt._layout
            sizes = [layout.numel(i) for i in range(len(layout))]
            self.assertGreater(opt.padded_length, layout.num_params)
            for bucket_elements in (1, 2, 7, 100, 300, sizes[0], sum(sizes[:3]),
                                    layout.num_params, 1 << 22):
                for padded in (layout.num_params, opt.padded_length):
                    self.assertEqual(layout.buckets(bucket_elements, padded),
                                     self.greedy(sizes, layout.offsets, bucket_elements, padded),
                                     (bucket_elements, padded))
        finally:
            opt.close()


# ------------------------------------------------------------------------- the staging ring

class FakeEvent:
    def __init__(self, copies: List[Tuple[torch.Tensor, torch.Tensor]], log: List[str]) -> None:
        self.copies, self.done, self.log = copies, False, log

    def query(self) -> bool:
        return self.done

    def complete(self) -> None:
        if not self.done:
            for dst, src in self.copies:
                dst.copy_(src)
            self.done = True

    def synchronize(self) -> None:
        if not self.done:
            self.log.append("wait")
        self.complete()


def span(t: torch.Tensor) -> Tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class FakeCopies:
    """A device whose copies land only when the event recorded after them completes (the test
    says when), and which fails a copy into memory that a copy not yet landed writes, or a
    hand-over of memory whose copy has not landed."""

    pinned = False

    def __init__(self) -> None:
        self.queued: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.events: List[FakeEvent] = []
        self.log: List[str] = []

    def after_current(self, *tensors: torch.Tensor) -> None:
        pass

    def in_flight(self, t: torch.Tensor) -> bool:
        a, b = span(t)
        pending = [d for e in self.events if not e.done for d, _ in e.copies]
        return any(span(d)[0] < b and a < span(d)[1] for d in pending + [d for d, _ in self.queued])

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.in_flight(dst):
            raise AssertionError("a staging slot written again before its copies landed")
        self.queued.append((dst, src.clone()))

    def record(self) -> FakeEvent:
        event = FakeEvent(self.queued, self.log)
        self.queued = []
        self.events.append(event)
        return event


class Ring(unittest.TestCase):

    def setUp(self) -> None:
        self.copies = FakeCopies()
        self.handed: List[Tuple[int, torch.Tensor]] = []
        self.handovers = 0

        def hand_over(pieces: List[Tuple[int, torch.Tensor]]) -> None:
            self.handovers += 1
            for off, t in pieces:
                self.assertFalse(self.copies.in_flight(t), "handed over before it landed")
                self.handed.append((off, t.clone()))
        self.ring = StagingRing(3, 10, torch.bfloat16, self.copies, hand_over)

    def check_all_handed_once(self, grads: Dict[int, torch.Tensor]) -> None:
        """Every element of every gradient handed over once, at its flat offset."""
        length = max(off + g.numel() for off, g in grads.items())
        want = torch.zeros(length, dtype=torch.bfloat16)
        got = torch.zeros(length, dtype=torch.bfloat16)
        seen = torch.zeros(length, dtype=torch.int64)
        for off, g in grads.items():
            want[off:off + g.numel()] = g.reshape(-1)
        for off, t in self.handed:
            got[off:off + t.numel()] = t
            seen[off:off + t.numel()] += 1
        covered = torch.zeros(length, dtype=torch.bool)
        for off, g in grads.items():
            covered[off:off + g.numel()] = True
        self.assertTrue(torch.equal(seen[covered], torch.ones_like(seen[covered])))
        self.assertEqual(int(seen[~covered].sum()), 0)
        self.assertTrue(torch.equal(bits(got), bits(want)))

    def gradients(self) -> Dict[int, torch.Tensor]:
        """As backward gives them: the later parameters first, one bigger than two slots."""
        torch.manual_seed(3)
        sizes = {0: 4, 4: 7, 11: 25, 36: 3, 39: 10, 49: 1}
        return {off: torch.randn(n).to(torch.bfloat16) for off, n in reversed(sizes.items())}

    def test_slots_are_reused_only_after_their_copies_landed(self) -> None:
        grads = self.gradients()
        for off, g in grads.items():
            self.ring.put(off, g.view(-1, 1) if g.numel() % 5 else g.view(5, -1))
        # 50 elements through 3 slots of 10: the ring came round to a slot with more to write
        # twice, nothing had landed, so it waited each time (FakeCopies fails a copy into a slot
        # in flight); the fifth slot sealed waits for flush.
        self.assertEqual(self.copies.log.count("wait"), 2)
        self.assertEqual(self.handovers, 2)
        self.ring.flush()
        self.check_all_handed_once(grads)
        self.assertEqual(self.handovers, 5)  # 50 elements, 10 a slot
        # The 25-element gradient went out in pieces across three slots.
        self.assertEqual(sorted(off for off, t in self.handed if 11 <= off < 36), [11, 17, 27])

    def test_poll_hands_over_what_landed_without_waiting(self) -> None:
        g = torch.arange(24, dtype=torch.float32).to(torch.bfloat16)
        self.ring.put(100, g[:12])  # one slot sealed, two elements in the next
        self.assertEqual(self.handovers, 0)
        self.copies.events[0].complete()
        self.ring.poll()
        self.assertEqual(self.handovers, 1)
        self.assertEqual([(off, t.numel()) for off, t in self.handed], [(100, 10)])
        self.ring.put(112, g[12:])
        self.ring.flush()
        self.assertEqual(self.copies.log.count("wait"), 2)  # flush waited for the rest
        self.check_all_handed_once({100: g})

    def test_reset_drops_what_was_not_handed_over(self) -> None:
        self.ring.put(0, torch.ones(15, dtype=torch.bfloat16))
        self.ring.reset()
        self.ring.flush()
        self.assertEqual(self.handed, [])
        g = torch.full((12,), 2.0, dtype=torch.bfloat16)
        self.ring.put(0, g)  # the ring is usable again
        self.ring.flush()
        self.check_all_handed_once({0: g})


# ------------------------------------------------------------------------- several ranks

class FakeWork:
    """An all-reduce of two ranks holding the same gradients: done when the test says so."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat, self.done = flat, False

    def is_completed(self) -> bool:
        return self.done

    def complete(self) -> None:
        if not self.done:
            self.flat.mul_(2)
            self.done = True

    def wait(self) -> None:
        self.complete()


class Reducer(unittest.TestCase):
    # Parameters of 5, 3, 8, 2, 6 and 4 elements in a flat space padded to 30; buckets of whole
    # parameters, each of another size (so the fake all-reduce knows which it got), the padding
    # in the last. This rank's partition is [4, 26).
    SIZES = [5, 3, 8, 2, 6, 4]
    OFFSETS = [0, 5, 8, 16, 18, 24]
    BUCKETS = [(0, 5, [0]), (5, 16, [1, 2]), (16, 24, [3, 4]), (24, 30, [5])]

    def setUp(self) -> None:
        self.launched: List[Tuple[int, FakeWork]] = []
        self.sent: List[Tuple[int, torch.Tensor]] = []
        self.complete: List[bool] = []  # per share sent: not a bucket finish() filled with zeros

        def all_reduce(flat: torch.Tensor) -> FakeWork:
            work = FakeWork(flat)
            self.launched.append(({e - s: s for s, e, _ in self.BUCKETS}[flat.numel()], work))
            return work

        self.reducer = BucketReducer(self.BUCKETS, self.OFFSETS, torch.device("cpu"), 4, 26,
                                     grad_hooks.HostCopies(torch.device("cpu")), all_reduce,
                                     lambda off, t, complete: (self.sent.append((off, t.clone())),
                                                               self.complete.append(complete)))
        torch.manual_seed(1)
        self.grads = [torch.randn(n).to(torch.bfloat16) for n in self.SIZES]

    def test_launch_order_buffers_and_shares(self) -> None:
        r = self.reducer
        starts = lambda: [s for s, _ in self.launched]  # noqa: E731
        r.add(2, self.grads[2])
        r.add(1, self.grads[1])  # [5, 16) complete, but [24, 30) and [16, 24) launch first
        self.assertEqual(starts(), [])
        r.add(5, self.grads[5])
        self.assertEqual(starts(), [24])
        r.add(3, self.grads[3])
        r.add(4, self.grads[4])
        self.assertEqual(starts(), [24, 16, 5])
        self.assertEqual(r.buffers, 3)  # reducing, none done
        self.launched[1][1].complete()  # [16, 24) is done before [24, 30): handed on in order
        r.poll()
        self.assertEqual(self.sent, [])
        self.launched[0][1].complete()
        r.poll()
        self.assertEqual([off for off, _ in self.sent], [24, 16])
        self.assertEqual(r.buffers, 1)  # dropped once handed on
        r.finish()  # parameter 0 never got a gradient
        self.assertEqual(starts(), [24, 16, 5, 0])
        self.assertEqual(r.buffers, 0)
        # This rank's share [4, 26), once each: twice the gradients (two ranks), zeros where
        # none came (parameter 0).
        want = torch.zeros(30)
        for off, g in zip(self.OFFSETS[1:], self.grads[1:]):
            want[off:off + g.numel()] = g.float() * 2
        got = torch.full((30,), float("nan"))
        seen = torch.zeros(30, dtype=torch.int64)
        for off, t in self.sent:
            got[off:off + t.numel()] = t
            seen[off:off + t.numel()] += 1
        self.assertTrue(torch.equal(seen[4:26], torch.ones(22, dtype=torch.int64)))
        self.assertEqual(int(seen[:4].sum() + seen[26:].sum()), 0)
        self.assertTrue(torch.equal(got[4:26], want[4:26]))
        # Only the bucket finish() filled is marked incomplete (updated at the commit, not early).
        self.assertEqual(self.complete, [True, True, True, False])

    def test_in_forward_order_nothing_launches_before_the_last_bucket(self) -> None:
        for i in range(5):
            self.reducer.add(i, self.grads[i])
        self.assertEqual(self.launched, [])
        self.reducer.add(5, self.grads[5])
        self.assertEqual([s for s, _ in self.launched], [24, 16, 5, 0])
        self.reducer.finish()
        self.assertEqual(len(self.sent), 4)
        self.assertEqual(self.complete, [True] * 4)

    def test_a_step_without_gradients_sends_zeros(self) -> None:
        self.reducer.finish()
        self.assertEqual([s for s, _ in self.launched], [24, 16, 5, 0])
        self.assertEqual(sum(t.numel() for _, t in self.sent), 22)
        self.assertTrue(all(bool((t == 0).all()) for _, t in self.sent))
        self.assertEqual(self.complete, [False] * 4)


class TwoRanks(unittest.TestCase):
    """The reducer for real: two gloo ranks on the same batch train what one rank trains, bit for
    bit (the mean of two equal gradients, summed in fp32 and halved, is the gradient itself), with
    a tied weight, a module used twice and a frozen parameter (whose bucket completes at step()
    with zeros), and every p.grad freed after backward."""

    def test_two_ranks_on_one_batch_train_what_one_rank_trains(self) -> None:
        from offload.server import LocalServer
        server = LocalServer(threads=1)
        try:
            with tempfile.TemporaryDirectory() as d:
                out = {}
                for world in (1, 2):
                    out[world] = os.path.join(d, f"w{world}.pt")
                    procs = [subprocess.Popen(
                        [sys.executable, __file__, "--rank", str(r), "--world", str(world),
                         "--address", server.address, "--out", out[world],
                         "--init", os.path.join(d, f"init{world}")],
                        env=dict(os.environ, OFFLOAD_TOKEN=server.token)) for r in range(world)]
                    for r, proc in enumerate(procs):
                        self.assertEqual(proc.wait(timeout=300), 0, f"world {world}, rank {r}")
                one, two = torch.load(out[1]), torch.load(out[2])
            self.assertEqual(ulps(two, one), 0)
        finally:
            server.close()


def train_rank(rank: int, world: int, address: str, out: str, init: str) -> None:
    import torch.distributed as dist
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world)
        group = dist.group.WORLD
    model = make_tied()
    model.norm.bias.requires_grad_(False)
    opt = otorch.AdamW(groups_of(model), lr=LR, betas=BETAS, eps=EPS, servers=[address],
                       process_group=group, bucket_elements=300, threads=1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(loss_of(model, step))
        freed = [p.grad is None for p in model.parameters()]
        if not all(freed):
            raise AssertionError(f"rank {rank}: p.grad left after backward: {freed}")
        opt.step()
        sched.step()
    if rank == 0:
        torch.save(opt.master_weights(), out)
    opt.close()
    if world > 1:
        dist.destroy_process_group()
    # Out without the interpreter's finalization: torch 2's gloo worker threads outlive
    # destroy_process_group, and one that drops a tensor while the interpreter finalizes aborts
    # the process ("terminate called without an active exception": 2 runs in about 500 here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------- CUDA

class ElementwiseNet(torch.nn.Module):
    """Gradients that CPU and CUDA compute to the same bits: every gradient op is elementwise
    (no reduction order in them), and one parameter is used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(700))
        self.b = torch.nn.Parameter(torch.randn(17, 5))
        self.c = torch.nn.Parameter(torch.randn(40))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.a.float(), self.b.float(), self.c.float()
        return ((a * x).sum() + (a * a * x).sum() * 0.5 + (b * b).sum() * 0.25
                + (c * x[:40]).sum() + (c * x[40:80]).sum())


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device here: the CUDA path (side "
                     "stream, pinned staging ring) runs where torch.cuda.is_available()")
class Cuda(unittest.TestCase):

    def test_cuda_trains_what_the_cpu_path_trains(self) -> None:
        def run(device: str) -> Tuple[torch.Tensor, List[torch.Tensor]]:
            torch.manual_seed(0)
            model = ElementwiseNet().to(device)
            # Slots of 256 elements: a (700) spans three, and the ring comes round.
            opt = otorch.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                               servers="inprocess", threads=1, bucket_elements=256)
            try:
                for step in range(STEPS):
                    g = torch.Generator().manual_seed(step)
                    x = torch.randn(700, generator=g).to(device)
                    opt.zero_grad()
                    opt.backward(model(x))
                    self.assertTrue(all(p.grad is None for p in model.parameters()))
                    opt.step()
                return opt.master_weights(), [p.detach().cpu() for p in model.parameters()]
            finally:
                opt.close()

        cpu_master, cpu_weights = run("cpu")
        cuda_master, cuda_weights = run("cuda")
        self.assertEqual(ulps(cuda_master, cpu_master), 0)
        for p, q in zip(cuda_weights, cpu_weights):
            self.assertTrue(torch.equal(bits(p), bits(q)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--address")
    ap.add_argument("--out")
    ap.add_argument("--init")
    args, rest = ap.parse_known_args()
    if args.rank >= 0:
        train_rank(args.rank, args.world, args.address, args.out, args.init)
    else:
        unittest.main(argv=[sys.argv[0]] + rest)
