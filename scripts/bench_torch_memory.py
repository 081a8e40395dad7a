#!/usr/bin/env python3
"""bench_torch_memory: bytes per parameter a training process holds, offload.torch.AdamW against
torch.optim.AdamW in fp32 (issue 40).

The model is a GPT-like stack defined here: an embedding of a 256-token vocabulary, N blocks of
Linear(d, 4d) -> GELU -> Linear(4d, d) with a residual, a LayerNorm and an output Linear, d = 1024;
N is chosen per --sizes (millions of parameters; the exact counts are printed). Each
configuration (optimizer x size) runs in a fresh subprocess of this script, so that every
high-water mark starts clean; the parent prints one markdown table. Per configuration:

  1. the bytes of every live p.grad right after backward (offload: opt.backward(loss));
  2. set-up: the model built in fp32 on the CPU, then the optimizer; VmHWM during the optimizer's
     construction above the RSS before it;
  3. after --steps steps: RssAnon above the process before the model and above the weights on the
     host (offload: 16-bit, torch: fp32), the shared-memory segment (RssShmem: the server's shm
     plane) apart, and the high-water of one forward+backward and of one opt.step() above the RSS
     before each;
  4. the high-water of saving and loading the whole state (offload: save_checkpoint and
     load_checkpoint, streamed; torch: torch.save / torch.load + load_state_dict), in bytes;
  5. offload's cpu_optimizer_server (another process): its VmHWM and smaps_rollup Rss/Pss/Shared;
  6. with --device=cuda: the model and weights on the GPU (offload computes in bf16 there, torch
     in fp32) and torch.cuda.max_memory_allocated for set-up, steady state and one step.

High-water marks come from /proc/self/status (VmHWM), reset between phases by writing "5" to
/proc/self/clear_refs (VmHWM restarts from the current RSS). The children run with glibc's mmap
threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so a freed transient block leaves the RSS
instead of staying in the heap (CHILD_MALLOC says why). The targets are printed with PASS or
OVER; the exit status is 0 even when over a target (a benchmark, not a test), 1 only when a
configuration failed to run.

    OFFLOAD_BUILD_DIR=build PYTHONPATH=python /usr/bin/python3 scripts/bench_torch_memory.py \
        [--sizes=60,240] [--steps=3] [--device=cpu|cuda] [--out=FILE.json]

About 1.5 minutes for the default sizes on 2 cores (240M parameters: the torch baseline's load
peaks near 9 GiB of RAM; checkpoints need about 6 GB of disk under --ckpt_dir at a time).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu16 import linear, rollup, status  # noqa: E402

VOCAB = 256
WIDTH = 1024
BATCH, SEQ = 2, 32
MIB = 1 << 20
# Limits of save's and load's high-water: one chunk in flight, "tens of MiB at most", and not
# growing with the model (the largest size may exceed the smallest by this much).
CKPT_LIMIT = 64 * MIB
# glibc raises its mmap threshold to the size of each large block freed, so the step's transient
# megabyte blocks (a weight cast to fp32, its fp32 gradient) end up in the heap and stay counted
# in the RSS after they are freed: a step's high-water would measure the allocator's cache (4-5
# bytes a parameter, measured), not what is live. A fixed threshold maps and unmaps each such
# block, for both optimizers alike.
CHILD_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
CKPT_GROWTH = 16 * MIB


def block_params(d: int = WIDTH) -> int:
    return 8 * d * d + 5 * d  # Linear(d, 4d) and Linear(4d, d), weights and biases


def fixed_params(d: int = WIDTH, vocab: int = VOCAB) -> int:
    return vocab * d + 2 * d + d * vocab + vocab  # embedding, LayerNorm, output Linear


def layers_for(millions: float) -> int:
    return max(1, round((millions * 1e6 - fixed_params()) / block_params()))


# ------------------------------------------------------------------------------------ /proc

def reset_peak() -> None:
    """VmHWM := VmRSS now, so the next VmHWM is this phase's own high-water."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def trim() -> None:
    """Gives glibc's free heap memory back to the kernel. Without it the RSS holds what earlier
    phases freed (the fp32 copies of the weights of the last forward, torch's temporaries), so
    the steady state would count the allocator's cache and the next phase would reuse it unseen."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the figures include the allocator's cache


class Phase:
    """The high-water of a block above the RSS before it (host bytes), and its wall time."""

    def __enter__(self) -> "Phase":
        trim()
        reset_peak()
        self.rss = status()["VmRSS"]
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.rise = status()["VmHWM"] - self.rss


# ------------------------------------------------------------------------------------ child

def build_model(layers: int) -> Any:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

    class GPTLike(nn.Module):
        """(B, T) tokens -> (B, T, vocab) logits. On the CPU the offload model computes in fp32
        on its 16-bit weights one matrix at a time (cpu16.linear: torch 1.13 has no fast bf16
        matmul there, and a plain .float() would keep every weight's fp32 copy for backward)."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(layers))
            self.ln = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = F.embedding(idx, self.emb.weight).float()
            for b in self.blocks:
                u = F.gelu(linear(h, b.fc1.weight, b.fc1.bias))
                h = h + linear(u, b.fc2.weight, b.fc2.bias)
            h = F.layer_norm(h, (WIDTH,), self.ln.weight.float(), self.ln.bias.float())
            return linear(h, self.head.weight, self.head.bias)

    return GPTLike()


def run_child(kind: str, layers: int, steps: int, device: str, ckpt_root: str) -> Dict[str, Any]:
    """One configuration, measured in this (fresh) process."""
    import torch
    import torch.nn.functional as F

    cuda = device == "cuda"
    offload = kind == "offload"
    if offload:
        import offload.torch as otorch
        from offload import native
        native.lib()  # dlopen before the baseline: the library's own pages are no per-parameter cost
    if cuda:
        # The CUDA context (hundreds of MiB of host memory) before the baseline, for both sides.
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    out: Dict[str, Any] = {"kind": kind, "layers": layers, "device": device,
                           "torch": torch.__version__, "python": sys.executable,
                           "torch_threads": torch.get_num_threads()}

    def log(msg: str) -> None:
        print(f"bench_torch_memory [{kind} L{layers}] {msg}", file=sys.stderr, flush=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    trim()
    base = status()
    torch.manual_seed(0)
    model = build_model(layers)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    out["params"] = n
    log(f"{n} parameters built in fp32 on the CPU")

    # 2. Set-up: the optimizer's construction (torch on CUDA: the model's move there too, as
    # offload's device="cuda" moves it).
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with Phase() as setup:
        if offload:
            opt = otorch.AdamW(params, lr=1e-4, device="cuda" if cuda else None)
        else:
            if cuda:
                model.to("cuda")
            opt = torch.optim.AdamW(params, lr=1e-4)
        sync()
    out["setup_hwm"] = setup.rise
    out["setup_s"] = setup.seconds
    if cuda:
        out["cuda_setup_max"] = torch.cuda.max_memory_allocated()
    out["weights_bytes"] = sum(p.numel() * p.element_size() for p in params)
    weights_host = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu")
    if offload:
        out["transport"] = opt.transport
        server_pid = opt._server.pid

    dev = torch.device(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(dev)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(dev)

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(x).float().view(-1, VOCAB), y.view(-1))

    def grads_held() -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)

    def zero_grad() -> None:
        if offload:
            opt.zero_grad()
        else:
            # torch 1.13's default, explicit so torch 2.x (None by default) measures the same:
            # the fp32 gradients stay allocated across steps, part of the steady state.
            opt.zero_grad(set_to_none=False)

    def backward() -> None:
        loss = loss_fn()
        if offload:
            opt.backward(loss)
        else:
            loss.backward()
        sync()

    # 1. and the steady state: --steps whole steps.
    held, step_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        zero_grad()
        backward()
        held.append(grads_held())
        opt.step()
        sync()
        step_times.append(time.perf_counter() - t0)
    out["grads_after_backward"] = max(held)
    out["step_s"] = statistics.median(step_times)
    log(f"{steps} steps, median {out['step_s']:.2f} s")

    # 3. The steady state, then one more step's forward+backward and opt.step() apart.
    out["steady_anon_untrimmed"] = status()["RssAnon"] - base["RssAnon"] - weights_host
    trim()
    now = status()
    out["steady_anon"] = now["RssAnon"] - base["RssAnon"] - weights_host
    out["steady_shmem"] = now["RssShmem"] - base["RssShmem"]
    out["steady_grads"] = grads_held()
    if cuda:
        out["cuda_steady"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    zero_grad()
    with Phase() as fwd_bwd:
        backward()
    with Phase() as step:
        opt.step()
        sync()
    out["fwd_bwd_hwm"] = fwd_bwd.rise
    out["opt_step_hwm"] = step.rise
    if cuda:
        out["cuda_step_max"] = torch.cuda.max_memory_allocated()
    if offload:
        out["server_steady"] = dict(status(server_pid), **rollup(server_pid))

    # 4. Save and load the whole state.
    ckpt = tempfile.mkdtemp(prefix="bench_torch_memory-", dir=ckpt_root)
    try:
        path = os.path.join(ckpt, "state.pt")
        with Phase() as save:
            if offload:
                opt.save_checkpoint(ckpt)
            else:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        out["ckpt_disk"] = sum(os.path.getsize(os.path.join(d, f))
                               for d, _, fs in os.walk(ckpt) for f in fs)
        log(f"saved {out['ckpt_disk'] / 1e9:.2f} GB in {save.seconds:.1f} s")
        with Phase() as load:
            if offload:
                opt.load_checkpoint(ckpt)
            else:
                state = torch.load(path)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                del state
            sync()
        log(f"loaded in {load.seconds:.1f} s")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    out["save_hwm"], out["save_s"] = save.rise, save.seconds
    out["load_hwm"], out["load_s"] = load.rise, load.seconds

    # 5. The server's own memory (its VmHWM covers its whole life, save and load included).
    if offload:
        out["server_end"] = dict(status(server_pid), **rollup(server_pid))
        opt.close()
    return out


# ------------------------------------------------------------------------------------ parent

def machine() -> Dict[str, Any]:
    info: Dict[str, Any] = {"nproc": len(os.sched_getaffinity(0)), "platform": platform.platform()}
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                info["mem_total"] = int(line.split()[1]) * 1024
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f
                               if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    return info


def run_configs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Each configuration in its own subprocess, one at a time (the machine is shared)."""
    results = []
    for millions in args.sizes:
        layers = layers_for(millions)
        for kind in ("offload", "torch"):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                result_path = f.name
            cmd = [sys.executable, os.path.abspath(__file__), f"--child={kind}",
                   f"--layers={layers}", f"--steps={args.steps}", f"--device={args.device}",
                   f"--ckpt_dir={args.ckpt_dir}", f"--result={result_path}"]
            t0 = time.perf_counter()
            rc = subprocess.call(cmd, stdout=sys.stderr, env=dict(os.environ, **CHILD_MALLOC))
            wall = time.perf_counter() - t0
            r: Dict[str, Any] = {"kind": kind, "layers": layers, "size_m": millions}
            if rc == 0:
                with open(result_path) as f:
                    r.update(json.load(f))
            else:
                r["error"] = f"exit {rc}"
            os.unlink(result_path)
            r["wall_s"] = wall
            print(f"bench_torch_memory: {kind} L{layers}: {r.get('error', 'ok')} in {wall:.0f} s",
                  file=sys.stderr, flush=True)
            results.append(r)
    return results


Row = Tuple[str, Any]


def rows_for(results: List[Dict[str, Any]], cuda: bool) -> List[Row]:
    def per(key: str, sub: Optional[str] = None) -> Any:
        def f(r: Dict[str, Any]) -> str:
            v = r.get(key) if sub is None else (r.get(key) or {}).get(sub)
            return "-" if v is None else f"{v / r['params']:.2f}"
        return f

    def mib(key: str) -> Any:
        return lambda r: "-" if r.get(key) is None else (
            f"{r[key] / MIB:.1f} MiB ({r[key] / r['params']:.3f})")

    def secs(key: str) -> Any:
        return lambda r: "-" if r.get(key) is None else f"{r[key]:.1f}"

    rows: List[Row] = [
        ("parameters (blocks)", lambda r: f"{r['params']:,} ({r['layers']})"),
        ("weights on their device, B/param", per("weights_bytes")),
        ("1. p.grad held after backward", per("grads_after_backward")),
        ("2. set-up high-water above the fp32 model", per("setup_hwm")),
        ("3. steady state: RssAnon above the weights", per("steady_anon")),
        ("3. the same before malloc_trim(0)", per("steady_anon_untrimmed")),
        ("3. steady state: of which p.grad", per("steady_grads")),
        ("3. steady state: RssShmem (shm plane)", per("steady_shmem")),
        ("3. forward+backward high-water above RSS", per("fwd_bwd_hwm")),
        ("3. opt.step() high-water above RSS", per("opt_step_hwm")),
        ("4. save high-water above RSS", mib("save_hwm")),
        ("4. load high-water above RSS", mib("load_hwm")),
        ("4. checkpoint on disk", per("ckpt_disk")),
        ("5. server RssAnon after the steps", per("server_steady", "RssAnon")),
        ("5. server RssShmem (the shm plane)", per("server_steady", "RssShmem")),
        ("5. server VmHWM after the steps", per("server_steady", "VmHWM")),
        ("5. server VmHWM at the end (save, load)", per("server_end", "VmHWM")),
        ("5. server Rss / Pss / Shared at the end", lambda r: "-" if "server_end" not in r else
         " / ".join(f"{r['server_end'][k] / r['params']:.2f}" for k in ("Rss", "Pss", "Shared"))),
    ]
    if cuda:
        rows += [
            ("6. CUDA set-up max allocated", per("cuda_setup_max")),
            ("6. CUDA steady state allocated", per("cuda_steady")),
            ("6. CUDA one step max allocated", per("cuda_step_max")),
        ]
    rows += [
        ("wall: configuration (s)", secs("wall_s")),
        ("wall: one training step (s, median)", secs("step_s")),
        ("wall: optimizer set-up (s)", secs("setup_s")),
        ("wall: save / load (s)", lambda r: "-" if r.get("save_s") is None else
         f"{r['save_s']:.1f} / {r['load_s']:.1f}"),
    ]
    return rows


def table(results: List[Dict[str, Any]], cuda: bool) -> str:
    ok = [r for r in results if "error" not in r]
    head = ["measure (bytes per parameter unless said)"] + [
        f"{r['kind']} {r['params'] / 1e6:.0f}M" for r in ok]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, f in rows_for(ok, cuda):
        lines.append("| " + " | ".join([label] + [f(r) for r in ok]) + " |")
    return "\n".join(lines)


def targets(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    off = [r for r in results if r["kind"] == "offload" and "error" not in r]

    def add(what: str, value: float, limit: float, unit: str) -> None:
        out.append({"target": what, "value": value, "limit": limit, "unit": unit,
                    "verdict": "PASS" if value <= limit else "OVER"})

    for r in off:
        m = f"{r['params'] / 1e6:.0f}M"
        n = r["params"]
        # A bucket (4M 16-bit elements, 8 MiB) is 0.03 B/param at 240M: the target is stated there.
        if n >= 200e6:
            add(f"offload {m}: p.grad held after backward", r["grads_after_backward"] / n, 0.05,
                "B/param")
        add(f"offload {m}: set-up high-water above the fp32 model", r["setup_hwm"] / n, 2.1,
            "B/param")
        add(f"offload {m}: save high-water", r["save_hwm"] / MIB, CKPT_LIMIT / MIB, "MiB")
        add(f"offload {m}: load high-water", r["load_hwm"] / MIB, CKPT_LIMIT / MIB, "MiB")
    if len(off) >= 2:
        small = min(off, key=lambda r: r["params"])
        large = max(off, key=lambda r: r["params"])
        for key in ("save_hwm", "load_hwm"):
            add(f"offload {key.split('_')[0]} high-water does not grow with the model "
                f"({large['params'] / 1e6:.0f}M minus {small['params'] / 1e6:.0f}M)",
                (large[key] - small[key]) / MIB, CKPT_GROWTH / MIB, "MiB")
    return out


def summary_line(results: List[Dict[str, Any]], checks: List[Dict[str, Any]],
                 device: str) -> str:
    """One machine-readable line (KEY=VALUE, as bench_gpu's), for scripts/gpu-check's summary:
    the verdicts, and the largest size's figures per parameter."""
    ok = [r for r in results if "error" not in r]
    over = sum(c["verdict"] == "OVER" for c in checks)
    fields = [f"device={device}", f"targets_pass={len(checks) - over}", f"targets_over={over}",
              f"configs_failed={len(results) - len(ok)}"]
    if ok:
        n = max(r["params"] for r in ok)
        fields.append(f"params={n}")
        for r in (r for r in ok if r["params"] == n):
            for key in ("grads_after_backward", "setup_hwm", "steady_anon", "save_hwm",
                        "load_hwm", "cuda_setup_max", "cuda_steady", "cuda_step_max"):
                if r.get(key) is not None:
                    fields.append(f"{r['kind']}_{key}={r[key] / n:.3f}")
    return "torch_memory " + " ".join(fields)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="60,240",
                    help="model sizes in millions of parameters, comma-separated")
    ap.add_argument("--steps", type=int, default=3, help="training steps before the measures")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", help="also write the results and the table as JSON here")
    ap.add_argument("--ckpt_dir", "--ckpt-dir", default=tempfile.gettempdir(),
                    help="where the checkpoints are written (removed after each)")
    ap.add_argument("--child", choices=("offload", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be at least 1")

    if args.child:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        result = run_child(args.child, args.layers, args.steps, args.device, args.ckpt_dir)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0

    args.sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    if args.device == "cuda":
        import torch  # the parent only checks: the children measure
        if not torch.cuda.is_available():
            print("bench_torch_memory: --device=cuda but torch sees no GPU", file=sys.stderr)
            return 1
    need = 12 * max(fixed_params() + layers_for(s) * block_params() for s in args.sizes)
    free = shutil.disk_usage(args.ckpt_dir).free
    if free < 1.2 * need:
        print(f"bench_torch_memory: {args.ckpt_dir} has {free / 1e9:.1f} GB free, the checkpoints "
              f"need about {need / 1e9:.1f} GB: pass --ckpt_dir", file=sys.stderr)
        return 1

    t0 = time.perf_counter()
    results = run_configs(args)
    wall = time.perf_counter() - t0
    info = machine()
    ok = [r for r in results if "error" not in r]
    versions = sorted({r["torch"] for r in ok})
    md = table(results, args.device == "cuda")
    checks = targets(results)

    print(f"# bench_torch_memory: device={args.device} steps={args.steps} batch={BATCH}x{SEQ} "
          f"vocab={VOCAB} d={WIDTH}")
    print(f"torch {', '.join(versions) or '?'} ({sys.executable}), "
          f"torch threads {ok[0]['torch_threads'] if ok else '?'}, "
          f"offload plane {next((r['transport'] for r in ok if 'transport' in r), '?')}; "
          f"machine: {info['nproc']} CPUs ({info['cpu']}), MemTotal "
          f"{info['mem_total'] / 2**30:.1f} GiB; whole run {wall:.0f} s")
    print()
    print(md)
    print()
    for c in checks:
        print(f"target {c['verdict']:4}  {c['target']}: {c['value']:.3f} {c['unit']} "
              f"(<= {c['limit']:g})")
    for r in results:
        if "error" in r:
            print(f"FAILED  {r['kind']} with {r['layers']} blocks: {r['error']}")
    over = sum(c["verdict"] == "OVER" for c in checks)
    print(f"bench_torch_memory: {len(checks) - over} targets PASS, {over} OVER"
          + (f", {len(results) - len(ok)} configurations FAILED" if len(ok) < len(results)
             else ""))
    print(summary_line(results, checks, args.device))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "torch": versions, "device": args.device,
                       "steps": args.steps, "batch": [BATCH, SEQ], "wall_s": wall,
                       "configs": results, "targets": checks, "table": md}, f, indent=1)
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
