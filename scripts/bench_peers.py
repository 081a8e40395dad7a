#!/usr/bin/env python3
"""bench_peers: the CPU Adam implementations users would pick, side by side in one run.

Every row: the same element counts (--n), thread counts (--threads, default 1, 2 and every core)
and AdamW hyper-parameters (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01); the
median of --iters timed steps after one warm-up, and their spread (min-max).
  ds_cpu_adam     DeepSpeed's DeepSpeedCPUAdam(adamw_mode=True): fp32 p, g, m, v; bf16 p and g
                  with fp32 m, v. ds_adam+copy: the fp32 step then half.copy_(fp32 params) into
                  a bf16 / fp16 tensor, what ZeRO-Offload with DeepSpeed does on the CPU a step.
  torch_fused     torch.optim.AdamW(fused=True): fp32; bf16 p, g, m, v (torch keeps the states
                  in the parameters' dtype). torch_foreach: AdamW(foreach=True), fp32.
  offload_kernel  build/bin/bench_adam, best SIMD path: 16-bit grad in, fp32 p, m, v updated,
                  16-bit copy out, one pass; roofline: the same loads and stores, an add each.
                  offload_kernel_s16 and roofline_s16: the same with bf16 moments
                  (state_dtype=bf16, stochastic rounding), 20 bytes an element.
  offload_inproc  a whole step of offload.torch.AdamW(servers="inprocess") through the C library
                  (begin_step, gradients_ready, commit writing the 16-bit weights into a host
                  tensor), Offload's counterpart of ds_adam+copy; offload_server: the same
                  through one local cpu_optimizer_server over shared memory; inproc_commit and
                  server_commit: their commit alone (every gradient measured and sent first),
                  the part of a step that cannot hide under backward.
Config: g(rad), p(aram), s(tates m, v), o(ut: the 16-bit copy), each 32, bf or fp. B/el: the
least traffic per element (4-byte grad + p, m, v read and written = 28 = the kernel's 2-byte grad
+ 24 + 2-byte copy); GB/s = B/el x rate (for foreach, which passes over memory several times, an
effective figure). off/row: the Offload kernel's rate over the row's at the same n and threads
with the matching 16-bit type (fp16 for rows writing fp16, else bf16); roof: the row's GB/s over
the roofline's; cores: CPU time over wall time while timed (with the local server's, counted in
10 ms ticks; bench_adam's over its whole run): the threads that really worked.

Memory: a row holds only its own tensors, 16-22 bytes per element, freed before the next: the
default n = 1e8 needs ~2 GB, n = 1e9 16-22 GB a row, so a row that would not fit in MemAvailable
is skipped with a line. Rows whose software is absent print `# skip ROW: why`.

    scripts/peers-venv      # build/peers-venv: CPU torch 2.13, DeepSpeed, ninja
    OFFLOAD_BUILD_DIR=build PYTHONPATH=python build/peers-venv/bin/python scripts/bench_peers.py \\
        [--n 100000000] [--threads 1,2] [--iters 5] [--skip deepspeed,torch,kernel,inproc,server] \\
        [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


@dataclass
class Row:
    impl: str
    config: str
    bytes_per_el: int
    threads: int
    n: int
    median_s: float
    min_s: float
    max_s: float
    match: str  # the Offload kernel's 16-bit type this row is compared with
    cores: float  # CPU seconds over wall seconds while timed: the threads that really ran
    note: str = ""
    rate: float = field(init=False)  # Gparam/s

    def __post_init__(self) -> None:
        self.rate = self.n / self.median_s * 1e-9


def skip(what: str, why: object) -> None:
    lines = str(why).strip().splitlines() or ["?"]
    print(f"# skip {what}: {lines[-1]}", flush=True)  # an error's last line says what failed


def fits(what: str, need_bytes: int) -> bool:
    """Whether a row's tensors fit in 90% of what the kernel says is available now."""
    with open("/proc/meminfo") as f:
        avail = int(re.search(r"MemAvailable:\s*(\d+)", f.read()).group(1)) * 1024
    if need_bytes > 0.9 * avail:
        skip(what, f"needs ~{need_bytes / 1e9:.1f} GB, {avail / 1e9:.1f} GB available")
        return False
    return True


def values(n: int, dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    """Weights (std 0.02) or gradients (std 0.01), seeded so that every implementation starts
    from the same numbers; real scales keep every path off NaN, inf and denormals."""
    torch.manual_seed(int(grad))
    return torch.randn(n).mul_(0.01 if grad else 0.02).to(dtype)  # one fp32 temporary


def time_steps(step: Callable[[], Optional[float]], iters: int,
               other_cpu: Callable[[], float] = lambda: 0.0) -> Tuple[List[float], float]:
    """One warm-up step (state allocation, first touch, a new thread count), then iters timed;
    a step may return its own time (excluding work that is not the optimizer's). Also the cores
    busy: CPU time of this process (and other_cpu's, a server's) over the wall time."""
    step()
    out = []
    wall0, cpu0 = time.perf_counter(), time.process_time() + other_cpu()
    for _ in range(iters):
        t = time.perf_counter()
        own = step()
        out.append(own if own is not None else time.perf_counter() - t)
    cores = (time.process_time() + other_cpu() - cpu0) / (time.perf_counter() - wall0)
    return out, cores


def row_of(impl: str, config: str, b: int, t: int, n: int, timed: Tuple[List[float], float],
           match: str, note: str = "") -> Row:
    times, cores = timed
    row = Row(impl, config, b, t, n, statistics.median(times), min(times), max(times), match,
              cores, note)
    print(f"# {impl:15} {config:15} T={t} n={n} median {row.median_s:.4f} s "
          f"{row.rate:.3f} Gparam/s, {cores:.2f} cores busy", flush=True)
    return row


# ------------------------------------------------------------------ OpenMP: DeepSpeed and torch

def set_threads(t: int) -> str:
    """torch.set_num_threads (its intra-op pool, and omp_set_num_threads for this thread), then
    omp_set_num_threads on each OpenMP runtime mapped into the process, in case an op brought its
    own (DeepSpeed's links libgomp.so.1, which resolves to torch's when torch is loaded first).
    Returns how, for the output."""
    torch.set_num_threads(t)
    with open("/proc/self/maps") as f:
        runtimes = sorted({line.split()[-1] for line in f
                           if re.search(r"lib(g|i)?omp[^/]*\.so", line)})
    got = []
    for path in runtimes:
        lib = ctypes.CDLL(path)  # the mapped copy: dlopen of a loaded path returns it
        lib.omp_set_num_threads(t)
        got.append(f"omp_get_max_threads()={lib.omp_get_max_threads()} in {path}")
    return (f"torch.set_num_threads({t}), torch.get_num_threads()={torch.get_num_threads()}, "
            f"{'; '.join(got) or 'no OpenMP runtime mapped'}")


def deepspeed_rows(n: int, threads: List[int], iters: int, rows: List[Row]) -> None:
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001  absent, or its import fails on this machine
        skip("ds_cpu_adam", f"import deepspeed: {e!r}")
        return
    from deepspeed.ops.op_builder import CPUAdamBuilder  # the flags its op is built with:
    simd = f"{CPUAdamBuilder().cpu_arch()} {CPUAdamBuilder().simd_width()}"  # -D__AVX512__
    for pdtype, label, b in ((torch.float32, "g32 p32 s32", 28),
                             (torch.bfloat16, "gbf pbf s32", 22)):
        what = f"ds_cpu_adam {label} n={n}"
        if not fits(what, n * (16 if pdtype == torch.float32 else 12) + 2 * n):  # + a copy
            continue
        p = torch.nn.Parameter(values(n, pdtype))
        p.grad = values(n, pdtype, grad=True)
        try:
            opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                   adamw_mode=True)
        except Exception as e:  # noqa: BLE001  the JIT build of its op failed
            return skip(what, repr(e))
        for t in threads:
            how = set_threads(t)
            print(f"# ds_cpu_adam {deepspeed.__version__} ({simd}, {opt.ds_opt_adam.__file__}) "
                  f"threads: {how}", flush=True)
            rows.append(row_of("ds_cpu_adam", label, b, t, n, time_steps(opt.step, iters), "bf16"))
            if pdtype != torch.float32:
                continue
            # ZeRO-Offload's CPU side: the fp32 step, then the 16-bit copy of the weights.
            for half, tag, match in ((torch.bfloat16, "obf", "bf16"),
                                     (torch.float16, "ofp", "fp16")):
                out = torch.empty(n, dtype=half)
                out.copy_(p.data)  # first touch outside the timing

                def step_copy() -> None:
                    opt.step()
                    out.copy_(p.data)
                rows.append(row_of("ds_adam+copy", f"{label} {tag}", b + 6, t, n,
                                   time_steps(step_copy, iters), match))
                del out
        del opt, p
        gc.collect()


def torch_rows(n: int, threads: List[int], iters: int, rows: List[Row]) -> None:
    # (impl, config, dtype, bytes moved, bytes held per element, kind): foreach also holds a
    # temporary of v's size (its sqrt) beside p, g, m, v.
    cases = (("torch_fused", "g32 p32 s32", torch.float32, 28, 16, dict(fused=True)),
             ("torch_fused", "gbf pbf sbf", torch.bfloat16, 14, 8, dict(fused=True)),
             ("torch_foreach", "g32 p32 s32", torch.float32, 28, 20, dict(foreach=True)))
    for impl, label, dtype, b, held, kind in cases:
        what = f"{impl} {label} n={n}"
        if not fits(what, n * held):
            continue
        p = torch.nn.Parameter(values(n, dtype))
        p.grad = values(n, dtype, grad=True)
        try:
            opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kind)
            opt.step()  # torch builds and checks the fused path at the first step
        except Exception as e:  # noqa: BLE001  no CPU fused kernel (torch < 2.4), no bf16 one
            skip(what, f"torch {torch.__version__}: {e!r}")
            del p
            gc.collect()
            continue
        for t in threads:
            print(f"# {impl} threads: {set_threads(t)}", flush=True)
            rows.append(row_of(impl, label, b, t, n, time_steps(opt.step, iters), "bf16"))
        del opt, p
        gc.collect()


# ------------------------------------------------------------------------------ Offload

def simd_path() -> str:
    with open("/proc/cpuinfo") as f:
        flags = set(re.search(r"^flags\s*:(.*)$", f.read(), re.M).group(1).split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar"


def process_cpu(pid: int) -> float:
    """CPU seconds of another live process (a local server), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kernel_rows(n: int, threads: List[int], iters: int, build: str, rows: List[Row]) -> None:
    binary = os.path.join(build, "bin", "bench_adam")
    if not os.access(binary, os.X_OK):
        skip("offload_kernel, roofline", f"{binary} is not built")
        return
    path = simd_path()
    for t in threads:
        if not fits(f"offload_kernel n={n}", n * 16):
            return
        cmd = [binary, f"--n={n}", f"--iters={iters}", f"--threads={t}", f"--paths={path}",
               "--state_dtypes=fp32,bf16"]
        print(f"# offload_kernel threads: {' '.join(cmd)} (its ThreadPool, pinned)", flush=True)
        children_cpu = lambda: sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])  # noqa: E731
        wall0, cpu0 = time.perf_counter(), children_cpu()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # e.g. being relinked by a build right now
            return skip(f"offload_kernel T={t} n={n}", repr(e))
        # Over its whole run, fill and first touch included: the cores bench_adam kept busy.
        cores = (children_cpu() - cpu0) / (time.perf_counter() - wall0)
        if done.returncode != 0:
            skip(f"offload_kernel T={t} n={n}", done.stderr or done.stdout)
            continue
        for line in done.stdout.splitlines():
            if not line.startswith("adam "):
                continue
            kv = dict(re.findall(r"(\w+)=(\S+)", line))
            match = kv["grad"]
            # bf16 moments (state_dtype=bf16): 8 bytes an element less, rows of their own.
            bf16_state = kv.get("state") == "bf16"
            suffix, states, nbytes = ("_s16", "bf", 20) if bf16_state else ("", "32", 28)
            for impl, key in (("offload_kernel" + suffix, "gparams_per_s"),
                              ("roofline" + suffix, "roofline_gparams_per_s")):
                # Its median_, min_ and max_ fields (the roofline's in either order) where it
                # prints them, else its best pass.
                names = [(f"{s}_{key}", key.replace("roofline_", f"roofline_{s}_"))
                         for s in ("median", "min", "max")]
                got = [next((float(kv[k]) for k in ks if k in kv and k != key), None)
                       for ks in names]
                rates = got if all(got) else [float(kv[key])] * 3
                rows.append(row_of(impl, f"g{match[:2]} p32 s{states} o{match[:2]}", nbytes,
                                   int(kv["threads"]), n, ([n / r * 1e-9 for r in rates], cores),
                                   match, "" if all(got) else f"best of {iters}"))


def offload_step_rows(n: int, threads: List[int], iters: int, servers: Optional[str],
                      rows: List[Row]) -> None:
    impl = "offload_inproc" if servers else "offload_server"
    try:
        import offload.torch as otorch
        from offload import native
        L = native.lib()
        if not servers:
            native.server_binary()
    except Exception as e:  # noqa: BLE001  not built, or an ABI mismatch
        skip(impl, repr(e))
        return
    for t in threads:
        if not fits(f"{impl} n={n}", n * 22):  # p, grads, host copy; the engine's state and grads
            return
        torch.set_num_threads(t)
        p = torch.nn.Parameter(values(n, torch.bfloat16))
        try:
            opt = otorch.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                               dtype=torch.bfloat16, servers=servers, threads=t)
        except Exception as e:  # noqa: BLE001  e.g. a server that does not start
            skip(f"{impl} T={t} n={n}", repr(e))
            return
        pool = "the in-process engine's pool" if servers else f"the server's --threads={t}"
        print(f"# {impl} threads: offload.torch.AdamW(threads={t}) ({pool}), "
              f"transport {opt.transport}", flush=True)
        padded, h = opt.padded_length, opt._native.handle
        grads = torch.zeros(padded, dtype=torch.bfloat16)
        grads[:n] = values(n, torch.bfloat16, grad=True)
        host = torch.zeros(padded, dtype=torch.bfloat16)
        lrs = (ctypes.c_double * 1)(LR)
        report = native.OffloadStepReport()
        stats = (ctypes.c_double * 2)()
        pid = opt._server.pid if opt._server else None
        other_cpu = (lambda: process_cpu(pid)) if pid else (lambda: 0.0)
        commits: List[Tuple[float, float]] = []  # (wall, cpu) of each step's commit

        def step() -> float:  # all but writing the gradients, which is backward's work
            t0 = time.perf_counter()
            native.check(L.offload_begin_step(h, opt._commits.step + 1))
            where = L.offload_gradient_buffer(h, 0, padded)
            if not where:
                raise native.OffloadError(9, native.last_error())
            t1 = time.perf_counter()
            ctypes.memmove(where, grads.data_ptr(), 2 * padded)
            t2 = time.perf_counter()
            native.check(L.offload_gradients_ready(h, 0, padded, where))
            native.check(L.offload_local_stats(h, stats))  # every gradient measured and sent
            t3, c3 = time.perf_counter(), time.process_time() + other_cpu()
            native.check(L.offload_commit(h, None, lrs, 1, -1.0, ctypes.c_void_p(host.data_ptr()),
                                          ctypes.byref(report)))
            t4 = time.perf_counter()
            commits.append((t4 - t3, time.process_time() + other_cpu() - c3))
            opt._commits.step += 1
            if report.skipped:
                raise RuntimeError(f"step {report.step} was skipped: the timing would be wrong")
            return (t1 - t0) + (t4 - t2)
        cfg = "gbf p32 s32 obf"
        try:
            rows.append(row_of(impl, cfg, 28, t, n, time_steps(step, iters, other_cpu), "bf16"))
            walls, cpus = zip(*commits[1:])  # past the warm-up
            rows.append(row_of(impl.replace("offload_", "") + "_commit", cfg, 28, t, n,
                               (list(walls), sum(cpus) / sum(walls)), "bf16"))
        except Exception as e:  # noqa: BLE001  a failed or skipped step: the other rows stand
            skip(f"{impl} T={t} n={n}", repr(e))
        opt.close()
        del opt, p, grads, host
        gc.collect()


# ------------------------------------------------------------------------------ the table

def print_table(rows: List[Row]) -> None:
    def find(impl: str, r: Row) -> Optional[Row]:
        return next((k for k in rows if k.impl == impl and k.match == r.match
                     and k.threads == r.threads and k.n == r.n), None)
    head = (f"{'impl':15} {'config':15} {'B/el':>4} {'T':>2} {'n':>10} {'median_s':>9} "
            f"{'spread_s':>15} {'Gparam/s':>8} {'GB/s':>6} {'off/row':>7} {'roof':>5} "
            f"{'cores':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        kernel, roof = find("offload_kernel", r), find("roofline", r)
        gbps = r.rate * r.bytes_per_el
        ratio = f"{kernel.rate / r.rate:7.2f}" if kernel else f"{'-':>7}"
        frac = f"{gbps / (roof.rate * roof.bytes_per_el):5.2f}" if roof else f"{'-':>5}"
        spread = r.note or f"{r.min_s:.4f}-{r.max_s:.4f}"
        print(f"{r.impl:15} {r.config:15} {r.bytes_per_el:4d} {r.threads:2d} {r.n:10d} "
              f"{r.median_s:9.4f} {spread:>15} {r.rate:8.3f} {gbps:6.1f} {ratio} {frac} "
              f"{r.cores:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = os.cpu_count() or 1
    ap.add_argument("--n", default="100000000", help="comma-separated element counts")
    ap.add_argument("--threads", default=f"1,2,{cores}", help="comma-separated thread counts")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per row (median)")
    ap.add_argument("--build_dir", default=os.environ.get("OFFLOAD_BUILD_DIR") or "build")
    ap.add_argument("--skip", default="", help="of deepspeed,torch,kernel,inproc,server")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    ns = [int(float(x)) for x in args.n.split(",") if x]
    threads = sorted({int(t) for t in args.threads.split(",") if t})
    skips = set(args.skip.split(",")) - {""}
    if skips - {"deepspeed", "torch", "kernel", "inproc", "server"}:
        ap.error(f"--skip: unknown {sorted(skips)}")
    build = os.path.abspath(os.path.join(ROOT, args.build_dir)
                            if not os.path.isabs(args.build_dir) else args.build_dir)
    os.environ["OFFLOAD_BUILD_DIR"] = build  # offload.native finds the library and server there
    # DeepSpeed picks its accelerator at import: on a CPU-only machine, say so rather than probe;
    # its op is where scripts/peers-venv built it (else it is JIT-built into ~/.cache, untimed).
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    if os.path.isdir(os.path.join(sys.prefix, "torch-extensions")):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch-extensions"))
    with open("/proc/cpuinfo") as f:
        cpu = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M)
    print(f"# bench_peers: torch {torch.__version__}, python {sys.version.split()[0]}, "
          f"{cores} cores ({cpu.group(1) if cpu else '?'}), Offload SIMD path {simd_path()}, "
          f"n={ns}, threads={threads}, median of {args.iters} steps after 1 warm-up", flush=True)
    rows: List[Row] = []
    for n in ns:
        if "kernel" not in skips:
            kernel_rows(n, threads, args.iters, build, rows)
        if "deepspeed" not in skips:
            deepspeed_rows(n, threads, args.iters, rows)
        if "torch" not in skips:
            torch_rows(n, threads, args.iters, rows)
        for name, servers in (("inproc", "inprocess"), ("server", None)):
            if name not in skips:
                offload_step_rows(n, threads, args.iters, servers, rows)
    rows.sort(key=lambda r: (r.n, r.threads))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
