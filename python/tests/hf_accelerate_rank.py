"""One process of hf_accelerate_test's two-process run, started by torchrun (accelerate launch's
launcher for several processes): accelerate on gloo, the processes the optimizer's ZeRO-2 ranks.

usage: torchrun --standalone --nproc_per_node 2 hf_accelerate_rank.py OUT whole|first|resume
  whole: STEPS steps; first: STEPS // 2 steps, then save_state to OUT/state; resume: load_state
  from OUT/state, then the rest. The servers: $OFFLOAD_TEST_SERVER, $OFFLOAD_TOKEN.
Writes OUT/<mode>-rank<r>.pt: the master weights (rank 0), the 16-bit weights, clip coefficients.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accelerate import Accelerator  # noqa: E402
from hf_trainer_test import LR, WD, Tokens, gpt2  # noqa: E402

import offload.torch as otorch  # noqa: E402

STEPS, ACCUMULATE, MAX_NORM = 10, 2, 0.25


def main() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    out, mode = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE,
                              mixed_precision="bf16")
    model = gpt2()
    opt = otorch.AdamW(model.named_parameters(), lr=LR, weight_decay=WD, threads=1,
                       servers=[os.environ["OFFLOAD_TEST_SERVER"]],
                       process_group=dist.group.WORLD)
    data = torch.utils.data.DataLoader(Tokens(STEPS * ACCUMULATE * 2 * 2), batch_size=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    assert not isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    start, end = {"whole": (0, STEPS), "first": (0, STEPS // 2), "resume": (STEPS // 2, STEPS)}[
        mode]
    if mode == "resume":
        accelerator.load_state(os.path.join(out, "state"))
    batches = list(data)  # this rank's share of each global batch
    coefs = []
    for step in range(start, end):
        for micro in range(ACCUMULATE):
            with accelerator.accumulate(model):
                loss = model(**batches[step * ACCUMULATE + micro]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
                sched.step()
                opt.zero_grad()
        coefs.append(float(opt.optimizer.last_report["clip_coef"]))
    if mode == "first":
        accelerator.save_state(os.path.join(out, "state"))
    inner = opt.optimizer
    masters = inner.master_weights() if accelerator.is_main_process else None
    torch.save({"masters": masters, "coefs": coefs, "steps": inner.completed_steps,
                "weights": [p.detach().clone() for p in model.parameters()]},
               os.path.join(out, f"{mode}-rank{accelerator.process_index}.pt"))
    inner.close()


if __name__ == "__main__":
    main()
