#!/usr/bin/python3
"""Writes adam_torch_fixtures.txt: torch.optim.Adam / AdamW trajectories for adam_kernel_test.

Run with Debian's python3-torch (torch 1.13), from the repository root:

  /usr/bin/python3 cpu_optimizer_server/adam/testdata/make_adam_fixtures.py \
      cpu_optimizer_server/adam/testdata/adam_torch_fixtures.txt

Every float is written as its fp32 bit pattern in hex, so the file is exact. In this file the
hyper-parameters are rounded to fp32 before torch sees them (the kernel's API took fp32 ones when
it was made); the files below use torch's own doubles.

Two more files, with hyper-parameters as Python doubles (not exact in fp32) and an lr that
changes every step, as a LambdaLR warm-up and cosine decay gives it:

  /usr/bin/python3 cpu_optimizer_server/adam/testdata/make_adam_fixtures.py --schedule \
      cpu_optimizer_server/adam/testdata/adam_torch_schedule_fixtures.txt
  build/torch2-venv/bin/python cpu_optimizer_server/adam/testdata/make_adam_fixtures.py --lerp \
      cpu_optimizer_server/adam/testdata/adam_torch_lerp_fixtures.txt

--schedule (torch 1.13): torch.optim.Adam / AdamW themselves (form=0), and `scalars` records:
ComputeAdamStepScalars' expected fp32 scalars, computed here in Python doubles exactly as torch's
_single_tensor_adam(w) computes them, for both forms.
--lerp (torch 2.x): torch 2.x's single-tensor op sequence (exp_avg.lerp_, form=1) written out in
plain torch, with a correctly rounded sqrt in place of torch's CPU sqrt (torch 2.13's vectorized
sqrt is not correctly rounded: ~20% of values 1 ulp off with AVX512 capability, even at n=37; the
kernels keep IEEE sqrt). The script checks that the same sequence with torch's own sqrt gives
exactly torch 2.x's AdamW / Adam, so the written-out sequence is torch's but for the sqrt.

Format (one record per line, tokens separated by single spaces):
  case NAME adamw=0|1 lr=HEX beta1=HEX beta2=HEX eps=HEX weight_decay=HEX n=N steps=S
  param0 HEX*N                  initial weights (exp_avg and exp_avg_sq start at zero)
  step T                        then, for that step:
  grad HEX*N
  param HEX*N                   torch's state after step T
  exp_avg HEX*N
  exp_avg_sq HEX*N
  end

In the --schedule / --lerp files, the case line has form=0|1 and its hyper-parameters as fp64 bit
patterns (16 hex digits), and each step line reads `step T lr=HEX16` (that step's lr). Also:
  scalars form=F adamw=A lr=HEX16 beta1=HEX16 beta2=HEX16 eps=HEX16 weight_decay=HEX16 t=T
      want=HEX*9   beta1 one_minus_beta1 beta2 one_minus_beta2 eps l2_weight_decay
                   decoupled_decay step_size bias_correction2_sqrt (fp32)
"""
import math
import struct
import sys

import numpy as np
import torch

N = 37  # odd: not a multiple of any vector width
STEPS = 5

CASES = [
    # name, optimizer, lr, betas, eps, weight_decay
    ("adam_default", torch.optim.Adam, 1e-3, (0.9, 0.999), 1e-8, 0.0),
    ("adam_l2", torch.optim.Adam, 1e-2, (0.9, 0.999), 1e-8, 0.01),
    ("adam_l2_strong", torch.optim.Adam, 3e-2, (0.8, 0.95), 1e-6, 0.1),
    ("adamw_default", torch.optim.AdamW, 1e-3, (0.9, 0.999), 1e-8, 0.01),
    ("adamw_strong", torch.optim.AdamW, 3e-2, (0.8, 0.95), 1e-6, 0.1),
    ("adamw_no_decay", torch.optim.AdamW, 5e-4, (0.9, 0.98), 1e-8, 0.0),
]


def f32(x):
    return float(np.float32(x))


def hexbits(t):
    a = t.detach().contiguous().numpy().astype(np.float32).view(np.uint32)
    return " ".join("%08x" % int(u) for u in a)


def hex1(x):
    return "%08x" % struct.unpack("<I", struct.pack("<f", x))[0]


def make_grad(gen, step):
    g = torch.randn(N, generator=gen) * 0.1
    g[0] = 0.0           # zero gradient
    g[2] = 1e-20         # g * g underflows to zero in fp32
    g[3] = 1e4 * (-1) ** step  # large, alternating sign
    g[4] = 3e-3
    return g


def make_param(gen):
    p = torch.randn(N, generator=gen)
    p[1] = 0.0           # zero weight
    p[5] = 100.0         # large weight: weight decay dominates
    p[6] = -1e-30        # tiny weight
    return p


def hex64(x):
    return "%016x" % struct.unpack("<Q", struct.pack("<d", x))[0]


# Hyper-parameters of the --schedule and --lerp cases: not exact in fp32.
SCHED_BETAS = (0.9, 0.95)
SCHED_LR = 3e-4
SCHED_WD = 0.1
SCHED_EPS = 1e-8
SCHED_STEPS = 6

SCHED_CASES = [
    # name, decoupled (AdamW), lr scheduled, betas
    ("adamw_sched", True, True, SCHED_BETAS),
    ("adamw_const", True, False, SCHED_BETAS),
    ("adam_sched", False, True, SCHED_BETAS),
    # 1 - beta1 >= 0.5: torch's lerp takes its other branch (from grad).
    ("adamw_sched_low_beta1", True, True, (0.3, 0.95)),
]


def warmup_cosine(warmup, total):
    def f(step):  # LambdaLR's factor for scheduler step `step` (0-based)
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return f


def step_scalars(form, adamw, lr, b1, b2, eps, wd, t):
    """ComputeAdamStepScalars as torch computes it: Python floats, each rounded to fp32 once."""
    step = float(t)  # _get_value(step_t): a float
    bias_correction1 = 1 - b1 ** step
    bias_correction2 = 1 - b2 ** step
    step_size = lr / bias_correction1
    # 1.13: math.sqrt(bias_correction2); 2.x: bias_correction2 ** 0.5
    bc2_sqrt = math.sqrt(bias_correction2) if form == 0 else bias_correction2 ** 0.5
    return [b1, 1 - b1, b2, 1 - b2, eps, 0.0 if adamw else wd, 1 - lr * wd if adamw else 1.0,
            step_size, bc2_sqrt]


def write_scalars(out):
    lrs = [3e-4, 1e-3, 2.9999999999999997e-05, 0.1]
    configs = [((0.9, 0.95), 1e-8, 0.1), ((0.9, 0.999), 1e-8, 0.01), ((0.3, 0.97), 3e-7, 0.05)]
    for form in (0, 1):
        for adamw in (1, 0):
            for (b1, b2), eps, wd in configs:
                for lr, t in zip(lrs, (1, 2, 7, 1000)):
                    want = step_scalars(form, adamw, lr, b1, b2, eps, wd, t)
                    out.write("scalars form=%d adamw=%d lr=%s beta1=%s beta2=%s eps=%s "
                              "weight_decay=%s t=%d want=%s\n"
                              % (form, adamw, hex64(lr), hex64(b1), hex64(b2), hex64(eps),
                                 hex64(wd), t, ",".join(hex1(x) for x in want)))


def ieee_sqrt(t):
    # sqrt in float64 then rounded to fp32 is the correctly rounded fp32 sqrt (53 >= 2 * 24 + 2).
    return t.double().sqrt().float()


def lerp_form_step(param, grad, exp_avg, exp_avg_sq, step, lr, b1, b2, eps, wd, decoupled,
                   sqrt=ieee_sqrt):
    """torch 2.x's _single_tensor_adam, op for op, with an IEEE sqrt unless told otherwise."""
    if wd != 0:
        if decoupled:
            param.mul_(1 - lr * wd)
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg.lerp_(grad, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bias_correction1 = 1 - b1 ** step
    bias_correction2 = 1 - b2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = (sqrt(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def main_schedule(path, lerp):
    major = int(torch.__version__.split(".")[0])
    if lerp != (major >= 2):
        sys.exit("--lerp needs torch 2.x, --schedule torch 1.13 (this is torch %s)"
                 % torch.__version__)
    out = open(path, "w")
    form = 1 if lerp else 0
    if lerp:
        out.write("# torch 2.x single-tensor Adam / AdamW sequence (exp_avg.lerp_), IEEE sqrt, fp32 CPU.\n")
    else:
        out.write("# torch.optim.Adam / AdamW (fp32, CPU, foreach=False), hyper-parameters as doubles.\n")
    out.write("# Generated by: make_adam_fixtures.py %s (see the script for the format).\n"
              % ("--lerp" if lerp else "--schedule"))
    capability = [line.strip() for line in torch.__config__.show().splitlines()
                  if "CPU capability" in line]
    out.write("# torch %s (%s)\n"
              % (torch.__version__, capability[0].lstrip("- ") if capability else "CPU capability unknown"))
    if not lerp:
        write_scalars(out)
    for index, (name, decoupled, scheduled, (b1, b2)) in enumerate(SCHED_CASES):
        gen = torch.Generator().manual_seed(4321 + index)
        param = torch.nn.Parameter(make_param(gen))
        opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        opt = opt_cls([param], lr=SCHED_LR, betas=(b1, b2), eps=SCHED_EPS, weight_decay=SCHED_WD,
                      amsgrad=False, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, warmup_cosine(3, SCHED_STEPS) if scheduled else (lambda step: 1.0))
        # The written-out sequence (torch 2.x only): with an IEEE sqrt (the fixture), and with
        # torch's own sqrt (must equal torch's optimizer).
        mine = [param.detach().clone(), torch.zeros(N), torch.zeros(N)]
        check = [param.detach().clone(), torch.zeros(N), torch.zeros(N)]
        out.write("case %s adamw=%d form=%d lr=%s beta1=%s beta2=%s eps=%s weight_decay=%s "
                  "n=%d steps=%d\n"
                  % (name, int(decoupled), form, hex64(SCHED_LR), hex64(b1), hex64(b2),
                     hex64(SCHED_EPS), hex64(SCHED_WD), N, SCHED_STEPS))
        out.write("param0 %s\n" % hexbits(param))
        for step in range(1, SCHED_STEPS + 1):
            lr = opt.param_groups[0]["lr"]
            grad = make_grad(gen, step)
            param.grad = grad.clone()
            opt.step()
            sched.step()
            state = opt.state[param]
            p, m, v = (param, state["exp_avg"], state["exp_avg_sq"])
            if lerp:
                lerp_form_step(mine[0], grad.clone(), mine[1], mine[2], float(step), lr, b1, b2,
                               SCHED_EPS, SCHED_WD, decoupled)
                lerp_form_step(check[0], grad.clone(), check[1], check[2], float(step), lr, b1, b2,
                               SCHED_EPS, SCHED_WD, decoupled, sqrt=torch.sqrt)
                for a, b in zip(check, (p, m, v)):
                    if not torch.equal(a.view(torch.int32), b.detach().view(torch.int32)):
                        sys.exit("%s step %d: torch's own optimizer differs from the written-out "
                                 "2.x sequence" % (name, step))
                p, m, v = mine
            out.write("step %d lr=%s\n" % (step, hex64(lr)))
            out.write("grad %s\n" % hexbits(grad))
            out.write("param %s\n" % hexbits(p))
            out.write("exp_avg %s\n" % hexbits(m))
            out.write("exp_avg_sq %s\n" % hexbits(v))
        out.write("end\n")


def main():
    if len(sys.argv) == 3 and sys.argv[1] in ("--schedule", "--lerp"):
        return main_schedule(sys.argv[2], sys.argv[1] == "--lerp")
    out = open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout
    out.write("# torch.optim.Adam / AdamW trajectories (fp32, CPU, foreach=False, amsgrad=False).\n")
    out.write("# Generated by: /usr/bin/python3 cpu_optimizer_server/adam/testdata/make_adam_fixtures.py "
              "cpu_optimizer_server/adam/testdata/adam_torch_fixtures.txt\n")
    capability = [line.strip() for line in torch.__config__.show().splitlines()
                  if "CPU capability" in line]
    out.write("# torch %s (%s); see the script for the format.\n"
              % (torch.__version__, capability[0].lstrip("- ") if capability else "CPU capability unknown"))
    for index, (name, opt_cls, lr, betas, eps, wd) in enumerate(CASES):
        gen = torch.Generator().manual_seed(1234 + index)
        lr, b1, b2, eps, wd = f32(lr), f32(betas[0]), f32(betas[1]), f32(eps), f32(wd)
        param = torch.nn.Parameter(make_param(gen))
        opt = opt_cls([param], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=False,
                      foreach=False)
        out.write("case %s adamw=%d lr=%s beta1=%s beta2=%s eps=%s weight_decay=%s n=%d steps=%d\n"
                  % (name, int(opt_cls is torch.optim.AdamW), hex1(lr), hex1(b1), hex1(b2),
                     hex1(eps), hex1(wd), N, STEPS))
        out.write("param0 %s\n" % hexbits(param))
        for step in range(1, STEPS + 1):
            grad = make_grad(gen, step)
            param.grad = grad.clone()
            opt.step()
            state = opt.state[param]
            out.write("step %d\n" % step)
            out.write("grad %s\n" % hexbits(grad))
            out.write("param %s\n" % hexbits(param))
            out.write("exp_avg %s\n" % hexbits(state["exp_avg"]))
            out.write("exp_avg_sq %s\n" % hexbits(state["exp_avg_sq"]))
        out.write("end\n")


if __name__ == "__main__":
    main()
