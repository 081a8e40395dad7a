"""offload.torch inside a torch job on the pool (offload.job), without the pool: the environment a
trainer worker sets is set here by hand, against a server of the test's own, and the worker's
side of the control directory (request.json) is written by the test (run by CTest as
`torch_job_env_test`; the pool itself: tests/torch_job_test.sh).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import unittest
from typing import Dict, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload  # noqa: E402
import offload.torch as otorch  # noqa: E402
from offload.server import LocalServer  # noqa: E402
from torch_test_util import TinyNet  # noqa: E402

_JOB_VARIABLES = ("OFFLOAD_SERVERS", "OFFLOAD_TOKEN", "OFFLOAD_JOB_ID", "OFFLOAD_CHECKPOINT_DIR",
                  "OFFLOAD_CONTROL_DIR", "OFFLOAD_TRANSPORT", "OFFLOAD_STEP_TIMEOUT_FLOOR",
                  "WORLD_SIZE", "RANK")


class JobEnvironmentTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.server = LocalServer(threads=1)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.close()

    def setUp(self) -> None:
        self.saved = {k: os.environ.get(k) for k in _JOB_VARIABLES}
        self.tmp = tempfile.TemporaryDirectory()
        self.control = os.path.join(self.tmp.name, "control")
        self.ckpt = os.path.join(self.tmp.name, "ckpt")
        os.makedirs(self.control)
        self.job_id = f"job-{os.getpid()}-{self.id().rsplit('.', 1)[-1]}.1"
        os.environ.update(OFFLOAD_SERVERS=self.server.address, OFFLOAD_TOKEN=self.server.token,
                          OFFLOAD_JOB_ID=self.job_id, OFFLOAD_CHECKPOINT_DIR=self.ckpt,
                          OFFLOAD_CONTROL_DIR=self.control, OFFLOAD_TRANSPORT="grpc",
                          WORLD_SIZE="1", RANK="0")
        offload.job._progress = offload.job._Progress()  # each test its own rank's reports

    def tearDown(self) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.tmp.cleanup()

    def progress(self) -> Dict[str, object]:
        offload.job._flush()
        with open(os.path.join(self.control, "progress.json")) as f:
            return json.load(f)

    def ask(self, request: str, checkpoint_request: int = 0) -> None:
        """What the worker writes: the controller's last ProgressReply as JSON."""
        with open(os.path.join(self.control, "request.json"), "w") as f:
            json.dump({"request": request, "checkpoint_request": str(checkpoint_request)}, f)

    def build(self) -> otorch.AdamW:
        torch.manual_seed(0)
        self.model = TinyNet(8, 16, 4, torch.nn.functional.gelu)
        return otorch.AdamW(self.model.named_parameters(), lr=1e-2)

    def train(self, opt: otorch.AdamW, steps: int, report: bool = False) -> None:
        for s in range(opt.completed_steps, opt.completed_steps + steps):
            g = torch.Generator().manual_seed(s)
            tokens = torch.randint(0, 8, (4, 5), generator=g)  # (B, T)
            loss = self.model(tokens).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if report:
                offload.report(step=s + 1, loss=loss.item(), tokens=4, total_steps=99)

    def test_joins_the_jobs_servers_and_reports_its_steps(self) -> None:
        opt = self.build()
        self.assertEqual(opt.job_id, self.job_id)
        self.assertEqual(opt.transport, "grpc")
        self.assertIsNone(opt._server)  # no server of its own
        self.assertIsNone(opt.load_checkpoint())  # the job's directory holds none yet
        self.train(opt, 3)
        p = self.progress()
        self.assertEqual(p["step"], 3)  # the optimizer's own count: the script reports nothing
        opt.close()

    def test_the_jobs_step_timeout_floor_unless_the_script_sets_one(self) -> None:
        opt = self.build()
        self.assertEqual(opt.options.step_timeout_floor, 60.0)  # none in the job
        opt.close()
        os.environ["OFFLOAD_STEP_TIMEOUT_FLOOR"] = "7.5"
        opt = self.build()
        self.assertEqual(opt.options.step_timeout_floor, 7.5)
        opt.close()
        model = TinyNet(8, 16, 4, torch.nn.functional.gelu)
        opt = otorch.AdamW(model.parameters(), lr=1e-3, step_timeout_floor=3.0)
        self.assertEqual(opt.options.step_timeout_floor, 3.0)
        opt.close()

    def test_the_scripts_reports_win_and_accumulate_tokens(self) -> None:
        opt = self.build()
        self.train(opt, 3, report=True)
        p = self.progress()
        self.assertEqual((p["step"], p["total_steps"], p["tokens"]), (3, 99, 12.0))
        self.assertIn("loss", p)
        self.assertGreater(p["tokens_per_s"], 0)
        offload.job._optimizer_stepped(50, 1.0)  # ignored once the script reports itself
        self.assertEqual(self.progress()["step"], 3)
        opt.close()

    def test_checkpoints_default_to_the_job_and_resume_exactly(self) -> None:
        opt = self.build()
        self.train(opt, 4)
        directory = opt.save_checkpoint()
        self.assertTrue(directory.startswith(self.ckpt))
        self.assertEqual(self.progress()["checkpoint_step"], 4)
        self.train(opt, 3)
        expected = [p.detach().clone() for p in self.model.parameters()]
        opt.close()

        os.environ["OFFLOAD_JOB_ID"] = self.job_id + "2"  # the next attempt's id on the servers
        opt = self.build()
        self.assertEqual(opt.load_checkpoint(), directory)
        self.assertEqual(opt.completed_steps, 4)
        self.train(opt, 3)
        for a, b in zip(expected, self.model.parameters()):
            self.assertTrue(torch.equal(a, b.detach()))
        opt.close()

    def test_a_checkpoint_request_is_carried_out_once(self) -> None:
        opt = self.build()
        self.train(opt, 2)
        self.assertNotIn("checkpoint_request_done", self.progress())
        self.ask("JOB_REQUEST_NONE", 1)
        self.train(opt, 1)
        p = self.progress()
        self.assertEqual((p["checkpoint_request_done"], p["checkpoint_step"]), (1, 3))
        self.train(opt, 1)  # the same request: no second checkpoint
        self.assertEqual(self.progress()["checkpoint_step"], 3)
        opt.close()

    def test_pause_checkpoints_and_exits_130(self) -> None:
        opt = self.build()
        self.train(opt, 2)
        self.ask("JOB_REQUEST_PAUSE")
        with self.assertRaises(SystemExit) as stopped:
            self.train(opt, 1)
        self.assertEqual(stopped.exception.code, 130)
        self.assertEqual(self.progress()["checkpoint_step"], 3)
        self.assertTrue(os.path.isfile(os.path.join(self.ckpt, "latest")))
        opt.close()

    def test_outside_a_job_nothing_changes(self) -> None:
        for k in _JOB_VARIABLES:
            os.environ.pop(k, None)
        self.assertFalse(offload.job.active())
        offload.report(step=1, loss=2.0)  # nothing to write to, no error
        opt = otorch.AdamW(TinyNet(8, 16, 4, torch.nn.functional.gelu).parameters(), threads=1)
        self.assertIsNotNone(opt._server)  # a server of its own, as before
        self.assertIsNone(opt.load_checkpoint())
        with self.assertRaisesRegex(ValueError, "save_checkpoint\\(\\) needs a path"):
            opt.save_checkpoint()
        opt.close()

    def test_several_ranks_need_torch_distributed(self) -> None:
        os.environ["WORLD_SIZE"] = "2"
        with self.assertRaisesRegex(RuntimeError, "init_process_group"):
            self.build()


if __name__ == "__main__":
    unittest.main()
