"""save_checkpoint / load_checkpoint and materialize (run by CTest as `torch_checkpoint_test`).

- Elastic: a checkpoint saved on 2 servers loads onto 3, onto 1 and onto the in-process engine,
  and training goes on to the same bits as the uninterrupted 2-server run (Adam is elementwise:
  the layout must not change a bit). Saved by 2 ranks and loaded by 1, it continues within the
  noise-floor bound torch_distributed_test derives.
- Nothing is lost: kill -9 in the middle of a save leaves the previous checkpoint, from which
  training resumes to the uninterrupted bits; a file cut short, an altered byte, another model's
  checkpoint and a file system that refuses to grow a file mid-save are each refused, naming
  what, with the servers' state unchanged.
- materialize: a model built on the meta device trains to the same bits as the same model built
  eagerly, and a failing init leaves no job on the servers.

The training script of the subprocess cases is this file run with --train.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.checkpoint as ockpt  # noqa: E402
import offload.torch as otorch  # noqa: E402
from offload.native import OffloadError  # noqa: E402
from offload.server import LocalServer  # noqa: E402
from torch_adamw_test import (BETAS, EPS, LR, WD, OddNet, Reference, groups_of,  # noqa: E402
                              loss_of, lr_lambda, ulps)
from torch_test_util import TinyNet, alive  # noqa: E402

STEPS = 10
SAVE_AT = 4
TOKEN = "ckpt-" + "b" * 24


def step_once(model: torch.nn.Module, opt: otorch.AdamW, step: int) -> None:
    opt.zero_grad()
    opt.backward(loss_of(model, step))
    opt.step()


def named_groups(model: torch.nn.Module) -> List[dict]:
    """groups_of with names: matrices with decay, the rest without."""
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": WD},
            {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def build(servers, dtype: torch.dtype = torch.float16, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = OddNet()
    opt = otorch.AdamW(named_groups(model), lr=LR, betas=BETAS, eps=EPS, dtype=dtype,
                       servers=servers, loss_scale=1024.0, loss_scale_window=3, threads=1,
                       **kwargs)
    return model, opt


def bits(opt: otorch.AdamW) -> torch.Tensor:
    return opt.master_weights().view(torch.int32).clone()


class Elastic(unittest.TestCase):

    @classmethod
    def setUpClass(cls) -> None:
        cls.servers = [LocalServer(threads=1, token=TOKEN) for _ in range(3)]
        os.environ["OFFLOAD_TOKEN"] = TOKEN

    @classmethod
    def tearDownClass(cls) -> None:
        os.environ.pop("OFFLOAD_TOKEN", None)
        for s in cls.servers:
            s.close()

    def test_two_servers_to_three_one_and_in_process_to_the_same_bits(self) -> None:
        two = [s.address for s in self.servers[:2]]
        with tempfile.TemporaryDirectory() as d:
            model, opt = build(two)
            for step in range(SAVE_AT):
                step_once(model, opt, step)
            saved = opt.save_checkpoint(d)
            self.assertEqual(saved, os.path.join(d, f"step-{SAVE_AT:08d}"))
            for step in range(SAVE_AT, STEPS):
                step_once(model, opt, step)
            want, want_scale = bits(opt), opt.loss_scale
            opt.close()
            for servers in ([s.address for s in self.servers], [self.servers[2].address],
                            "inprocess"):
                with self.subTest(servers=servers):
                    other, o = build(servers, seed=9)  # other initial values: all must go
                    try:
                        self.assertEqual(o.load_checkpoint(d), saved)
                        self.assertEqual(o.completed_steps, SAVE_AT)
                        for step in range(SAVE_AT, STEPS):
                            step_once(other, o, step)
                        self.assertEqual(ulps(bits(o).view(torch.float32),
                                              want.view(torch.float32)), 0)
                        self.assertEqual(o.loss_scale, want_scale)
                    finally:
                        o.close()

    def test_groups_lrs_and_a_scheduler_come_back(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            model, opt = build("inprocess", dtype=torch.bfloat16)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            for step in range(3):
                step_once(model, opt, step)
                sched.step()
            opt.save_checkpoint(d)
            lrs = [g["lr"] for g in opt.param_groups]
            opt.close()
            other, o = build("inprocess", dtype=torch.bfloat16, seed=4)
            try:
                o.load_checkpoint(d)
                self.assertEqual([g["lr"] for g in o.param_groups], lrs)
                # The 16-bit weights are the master weights rounded.
                for p, q in zip(other.parameters(), model.parameters()):
                    self.assertTrue(torch.equal(p.view(torch.int16), q.view(torch.int16)))
            finally:
                o.close()

    def test_plain_torch_continues_from_a_checkpoint(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            model, opt = build("inprocess", dtype=torch.bfloat16)
            for step in range(3):
                step_once(model, opt, step)
            opt.save_checkpoint(d, model=model)
            masters = opt.master_weights()
            state = opt.state_dict()
            opt.close()
            torch.manual_seed(0)
            plain = OddNet()
            adamw = torch.optim.AdamW(groups_of(plain), lr=LR, betas=BETAS, eps=EPS)
            manifest = ockpt.load_into_torch(d, plain, adamw)
            self.assertEqual(manifest.adam_step, 3)
            flat = torch.cat([p.detach().reshape(-1) for g in adamw.param_groups
                              for p in g["params"]])
            self.assertTrue(torch.equal(flat, masters))
            for i, p in enumerate(p for g in adamw.param_groups for p in g["params"]):
                self.assertTrue(torch.equal(adamw.state[p]["exp_avg"], state["state"][i]["exp_avg"]))
                self.assertTrue(torch.equal(adamw.state[p]["exp_avg_sq"],
                                            state["state"][i]["exp_avg_sq"]))
            # And it trains: one plain step from there.
            adamw.zero_grad()
            loss_of(plain, 3).backward()
            adamw.step()


class DiskTier(unittest.TestCase):

    def test_state_on_the_local_servers_disk_trains_the_same_bits(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            want = None
            for kwargs in ({}, {"state_dir": d, "optimizer_state": "disk"}):
                model, opt = build(None, dtype=torch.bfloat16, **kwargs)
                try:
                    for step in range(6):
                        step_once(model, opt, step)
                    if kwargs:
                        # The state is in the server's files: 12 bytes a parameter, in three
                        # regions padded to 4 KiB, under a directory of the server's own.
                        files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs
                                 if f.endswith(".state")]
                        self.assertEqual(len(files), 1, files)
                        self.assertGreaterEqual(os.path.getsize(files[0]), 12 * opt.num_params)
                        self.assertTrue(torch.equal(bits(opt), want))
                        # And its checkpoints stream from the disk like any other.
                        other, o = build("inprocess", dtype=torch.bfloat16, seed=3)
                        o.load_checkpoint(opt.save_checkpoint(os.path.join(d, "ckpt")))
                        self.assertTrue(torch.equal(bits(o), want))
                        o.close()
                    else:
                        want = bits(opt)
                finally:
                    opt.close()

    def test_disk_without_a_state_dir_is_refused(self) -> None:
        with self.assertRaisesRegex(OffloadError, "state_dir"):
            build(None, optimizer_state="disk")
        with self.assertRaisesRegex(OffloadError, "in-process engine keeps its state in memory"):
            build("inprocess", optimizer_state="disk")
        with self.assertRaisesRegex(ValueError, "optimizer_state must be one of"):
            build("inprocess", optimizer_state="ssd")


class Refused(unittest.TestCase):
    """Each refusal names what is wrong, and the servers' state stays as it was."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp()
        self.model, self.opt = build("inprocess")
        for step in range(2):
            step_once(self.model, self.opt, step)
        self.ckpt = self.opt.save_checkpoint(self.dir)
        step_once(self.model, self.opt, 2)  # the servers move on: a load would change them
        self.before = bits(self.opt)
        self.weights = [p.detach().clone() for p in self.model.parameters()]

    def tearDown(self) -> None:
        self.opt.close()
        subprocess.run(["rm", "-rf", self.dir], check=False)

    def assert_unchanged(self) -> None:
        self.assertTrue(torch.equal(bits(self.opt), self.before))
        self.assertEqual(self.opt.completed_steps, 3)
        for p, w in zip(self.model.parameters(), self.weights):
            self.assertTrue(torch.equal(p.view(torch.int16), w.view(torch.int16)))
        step_once(self.model, self.opt, 3)  # and it still trains

    def test_a_file_cut_short(self) -> None:
        path = os.path.join(self.ckpt, "exp_avg.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 64)
        with self.assertRaisesRegex(OffloadError, f"DATA_LOSS.*{path}"):
            self.opt.load_checkpoint(self.dir)
        self.assert_unchanged()

    def test_an_altered_byte(self) -> None:
        path = os.path.join(self.ckpt, "exp_avg_sq.safetensors")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))
        with self.assertRaisesRegex(OffloadError, f"{path} has CRC-32"):
            self.opt.load_checkpoint(self.dir)
        self.assert_unchanged()

    def test_another_models_checkpoint(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            torch.manual_seed(1)
            other = TinyNet(37, 24, 53)  # the same first names, another shape further on
            o = otorch.AdamW(other.named_parameters(), servers="inprocess", dtype=torch.float16)
            o.save_checkpoint(d)
            o.close()
            with self.assertRaisesRegex(
                    OffloadError, "not of this model: it has no parameter 'norm.weight'"):
                # The names the optimizer was built with, in its flat order: emb.weight,
                # fc1.weight, fc1.bias match TinyNet's; norm.weight is the first that does not.
                self.opt.load_checkpoint(d, model=self.model)
        self.assert_unchanged()

    def test_other_fixed_hyperparameters(self) -> None:
        path = os.path.join(self.ckpt, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        front = json.loads(manifest["front_end"])
        front["param_groups"][0]["eps"] = 1e-3
        manifest["front_end"] = json.dumps(front)
        with open(path, "w") as f:
            json.dump(manifest, f)
        with self.assertRaisesRegex(ValueError, "eps is 0.001 in the state"):
            self.opt.load_checkpoint(self.dir)
        self.assert_unchanged()

    def test_no_checkpoint_there(self) -> None:
        with self.assertRaisesRegex(FileNotFoundError, "no checkpoint at"):
            self.opt.load_checkpoint(os.path.join(self.dir, "nothing"))
        self.assert_unchanged()


def train(directory: str, steps: int, mode: str, out: Optional[str]) -> None:
    """The script of the subprocess cases. mode "resume": load the latest checkpoint in
    `directory` if there is one, then train to `steps`, saving after every step and announcing
    each save; mode "full": the same with a file-size limit set before the last save."""
    torch.manual_seed(7)
    # Big enough that a save takes a while (3 files of 4 MB), so a kill lands inside one.
    model = TinyNet(1000, 64, 1000)
    opt = otorch.AdamW(model.named_parameters(), lr=2e-3, dtype=torch.float16, threads=1,
                       loss_scale=256.0)
    start = 0
    if mode == "resume" and os.path.exists(os.path.join(directory, "latest")):
        opt.load_checkpoint(directory)
        start = opt.completed_steps
        print(f"resumed at {start}", flush=True)
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 1000, (2, 5), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, 1000),
                                                 x[:, 1:].reshape(-1))
        opt.backward(loss)
        opt.step()
        if mode == "full" and step == steps - 1:
            # The next file bigger than 64 KiB cannot grow: write() fails mid-file, as on a
            # full disk (EFBIG instead of ENOSPC).
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
            try:
                opt.save_checkpoint(directory)
            except OffloadError as e:
                print(f"save failed: {e}", flush=True)
                resource.setrlimit(resource.RLIMIT_FSIZE,
                                   (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                torch.save(bits(opt), out)
                return
            raise SystemExit("the save went through despite the limit")
        print(f"saving {step + 1}", flush=True)
        opt.save_checkpoint(directory, keep=2)
        print(f"saved {step + 1}", flush=True)
    if out:
        torch.save(bits(opt), out)


class NothingLost(unittest.TestCase):

    def script(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--train", *args],
                                stdout=subprocess.PIPE, text=True)

    def test_kill_9_mid_save_resumes_to_the_uninterrupted_bits(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            whole = os.path.join(d, "whole")
            p = self.script(whole, "6", "resume", os.path.join(d, "whole.pt"))
            p.communicate(timeout=300)
            self.assertEqual(p.returncode, 0)
            cut = os.path.join(d, "cut")
            p = self.script(cut, "6", "resume", os.path.join(d, "cut.pt"))
            # Wait for the save of step 3 to be under way: its staging directory exists.
            for line in p.stdout:
                if line.startswith("saving 3"):
                    break
            staging = os.path.join(cut, "step-00000003.tmp")
            deadline = time.monotonic() + 30
            while not os.path.exists(staging) and time.monotonic() < deadline:
                time.sleep(0.0005)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
            p.stdout.close()
            self.assertEqual(open(os.path.join(cut, "latest")).read().strip(), "step-00000002")
            p = self.script(cut, "6", "resume", os.path.join(d, "cut.pt"))
            out, _ = p.communicate(timeout=300)
            self.assertEqual(p.returncode, 0)
            self.assertIn("resumed at 2", out)
            self.assertTrue(torch.equal(torch.load(os.path.join(d, "whole.pt")),
                                        torch.load(os.path.join(d, "cut.pt"))))

    def test_a_file_system_that_fills_mid_save(self) -> None:
        with tempfile.TemporaryDirectory() as d:
            root = os.path.join(d, "ckpt")
            p = self.script(root, "3", "full", os.path.join(d, "state.pt"))
            out, _ = p.communicate(timeout=300)
            self.assertEqual(p.returncode, 0, out)
            self.assertRegex(out, r"save failed: .*step-00000003\.tmp/master\.safetensors")
            self.assertEqual(open(os.path.join(root, "latest")).read().strip(), "step-00000002")
            # The previous checkpoint is whole: it loads.
            torch.manual_seed(7)
            model = TinyNet(1000, 64, 1000)
            opt = otorch.AdamW(model.named_parameters(), dtype=torch.float16,
                               servers="inprocess")
            try:
                opt.load_checkpoint(root)
                self.assertEqual(opt.completed_steps, 2)
            finally:
                opt.close()


def ranks(rank: int, world: int, address: str, init_file: str, directory: str, phase: str,
          out: str, scale: float) -> None:
    """The script of ElasticRanks: TinyNet on `world` gloo ranks over the running server at
    `address`, each rank its share of every batch. phase "whole": steps [0, STEPS); "first":
    [0, SAVE_AT) then save; "rest": load, then [SAVE_AT, STEPS) with the scale set to `scale`."""
    group = None
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        group = dist.group.WORLD
    torch.manual_seed(5)
    model = TinyNet(31, 20, 45)
    opt = otorch.AdamW(model.named_parameters(), lr=2e-3, weight_decay=0.0, dtype=torch.float16,
                       servers=[address], loss_scale=1024.0, process_group=group,
                       bucket_elements=500, threads=1)
    first, last = (0, STEPS) if phase == "whole" else (0, SAVE_AT) if phase == "first" else (
        SAVE_AT, STEPS)
    if phase == "rest":
        opt.load_checkpoint(directory)
        opt._native.set_scaler(scale, 0, 0)
    rows = 8 // world
    for step in range(first, last):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 31, (8, 6), generator=g)[rank * rows:(rank + 1) * rows]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, 31),
                                                 x[:, 1:].reshape(-1))
        opt.backward(loss)
        opt.step()
    if phase == "first":
        opt.save_checkpoint(directory)
    if rank == 0:
        torch.save(opt.master_weights(), out)
    opt.close()
    if world > 1:
        torch.distributed.destroy_process_group()


class ElasticRanks(unittest.TestCase):

    def test_saved_by_two_ranks_continued_by_one(self) -> None:
        """Continued by one rank, the run differs from the two-rank one by the ranks' rounding
        of their own gradients in the steps after the checkpoint: within torch_distributed_test's
        bound, 4 noise floors, the floor being the one-rank continuation run again with another
        loss scale (every fp16 gradient rounded differently once)."""
        server = LocalServer(threads=1, token=TOKEN)
        try:
            with tempfile.TemporaryDirectory() as d:
                def run(world: int, phase: str, scale: float = 1024.0) -> torch.Tensor:
                    out = os.path.join(d, f"{world}-{phase}-{int(scale)}.pt")
                    init = os.path.join(d, f"init-{world}-{phase}-{int(scale)}")
                    procs = [subprocess.Popen(
                        [sys.executable, __file__, "--ranks", str(r), str(world),
                         server.address, init, os.path.join(d, "ckpt"), phase, out, str(scale)],
                        env=dict(os.environ, OFFLOAD_TOKEN=TOKEN)) for r in range(world)]
                    for p in procs:
                        self.assertEqual(p.wait(timeout=300), 0)
                    return torch.load(out)

                whole = run(2, "whole")
                run(2, "first")
                one = run(1, "rest")
                floor = (run(1, "rest", 3 * 1024.0) - one).abs().max().item()
                diff = (one - whole).abs().max().item()
                print(f"2 ranks then 1 vs 2 ranks: max |diff| {diff:.3e}, floor {floor:.3e}")
                self.assertGreater(floor, 0.0)
                self.assertLessEqual(diff, 4 * floor)
        finally:
            server.close()


def children(name: str) -> List[int]:
    """Live child processes of this one named `name`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and comm == name[:15] and alive(int(pid)):
            out.append(int(pid))
    return out


class Materialize(unittest.TestCase):

    def test_a_meta_model_trains_to_the_bits_of_the_eager_one(self) -> None:
        for dtype in (torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                torch.manual_seed(0)
                eager = OddNet()
                ref = Reference(copy.deepcopy(eager), dtype, loss_scale=1024.0, window=5)
                torch.manual_seed(0)
                meta = OddNet(device="meta")
                self.assertTrue(all(p.is_meta for p in meta.parameters()))
                opt = otorch.materialize(
                    meta, named_groups(meta), lr=LR, betas=BETAS, eps=EPS, dtype=dtype,
                    loss_scale=1024.0, loss_scale_window=5, threads=1)
                try:
                    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
                    for step in range(8):
                        opt.zero_grad()
                        opt.backward(loss_of(meta, step))
                        opt.step()
                        sched.step()
                        ref.step(step)
                    self.assertEqual(ulps(opt.master_weights(), ref.flat_masters()), 0)
                    self.assertFalse(any(p.is_meta for p in meta.parameters()))
                finally:
                    opt.close()

    def test_a_failing_init_leaves_no_job_and_no_server(self) -> None:
        def init(module: torch.nn.Module) -> None:
            # The last module fails, after the others' values went to the servers.
            if isinstance(module, torch.nn.Linear) and module.out_features == 400:
                raise ValueError("no init for the output layer here")
            module.reset_parameters()

        def meta_model() -> torch.nn.Module:
            return TinyNet(400, 48, 80, device="meta")  # 55,520 parameters: 666,624 bytes

        # A running server whose memory holds one job of this model, not two: a job left behind
        # by the failed build would make the next one fail.
        server = LocalServer(threads=1, token=TOKEN, memory_limit_mib=1)
        try:
            os.environ["OFFLOAD_TOKEN"] = TOKEN
            with self.assertRaisesRegex(RuntimeError, r"initializing module 'fc2' \(Linear\)"):
                otorch.materialize(meta_model(), init=init, servers=[server.address],
                                   job_id="failed-job")
            opt = otorch.materialize(meta_model(), servers=[server.address], job_id="next-job")
            opt.close()
        finally:
            os.environ.pop("OFFLOAD_TOKEN", None)
            server.close()
        # With a local server of its own, the failed build stops it.
        before = children("cpu_optimizer_server")
        with self.assertRaisesRegex(RuntimeError, "initializing module 'fc2'"):
            otorch.materialize(meta_model(), init=init)
        self.assertEqual(children("cpu_optimizer_server"), before)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs=4, metavar=("DIR", "STEPS", "MODE", "OUT"))
    ap.add_argument("--ranks", nargs=8)
    args, rest = ap.parse_known_args()
    if args.ranks:
        r, w, address, init_file, directory, phase, out, scale = args.ranks
        ranks(int(r), int(w), address, init_file, directory, phase, out, float(scale))
    elif args.train:
        directory, steps, mode, out = args.train
        train(directory, int(steps), mode, out)
    else:
        unittest.main(argv=[sys.argv[0]] + rest)
