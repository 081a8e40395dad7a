"""Kill a training script with SIGKILL mid-run, resume from its last torch.save: the final weights
are byte-identical to an uninterrupted run, and no optimizer server is left behind (run by CTest
as `torch_resume_test`). The script is this file run with --train.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_test_util import TinyNet, alive  # noqa: E402

STEPS = 12


def train(directory: str, steps: int) -> None:
    import offload.torch as otorch

    torch.manual_seed(3)
    model = TinyNet(29, 16, 40, torch.nn.functional.gelu)
    opt = otorch.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, dtype=torch.float16,
                       max_grad_norm=1.0, loss_scale=512.0, loss_scale_window=3, threads=1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    print(f"server pid {opt._server.pid}", flush=True)
    ckpt = os.path.join(directory, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        start = saved["step"]
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 29, (3, 7), generator=g)
        opt.zero_grad()
        logits = model(x).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 29),
                                                 x[:, 1:].reshape(-1))
        opt.backward(loss)
        opt.step()
        sched.step()
        tmp = ckpt + ".tmp"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "step": step + 1}, tmp)
        os.replace(tmp, ckpt)  # atomic: a kill leaves the previous checkpoint or this one
        print(f"step {step + 1}", flush=True)
    torch.save({"weights": model.state_dict(), "master": opt.master_weights()},
               os.path.join(directory, "final.pt"))
    opt.close()


class Resume(unittest.TestCase):

    def run_script(self, directory: str, kill_after: int = 0) -> int:
        """Runs the script; with kill_after, SIGKILLs it once it reports that step. Returns the
        server's pid."""
        proc = subprocess.Popen([sys.executable, __file__, "--train", directory,
                                 "--steps", str(STEPS)], stdout=subprocess.PIPE, text=True)
        server_pid = 0
        for line in proc.stdout:
            if line.startswith("server pid"):
                server_pid = int(line.split()[-1])
            if kill_after and line.strip() == f"step {kill_after}":
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=300)
        proc.stdout.close()
        if not kill_after:
            self.assertEqual(proc.returncode, 0)
        return server_pid

    def test_sigkill_then_resume_gives_the_same_bytes(self) -> None:
        with tempfile.TemporaryDirectory() as plain, tempfile.TemporaryDirectory() as killed:
            self.run_script(plain)
            pid = self.run_script(killed, kill_after=5)
            # The server child dies with the script (PR_SET_PDEATHSIG), promptly.
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertFalse(alive(pid), "the killed script's optimizer server is still running")
            self.assertFalse(os.path.exists(os.path.join(killed, "final.pt")))
            self.run_script(killed)
            a = torch.load(os.path.join(plain, "final.pt"))
            b = torch.load(os.path.join(killed, "final.pt"))
            self.assertTrue(torch.equal(a["master"].view(torch.int32),
                                        b["master"].view(torch.int32)))
            for k in a["weights"]:
                self.assertTrue(torch.equal(a["weights"][k].view(torch.int16),
                                            b["weights"][k].view(torch.int16)), k)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--train")
    parser.add_argument("--steps", type=int, default=STEPS)
    args, rest = parser.parse_known_args()
    if args.train:
        train(args.train, args.steps)
    else:
        unittest.main(argv=[sys.argv[0]] + rest)
