"""offload.torch.AdamW on bad input and failures (run by CTest as `torch_failures_test`): each
gets a clear error, and the servers' state is what it was.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload.torch as otorch  # noqa: E402
from offload import OffloadError  # noqa: E402
from offload.options import OffloadOptions  # noqa: E402
from offload.server import LocalServer  # noqa: E402
from torch_test_util import alive  # noqa: E402


def small_model(seed: int = 0, sparse: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(11, 6, sparse=sparse), torch.nn.Linear(6, 5))


def backward(model: torch.nn.Module, opt: otorch.AdamW) -> None:
    x = torch.arange(8).remainder(11).view(2, 4)
    opt.backward(model(x).float().square().mean())


def wait_until_stopped(pid: int) -> None:
    """Returns once every thread of pid is stopped (state T in /proc/pid/task/*/stat)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
        if states and all(state == "T" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within 30 s")


class Failures(unittest.TestCase):

    def test_a_server_that_dies_mid_step_is_named_and_nothing_hangs(self) -> None:
        for transport in ("grpc", "shm"):
            with self.subTest(transport=transport):
                server = LocalServer(threads=1)
                model = small_model()
                opt = otorch.AdamW(model.parameters(), lr=1e-3, servers=[server.address],
                                   token=server.token, transport=transport, call_timeout=30)
                try:
                    backward(model, opt)  # gradients are out
                    server.process.send_signal(signal.SIGKILL)
                    server.process.wait()
                    start = time.monotonic()
                    with self.assertRaises(RuntimeError) as raised:
                        opt.step()
                    self.assertLess(time.monotonic() - start, 30)
                    self.assertIn(server.address, str(raised.exception))
                finally:
                    opt.close()
                    server.close()

    def test_a_server_that_stops_answering_is_named_within_its_step_timeout(self) -> None:
        # SIGSTOP: the process lives and its sockets stay open, so only the step timeout (10x the
        # median step, at least step_timeout_floor) finds it before keepalive does (10 s + 5 s).
        for transport in ("grpc", "shm"):
            with self.subTest(transport=transport):
                server = LocalServer(threads=1)
                model = small_model()
                options = OffloadOptions(servers=[server.address], token=server.token,
                                         transport=transport, step_timeout_floor=2.0)
                opt = otorch.AdamW(model.parameters(), lr=1e-3, options=options)
                try:
                    for _ in range(4):  # steps measured: the bound is now the floor
                        backward(model, opt)
                        opt.step()
                    backward(model, opt)
                    server.process.send_signal(signal.SIGSTOP)
                    # A stop lands when each thread next enters the kernel: a server thread
                    # polling the segment could still take a commit sent before then.
                    wait_until_stopped(server.process.pid)
                    start = time.monotonic()
                    with self.assertRaises(RuntimeError) as raised:
                        opt.step()
                    took = time.monotonic() - start
                    self.assertLess(took, 9, "keepalive, not the step timeout, found it")
                    self.assertIn(server.address, str(raised.exception))
                    self.assertIn("no answer within 2s", str(raised.exception))
                finally:
                    server.process.send_signal(signal.SIGCONT)
                    opt.close()
                    server.close()

    def test_the_local_server_goes_with_the_optimizer(self) -> None:
        model = small_model()
        opt = otorch.AdamW(model.parameters(), lr=1e-3, threads=1)
        pid = opt._server.pid
        self.assertTrue(alive(pid))
        backward(model, opt)
        opt.step()
        opt.close()
        self.assertFalse(alive(pid))

    def test_a_wrong_or_missing_token_is_refused(self) -> None:
        server = LocalServer(threads=1)
        try:
            for token in ("not-the-token", ""):
                with self.subTest(token=token):
                    os.environ.pop("OFFLOAD_TOKEN", None)
                    with self.assertRaises(OffloadError) as raised:
                        otorch.AdamW(small_model().parameters(), servers=[server.address],
                                     token=token or None)
                    self.assertIn(raised.exception.code, (7, 16))  # PERMISSION_DENIED, UNAUTH.
                    self.assertIn(server.address, str(raised.exception))
        finally:
            server.close()

    def test_a_parameter_changed_after_the_optimizer_was_built(self) -> None:
        for change in ("shape", "dtype", "storage"):
            with self.subTest(change=change):
                model = small_model()
                opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess")
                try:
                    before = opt.master_weights()
                    backward(model, opt)  # then the change, as a model surgery between steps
                    w = model[1].weight
                    if change == "shape":
                        w.data = torch.zeros(3, 6, dtype=w.dtype)
                    elif change == "dtype":
                        w.data = w.data.float()
                    else:
                        w.data = w.data.clone()
                    with self.assertRaisesRegex(RuntimeError, "changed after the optimizer"):
                        opt.step()
                    self.assertTrue(torch.equal(opt.master_weights(), before))
                    # The hooks refuse it too, while backward runs.
                    model[1].weight.data = model[1].weight.data.to(torch.float32)
                    model[1].weight.data = opt._weights.flat16.new_zeros(5, 6).float()
                    model[0].weight.data = model[0].weight.data.clone()
                    with self.assertRaisesRegex(RuntimeError, "changed after the optimizer"):
                        x = torch.arange(8).remainder(11).view(2, 4)
                        model[0](x).float().sum().backward()
                    self.assertTrue(torch.equal(opt.master_weights(), before))
                finally:
                    opt.close()

    def test_a_sparse_gradient_is_refused(self) -> None:
        model = small_model(sparse=True)
        opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess")
        try:
            before = opt.master_weights()
            with self.assertRaisesRegex(RuntimeError, "sparse gradient"):
                backward(model, opt)
            opt.zero_grad()
            self.assertTrue(torch.equal(opt.master_weights(), before))
        finally:
            opt.close()

    def test_a_parameter_that_is_not_floating_point(self) -> None:
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False)
        with self.assertRaisesRegex(TypeError, "not floating point"):
            otorch.AdamW([p], servers="inprocess")

    def test_amsgrad_and_a_bad_dtype_are_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "amsgrad"):
            otorch.AdamW(small_model().parameters(), amsgrad=True, servers="inprocess")
        with self.assertRaisesRegex(ValueError, "dtype"):
            otorch.AdamW(small_model().parameters(), dtype=torch.float32, servers="inprocess")

    def test_options_come_whole_or_as_keywords_never_both(self) -> None:
        from offload import OffloadOptions
        options = OffloadOptions(servers="inprocess", threads=1)
        a, b = small_model(), small_model()
        whole = otorch.AdamW(a.parameters(), options=options)
        keywords = otorch.AdamW(b.parameters(), servers="inprocess", threads=1)
        try:
            self.assertEqual(whole.options, keywords.options)
            self.assertEqual(whole.transport, keywords.transport)
            for opt, model in ((whole, a), (keywords, b)):
                backward(model, opt)
                opt.step()
            for p, q in zip(a.parameters(), b.parameters()):
                self.assertTrue(torch.equal(p, q))
        finally:
            whole.close()
            keywords.close()
        # A keyword fills what the options leave at its default; one they set is refused.
        filled = otorch.AdamW(small_model().parameters(),
                              options=OffloadOptions(servers="inprocess"), threads=1)
        self.assertEqual(filled.options.threads, 1)
        filled.close()
        with self.assertRaisesRegex(ValueError, "threads is given twice"):
            otorch.AdamW(small_model().parameters(), options=options, threads=2)
        with self.assertRaisesRegex(ValueError, "optimizer_state must be one of"):
            OffloadOptions(optimizer_state="tape")

    def test_load_state_dict_of_another_model_changes_nothing(self) -> None:
        model = small_model()
        opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess")
        other_model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 7))
        other = otorch.AdamW(other_model.parameters(), lr=1e-3, servers="inprocess")
        try:
            backward(model, opt)
            opt.step()
            before = {k: opt._state.read(k, 0, opt.padded_length) for k in (1, 2, 3)}
            with self.assertRaisesRegex(ValueError, "another model|parameters"):
                opt.load_state_dict(other.state_dict())
            # A state of the right shapes holding a NaN is refused by the library, whole.
            bad = opt.state_dict()
            bad["state"][1]["exp_avg"][0, 0] = float("nan")
            with self.assertRaises(OffloadError):
                opt.load_state_dict(bad)
            bad = opt.state_dict()
            bad["param_groups"][0]["betas"] = (0.5, 0.5)
            with self.assertRaisesRegex(ValueError, "betas"):
                opt.load_state_dict(bad)
            for k, v in before.items():
                self.assertTrue(torch.equal(opt._state.read(k, 0, opt.padded_length), v))
            # And the optimizer still trains.
            backward(model, opt)
            opt.step()
        finally:
            opt.close()
            other.close()

    def test_a_refused_commit_ends_the_step_and_training_goes_on(self) -> None:
        model = small_model()
        opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess")
        try:
            backward(model, opt)
            opt.step()
            before = opt.master_weights()
            opt.param_groups[0]["lr"] = float("nan")  # a scheduler gone wrong
            opt.zero_grad()
            backward(model, opt)
            with self.assertRaisesRegex(OffloadError, "lr of parameter group 0"):
                opt.step()
            self.assertTrue(torch.equal(opt.master_weights(), before))
            opt.param_groups[0]["lr"] = 1e-3
            opt.zero_grad()
            backward(model, opt)
            opt.step()
            self.assertEqual(opt.last_report["step"], 2)
        finally:
            opt.close()

    def test_a_closed_optimizer_says_so(self) -> None:
        model = small_model()
        opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess")
        opt.close()
        for use in (opt.step, opt.state_dict, opt.master_weights, lambda: opt.loss_scale):
            with self.assertRaisesRegex(RuntimeError, "closed"):
                use()
        # Its hooks are gone: the model trains on with plain torch.
        model(torch.arange(4).view(1, 4)).float().sum().backward()

    def test_an_optimizer_nobody_holds_lets_go_of_its_model(self) -> None:
        import gc
        model = small_model()
        opt = otorch.AdamW(model.parameters(), lr=1e-3, threads=1)
        pid = opt._server.pid
        del opt
        gc.collect()
        # Collected: its job dropped and its server stopped; its hooks on the model do nothing.
        self.assertFalse(alive(pid))
        second = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess")
        try:
            backward(model, second)
            second.step()
        finally:
            second.close()

    def test_a_refused_step_after_accumulation_applies_nothing_and_can_be_redone(self) -> None:
        def accumulate(model: torch.nn.Module, opt: otorch.AdamW) -> None:
            for _ in range(3):
                backward(model, opt)

        model, twin = small_model(), small_model()
        opt = otorch.AdamW(model.parameters(), lr=1e-3, servers="inprocess")
        clean = otorch.AdamW(twin.parameters(), lr=1e-3, servers="inprocess")
        try:
            before = opt.master_weights()
            accumulate(model, opt)
            opt.param_groups[0]["lr"] = float("nan")  # a scheduler gone wrong
            with self.assertRaisesRegex(OffloadError, "lr of parameter group 0"):
                opt.step()
            self.assertTrue(torch.equal(opt.master_weights(), before))  # nothing half applied
            opt.param_groups[0]["lr"] = 1e-3
            opt.zero_grad()
            accumulate(model, opt)  # the step again, from its first micro-batch
            opt.step()
            accumulate(twin, clean)
            clean.step()
            self.assertEqual(opt.last_report["step"], 1)
            self.assertTrue(torch.equal(opt.master_weights(), clean.master_weights()))
        finally:
            opt.close()
            clean.close()

if __name__ == "__main__":
    unittest.main()
