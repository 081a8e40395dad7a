"""optimizer_cores= (offload.placement): the local server's Adam workers on the given cores, this
process's threads on the others, torch's intra-op threads no more than those, and the same bits as
without it; and every list that cannot be honoured is refused before anything starts.
server_priority="idle": the local server under SCHED_IDLE, with the same bits.

Each placed run is a child process: the placement moves the whole process's threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import offload.torch as otorch  # noqa: E402

# Trains TinyNet three steps (optimizer_cores from argv[1], "null" for none) and prints the
# affinity of every thread of the server and of this process, torch's thread count and the
# master weights' bits; then makes a second optimizer with the same cores.
_CHILD = textwrap.dedent("""
    import json, os, sys, zlib
    import torch
    sys.path.insert(0, os.path.dirname(sys.argv[2]))
    import offload.torch as otorch
    from torch_test_util import TinyNet

    def affinities(pid):
        return [sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")]

    torch.manual_seed(0)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = TinyNet(vocab=32, width=16, hidden=24).to(torch.bfloat16)
    opt = otorch.AdamW(model.parameters(), lr=1e-2, optimizer_cores=json.loads(sys.argv[1]))
    x = torch.randint(0, 32, (4, 8))
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, 32), x.view(-1))
        opt.backward(loss)
        opt.step()
    print(json.dumps(dict(server=affinities(opt._server.pid), trainer=affinities(os.getpid()),
                          torch_threads=torch.get_num_threads(),
                          weights=zlib.crc32(opt.master_weights().numpy().tobytes()))))
    opt.close()
    # A second optimizer with the same cores, once the first has moved this process off them.
    again = otorch.AdamW(model.parameters(), lr=1e-2, optimizer_cores=json.loads(sys.argv[1]))
    again.close()
""")


def run_child(cores) -> dict:
    here = os.path.abspath(__file__)
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cores), here],
                         check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


class PlacementTest(unittest.TestCase):
    @unittest.skipIf(len(os.sched_getaffinity(0)) < 2,
                     "needs two cores: one for the server, one for the trainer")
    def test_server_and_trainer_on_disjoint_cores_with_the_same_bits(self) -> None:
        allowed = sorted(os.sched_getaffinity(0))
        cores = allowed[-1:]
        placed, shared = run_child(cores), run_child(None)
        rest = allowed[:-1]
        # One Adam worker per listed core, pinned to it; the server's other threads as started.
        self.assertEqual(sum(a == cores for a in placed["server"]), len(cores), placed)
        self.assertTrue(all(a == rest for a in placed["trainer"]), placed)
        self.assertEqual(placed["torch_threads"], len(rest))
        self.assertEqual(shared["torch_threads"], len(allowed))
        self.assertTrue(all(a == allowed for a in shared["trainer"]), shared)
        self.assertEqual(placed["weights"], shared["weights"])

    def test_lists_that_cannot_be_honoured_are_refused(self) -> None:
        allowed = sorted(os.sched_getaffinity(0))
        param = [otorch.torch.nn.Parameter(otorch.torch.zeros(4, dtype=otorch.torch.bfloat16))]
        before = os.sched_getaffinity(0)
        for cores, why in [([], "non-empty"), ([allowed[0], allowed[0]], "twice"),
                           ([max(allowed) + 1], "not cores this process may run on"),
                           (allowed, "leave the trainer"), (["0"], "core numbers")]:
            with self.subTest(cores=cores):
                with self.assertRaisesRegex(ValueError, why):
                    otorch.AdamW(param, optimizer_cores=cores)
        with self.assertRaisesRegex(ValueError, "running server takes --optimizer_cores"):
            otorch.AdamW(param, optimizer_cores=allowed[-1:], servers="inprocess")
        self.assertEqual(os.sched_getaffinity(0), before)  # nothing was moved


def _policies(pid: int) -> set:
    """The scheduling policy of every thread of process `pid`."""
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


class ServerPriorityTest(unittest.TestCase):
    """server_priority="idle": every thread of the local server under SCHED_IDLE, "normal" (the
    default) as started, for synchronous and overlapping jobs; the same bits either way; what
    cannot be honoured is refused."""

    def weights_and_policies(self, steps: int = 2, **kwargs) -> tuple:
        """The master weights' CRC after `steps` steps and the server's threads' policies. An idle
        server runs only on cycles nothing else wants: tests running beside this one can starve
        it, so the idle runs here are short."""
        import zlib
        torch = otorch.torch
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16).to(torch.bfloat16)
        opt = otorch.AdamW(model.parameters(), lr=1e-2, **kwargs)
        try:
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            for _ in range(steps):
                opt.zero_grad()
                opt.backward(model(x).float().square().mean())
                opt.step()
            opt.flush()
            return zlib.crc32(opt.master_weights().numpy().tobytes()), _policies(opt._server.pid)
        finally:
            opt.close()

    def test_idle_when_asked_with_the_same_bits(self) -> None:
        idle, other = {os.SCHED_IDLE}, {os.SCHED_OTHER}
        sync_bits, policies = self.weights_and_policies()
        self.assertEqual(policies, other, "the default")
        normal_bits, policies = self.weights_and_policies(update_in_backward=True)
        self.assertEqual(policies, other, "the default, update_in_backward")
        self.assertEqual(normal_bits, sync_bits)
        during_bits, policies = self.weights_and_policies(update_in_backward=True,
                                                          server_priority="idle")
        self.assertEqual(policies, idle, "idle, update_in_backward")
        self.assertEqual(during_bits, normal_bits)
        _, policies = self.weights_and_policies(steps=0, delay_update=True, server_priority="idle")
        self.assertEqual(policies, idle, "idle, delay_update")

    def test_what_cannot_be_honoured_is_refused(self) -> None:
        param = [otorch.torch.nn.Parameter(otorch.torch.zeros(4, dtype=otorch.torch.bfloat16))]
        with self.assertRaisesRegex(ValueError, "server_priority must be"):
            otorch.AdamW(param, server_priority="low")
        for servers in ("inprocess", ["127.0.0.1:1"]):
            with self.subTest(servers=servers):
                with self.assertRaisesRegex(ValueError, "local server's"):
                    otorch.AdamW(param, server_priority="idle", servers=servers)


if __name__ == "__main__":
    unittest.main()
