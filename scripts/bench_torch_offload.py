#!/usr/bin/env python3
"""bench_torch_offload: offload.torch.AdamW against torch's own optimizer, in one run.

A GPT of about 100M parameters (examples/torch_gpt.py's, 12 layers of 832 channels by default)
is timed three ways on the same batches:
  torch   fp32 parameters, torch.optim.AdamW(foreach=True): the in-process CPU optimizer;
  offload the same model under offload.torch.AdamW (bf16 parameters, one local
          cpu_optimizer_server over shared memory), gradients leaving during backward;
  bare    the same flat space committed through the C library alone (begin, the whole partition's
          gradients, commit), as the C++ trainer drives its optimizer backend: what the front end
          adds is offload's step minus (its forward+backward without hooks + bare);
  delayed offload with delay_update=True (no warm-up): the time step() waits after backward,
          and the whole step, against the synchronous step's; from its Chrome trace, the share
          of the servers' commits that ran outside step() (under the next forward/backward);
  during  offload with update_in_backward=True: the time step() waits after backward, the share
          of the elements the server updated before the commit (last_report), and, from the
          Chrome trace of the same run on the in-process engine (whose early updates are spans
          of the sender's thread), the share of the update's time that lay inside backward;
  bf16    offload with state_dtype=torch.bfloat16 (the server's Adam moments in bf16): the local
          server's anonymous memory (RssAnon: the state, its allocator and buffers; gradients
          come through shared memory) per parameter against the fp32-state run's, and the step;
          scripts/bench_state_dtype.py has the loss curves;
  zero3   offload with zero_stage=3 (the 16-bit weights in host memory, each block copied to the
          device before its forward and again for its backward), windows of 1 and 2 blocks: the
          whole step against stage 2's, and the peak bytes of parameters on the device against
          all of the 16-bit weights. On the CPU the "device" is host memory too, so the copies
          are the cost and nothing overlaps them; on a GPU they run on a side stream.
  overlap the synchronous, delayed and during-backward steps again, their three optimizers alive
          at once and timed in alternating blocks of --block steps (the first of each block not
          counted, each block ending with flush()), so that the machine's drift hits all three
          alike: the whole step of each against the synchronous one, with torch on --threads and
          again on one thread (the model leaving cores to the server, as on a GPU host), and on
          one thread with optimizer_cores (each local server on the last core alone, torch kept
          to the others). --overlap_priority idle runs the delayed and during-backward servers
          on shared cores with server_priority="idle" (SCHED_IDLE).
It prints one line per measure (median of --steps timed steps after --warmup) and the ratios.

    PYTHONPATH=python /usr/bin/python3 scripts/bench_torch_offload.py [--layers 12 --channels 832]
        [--overlap_only] [--rounds 7 --block 2] [--overlap_priority normal|idle]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import offload.torch as otorch  # noqa: E402
from offload import native  # noqa: E402
from torch_gpt import GPT  # noqa: E402


def timed(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rss_anon(pid: int) -> int:
    """Bytes of anonymous memory process `pid` holds (/proc/PID/status RssAnon)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def load_spans(trace_file: str, name: str):
    events = json.load(open(trace_file))
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("name") == name and e.get("ph") == "X"]


def inside_fraction(trace_file: str, name: str, within: str) -> float:
    """The share of the time of `name`'s spans that lies inside `within`'s spans."""
    outer = load_spans(trace_file, within)
    total = inside = 0.0
    for a, b in load_spans(trace_file, name):
        total += b - a
        inside += sum(max(0.0, min(b, d) - max(a, c)) for c, d in outer)
    return inside / total if total else 0.0


def overlap_fraction(trace_file: str) -> float:
    """From a Chrome trace of delayed steps: the share of the servers' commits
    (commit_delayed spans) that ran outside step(), i.e. while the script's forward and
    backward did."""
    return 1.0 - inside_fraction(trace_file, "commit_delayed", "step")


def overlap_medians(base, loss_of, threads: int, rounds: int, block: int,
                    optimizer_cores=None, priority: str = "normal") -> dict:
    """Whole-step medians of the synchronous, delayed and during-backward optimizers, in
    alternating blocks (see the module's docstring), with torch on `threads` threads; with
    `optimizer_cores`, each local server on those cores and this process on the others (for
    good: run it last); else the delayed and during-backward servers at `priority`."""
    torch.set_num_threads(threads)
    overlapped = dict(server_priority=priority) if optimizer_cores is None else {}
    modes = {"sync": {}, "delayed": dict(delay_update=True, delay_warmup_steps=0, **overlapped),
             "during": dict(update_in_backward=True, **overlapped)}
    runs = {}
    for mode, kw in modes.items():
        model = copy.deepcopy(base)
        runs[mode] = (model, otorch.AdamW(model.parameters(), lr=1e-4,
                                          optimizer_cores=optimizer_cores, **kw), [])
    for r in range(rounds + 1):  # round 0 warms every optimizer up
        for model, opt, times in runs.values():
            for i in range(block):
                t = time.perf_counter()
                opt.zero_grad()
                opt.backward(loss_of(model))
                opt.step()
                if r > 0 and i > 0:
                    times.append(time.perf_counter() - t)
            opt.flush()  # a delayed commit must not run into the next optimizer's block
    for _, opt, _ in runs.values():
        opt.close()
    return {mode: statistics.median(times) for mode, (_, _, times) in runs.items()}


def overlap_all(base, loss_of, args) -> dict:
    """overlap_medians on --threads, on one thread, and on one thread with the server on the
    last core alone (last: the placement moves this process off that core for good)."""
    runs = {}
    for t in sorted({args.threads, 1}, reverse=True):
        runs[(t, None)] = overlap_medians(base, loss_of, t, args.rounds, args.block,
                                          priority=args.overlap_priority)
        if args.overlap_only:
            print_overlap({(t, None): runs[(t, None)]}, args)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        runs[(1, cores[-1])] = overlap_medians(base, loss_of, 1, args.rounds, args.block,
                                               optimizer_cores=cores[-1:])
        if args.overlap_only:
            print_overlap({(1, cores[-1]): runs[(1, cores[-1])]}, args)
    torch.set_num_threads(args.threads)
    return runs


def print_overlap(runs: dict, args) -> None:
    for (t, core), m in runs.items():
        placed = (f"shared priority={args.overlap_priority}" if core is None
                  else f"server_on_core={core}")
        print(f"overlap threads={t} {placed} sync_s={m['sync']:.4f} delayed_s={m['delayed']:.4f} "
              f"during_s={m['during']:.4f} delayed_vs_sync={m['sync'] / m['delayed']:.3f}x "
              f"during_vs_sync={m['sync'] / m['during']:.3f}x (alternating blocks of "
              f"{args.block}, {args.rounds * (args.block - 1)} steps each; target >= 1.0x)",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--channels", type=int, default=832)
    ap.add_argument("--heads", type=int, default=13)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7,
                    help="overlap: blocks of each optimizer (after one warm-up block)")
    ap.add_argument("--block", type=int, default=2, help="overlap: steps per block")
    ap.add_argument("--overlap_only", action="store_true", help="only the overlap lines")
    ap.add_argument("--overlap_priority", choices=("normal", "idle"), default="normal",
                    help="overlap: server_priority of the delayed and during-backward servers "
                         "on shared cores")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch's threads (Debian's torch takes one per physical core); the "
                    "local server takes every core")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = GPT(context=args.seq, layers=args.layers, heads=args.heads, channels=args.channels)
    n = sum(p.numel() for p in base.parameters())
    x = torch.randint(0, 256, (args.batch, args.seq))
    y = torch.randint(0, 256, (args.batch, args.seq))

    def loss_of(model):
        return F.cross_entropy(model(x).float().view(-1, 256), y.view(-1))

    if args.overlap_only:
        print(f"torch_offload model=gpt params={n} layers={args.layers} "
              f"channels={args.channels} batch={args.batch}x{args.seq} threads={args.threads}")
        overlap_all(base, loss_of, args)  # prints each line as it is measured
        return

    # torch: fp32 parameters, the in-process foreach AdamW.
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, foreach=True)
    loss_of(ref).backward()
    torch_opt_s = timed(ref_opt.step, args.steps, args.warmup)

    def torch_step():
        ref_opt.zero_grad()
        loss_of(ref).backward()
        ref_opt.step()
    torch_step_s = timed(torch_step, args.steps, args.warmup)
    del ref, ref_opt

    # offload: bf16 parameters, one local server over shared memory.
    model = copy.deepcopy(base)
    opt = otorch.AdamW(model.parameters(), lr=1e-4)

    def fwd_bwd():
        opt.zero_grad()
        opt.backward(loss_of(model))
    def offload_steps():
        """(whole step, step() alone): medians of --steps steps after --warmup."""
        opt_times, step_times = [], []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            fwd_bwd()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if i >= args.warmup:
                step_times.append(t2 - t0)
                opt_times.append(t2 - t1)
        return statistics.median(step_times), statistics.median(opt_times)
    offload_step_s, offload_opt_s = offload_steps()
    transport = opt.transport

    # The same forward and backward without the optimizer's hooks, for the front end's share.
    plain = copy.deepcopy(base).to(torch.bfloat16)

    def plain_fwd_bwd():
        for p in plain.parameters():
            p.grad = None
        loss_of(plain).backward()
    plain_s = timed(plain_fwd_bwd, args.steps, args.warmup)

    # bare: the library alone on the optimizer's own job (as the C++ trainer's backend is driven).
    L = native.lib()
    h = opt._native.handle
    host = torch.zeros(opt.padded_length, dtype=torch.bfloat16)
    lrs = (ctypes.c_double * 1)(1e-4)
    report = native.OffloadStepReport()

    def bare():
        native.check(L.offload_begin_step(h, opt._commits.step + 1))
        ptr = L.offload_gradient_buffer(h, 0, opt.padded_length)
        ctypes.memset(ptr, 0, 2 * opt.padded_length)
        native.check(L.offload_gradients_ready(h, 0, opt.padded_length, ptr))
        native.check(L.offload_commit(h, None, lrs, 1, -1.0, ctypes.c_void_p(host.data_ptr()),
                                      ctypes.byref(report)))
        opt._commits.step += 1
    bare_s = timed(bare, args.steps, args.warmup)
    fp32_state_bytes = rss_anon(opt._server.pid) / n
    opt.close()

    # bf16: the same with the server's moments in bf16.
    model = copy.deepcopy(base)
    opt = otorch.AdamW(model.parameters(), lr=1e-4, state_dtype=torch.bfloat16)
    bf16_step_s, bf16_opt_s = offload_steps()
    bf16_state_bytes = rss_anon(opt._server.pid) / n
    opt.close()

    # delayed: the same with delay_update (the paper's DPU, no warm-up): step() returns once the
    # commit has left, which then overlaps the next forward and backward's start.
    model = copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "delayed.json")
        opt = otorch.AdamW(model.parameters(), lr=1e-4, delay_update=True, delay_warmup_steps=0,
                           trace_file=trace)
        delayed_step_s, delayed_opt_s = offload_steps()
        opt.close()  # writes the trace
        overlap = overlap_fraction(trace)

    # during: the update during backward, through the same local server, then on the in-process
    # engine with a trace (its early updates are the sender's spans there).
    model = copy.deepcopy(base)
    opt = otorch.AdamW(model.parameters(), lr=1e-4, update_in_backward=True)
    during_step_s, during_opt_s = offload_steps()
    early_share = opt.last_report["early_updated"] / opt.num_params
    opt.close()
    model = copy.deepcopy(base)
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "during.json")
        opt = otorch.AdamW(model.parameters(), lr=1e-4, update_in_backward=True,
                           servers="inprocess", trace_file=trace)
        offload_steps()
        opt.close()
        inside_backward = inside_fraction(trace, "update_early", "backward")

    # zero3: ZeRO-3, the same server and batches, windows of one and two blocks.
    zero3 = {}
    for window in (1, 2):
        model = copy.deepcopy(base)
        opt = otorch.AdamW(model.parameters(), lr=1e-4, zero_stage=3, model=model, window=window)
        step_s, _ = offload_steps()
        zero3[window] = (step_s, opt.param_window.peak_resident_bytes)
        opt.close()

    overlap_runs = overlap_all(base, loss_of, args)

    print(f"torch_offload model=gpt params={n} layers={args.layers} channels={args.channels} "
          f"batch={args.batch}x{args.seq} threads={torch.get_num_threads()} plane={transport}")
    print(f"optimizer step  torch_foreach_fp32_s={torch_opt_s:.4f} offload_step_s={offload_opt_s:.4f}"
          f" speedup={torch_opt_s / offload_opt_s:.2f}x (target >= 10x)")
    print(f"whole step      torch_fp32_s={torch_step_s:.4f} offload_bf16_s={offload_step_s:.4f}"
          f" speedup={torch_step_s / offload_step_s:.2f}x")
    print(f"step() wait     sync_s={offload_opt_s:.4f} delayed_s={delayed_opt_s:.4f} "
          f"whole_step_delayed_s={delayed_step_s:.4f} whole_step_sync_s={offload_step_s:.4f} "
          f"delayed_vs_sync={offload_step_s / delayed_step_s:.2f}x "
          f"delayed_vs_torch={torch_step_s / delayed_step_s:.2f}x "
          f"commit_outside_step={overlap:.2f}")
    print(f"during backward sync_s={offload_opt_s:.4f} during_s={during_opt_s:.4f} "
          f"whole_step_during_s={during_step_s:.4f} whole_step_sync_s={offload_step_s:.4f} "
          f"during_vs_sync={offload_step_s / during_step_s:.2f}x "
          f"wait_vs_sync={during_opt_s / offload_opt_s:.2f} "
          f"updated_before_commit={early_share:.2f} "
          f"update_inside_backward={inside_backward:.2f} (in-process trace)")
    print(f"bf16 state      server_bytes_per_param fp32_state={fp32_state_bytes:.2f} "
          f"bf16_state={bf16_state_bytes:.2f} (RssAnon) step() sync_s={offload_opt_s:.4f} "
          f"bf16_state_s={bf16_opt_s:.4f} whole_step_sync_s={offload_step_s:.4f} "
          f"whole_step_bf16_state_s={bf16_step_s:.4f}")
    print_overlap(overlap_runs, args)
    for window, (step_s, peak) in zero3.items():
        print(f"zero3 window={window} step_s={step_s:.4f} whole_step_stage2_s={offload_step_s:.4f} "
              f"stage3_vs_stage2={step_s / offload_step_s:.2f}x param_bytes_peak={peak} "
              f"param_bytes_all={2 * n} device_share={peak / (2 * n):.3f}")
    print(f"front end       offload_step_s={offload_step_s:.4f} fwd_bwd_bf16_s={plain_s:.4f} "
          f"bare_commit_s={bare_s:.4f} cost={offload_step_s / (plain_s + bare_s):.3f}x of "
          "fwd+bwd+bare (target <= 1.2x)")


if __name__ == "__main__":
    main()
