"""A torch job's torch.distributed rendezvous under its attempt's secret (offload.rendezvous; run
by CTest as `torch_rendezvous_test` on both torches). Two ranks of job A meet through env://
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE as a pool worker sets them) on a TCPStore that rank
0 serves, and rank 0 publishes a key through the store its process group got. Then a rank of job
B, with B's secret, points its env:// at A's port and tries to join as rank 1; and a stranger
connects a TCPStore client and tries to read the key: without A's secret, or with B's, neither
gets anywhere, while A's ranks train on. With A's secret the key reads back, and outside a job
(no control directory) env:// is torch's own and the stranger reads it: the test can tell.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from typing import Dict, List

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offload import rendezvous  # noqa: E402

_PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# One rank: env:// through offload, an all_reduce, then rank 0 publishes MARKER through the store
# the process group got and stays up until the test is done with its store.
_RANK = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
import offload
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
t = torch.ones(1)
dist.all_reduce(t)
print("all_reduce", int(t.item()), flush=True)
if dist.get_rank() == 0:
    store, _, _ = next(dist.rendezvous("env://", rank=0, world_size=2))
    store.set("marker", "rank 0 of job A was here")
    print("ready", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
dist.barrier()
print("done", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RendezvousTest(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        self.port = free_port()
        self.done = os.path.join(self.tmp.name, "done")
        self.procs: List[subprocess.Popen] = []
        self.rank0_lines: List[str] = []  # what wait_ready read of rank 0's output

    def tearDown(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.tmp.cleanup()

    def rank(self, rank: int, secret: str, in_job: bool, timeout_s: float) -> subprocess.Popen:
        env: Dict[str, str] = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                                   RANK=str(rank), WORLD_SIZE="2", OFFLOAD_TOKEN=secret,
                                   OMP_NUM_THREADS="1",
                                   PYTHONPATH=_PACKAGE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("OFFLOAD_SHARD_TOKEN", None)
        if in_job:
            env["OFFLOAD_CONTROL_DIR"] = self.tmp.name
        else:
            env.pop("OFFLOAD_CONTROL_DIR", None)
        p = subprocess.Popen([sys.executable, "-c", _RANK, str(timeout_s), self.done], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def wait_ready(self, rank0: subprocess.Popen) -> None:
        for line in rank0.stdout:
            self.rank0_lines.append(line)
            if line.startswith("ready"):
                return
        self.fail("rank 0 never got ready: " + "".join(self.rank0_lines))

    def stranger_reads(self, prefix: str) -> str:
        """The marker as a stranger's TCPStore client reads it under `prefix`; '' if it cannot."""
        client = dist.TCPStore("127.0.0.1", self.port, 2, False,
                               datetime.timedelta(seconds=2), wait_for_workers=False)
        store = dist.PrefixStore(prefix, client) if prefix else client
        try:
            return store.get("marker").decode()
        except RuntimeError:
            return ""

    def finish(self, *ranks: subprocess.Popen) -> None:
        open(self.done, "w").close()
        for i, p in enumerate(ranks):
            out, _ = p.communicate(timeout=60)
            if i == 0:
                out = "".join(self.rank0_lines) + out
            self.assertEqual(p.returncode, 0, out)
            self.assertIn("all_reduce 2", out)
            self.assertIn("done", out)

    def test_a_rank_of_another_job_and_a_stranger_get_nothing(self) -> None:
        a0 = self.rank(0, "secret-of-attempt-A", True, 60)
        a1 = self.rank(1, "secret-of-attempt-A", True, 60)
        b1 = self.rank(1, "secret-of-attempt-B", True, 5)
        self.wait_ready(a0)
        self.assertEqual(self.stranger_reads(""), "")
        self.assertEqual(self.stranger_reads(rendezvous.key_prefix("secret-of-attempt-B")), "")
        self.assertEqual(self.stranger_reads(rendezvous.key_prefix("secret-of-attempt-A")),
                         "rank 0 of job A was here")
        out, _ = b1.communicate(timeout=60)
        self.assertNotEqual(b1.returncode, 0, "job B's rank joined job A: " + out)
        self.assertNotIn("all_reduce", out)
        self.finish(a0, a1)

    def test_outside_a_job_env_is_torchs_own(self) -> None:
        a0 = self.rank(0, "secret-of-attempt-A", False, 60)
        a1 = self.rank(1, "secret-of-attempt-A", False, 60)
        self.wait_ready(a0)
        self.assertEqual(self.stranger_reads(""), "rank 0 of job A was here")
        self.finish(a0, a1)

    def test_the_prefix_is_the_secrets_alone(self) -> None:
        a, b = rendezvous.key_prefix("a"), rendezvous.key_prefix("b")
        self.assertNotEqual(a, b)
        self.assertEqual(a, rendezvous.key_prefix("a"))
        self.assertRegex(a, r"^offload-[0-9a-f]{64}/$")


if __name__ == "__main__":
    unittest.main()
