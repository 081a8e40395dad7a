"""A short training run with the installed wheel, for tests/wheel_test.sh and
tests/wheel_container_test.sh (run from outside the repository, with no PYTHONPATH,
LD_LIBRARY_PATH or OFFLOAD_* variables).

    python wheel_train.py SITE [SERVERS [TRANSPORT [DEVICE]]]

SITE is the venv's site-packages: the package, its library and its server, and torch too (PyPI's,
not a system one), must be the copies installed there. SERVERS: a running server's address
(default: a server of the optimizer's own, the packaged program). TRANSPORT: the data plane
("auto", "shm", "grpc" or "ucx"). DEVICE: "cpu" (default) or "cuda", the model on the GPU with
the machine's own CUDA torch, wherever its environment keeps it (scripts/gpu-check: the wheel in a
folder of its own beside it). Ends with one line, "trained: loss A -> B on TRANSPORTS DEVICE".
"""

import os
import sys

import torch

import offload
import offload.native
import offload.torch

site = sys.argv[1]
servers = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
transport = sys.argv[3] if len(sys.argv) > 3 else "auto"
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
installed = [("the library", offload.library_path()),
             ("the server", offload.native.server_binary()), ("the package", offload.__file__)]
if device.type == "cpu":
    installed.append(("torch", torch.__file__))
for what, path in installed:
    assert path.startswith(site + "/"), f"{what} is {path}, not under {site}"

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                            torch.nn.Linear(32, 1)).to(device)
opt = offload.torch.AdamW(model.parameters(), lr=1e-2, servers=servers, transport=transport)
assert opt.device.type == device.type, (opt.device, device)
x = torch.randn(64, 16).to(device, torch.bfloat16)
y = x.float().sum(1, keepdim=True).to(torch.bfloat16)
losses = []
for _ in range(30):
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
assert losses[-1] < 0.5 * losses[0], losses

# The C++ libraries this process mapped are the wheel's (offload/lib/), never a host copy
# (Python's own extension modules may map the host's OpenSSL or zlib: not checked). Over UCX the
# transport modules UCX dlopened must be the wheel's too, not the host's module folder's.
mapped = set()
with open("/proc/self/maps") as maps:
    for line in maps:
        fields = line.split()
        if len(fields) >= 6 and ".so" in fields[5]:
            mapped.add(fields[5])
ours = ("libucs", "libuct", "libucp", "libucm", "libgrpc", "libgpr", "libprotobuf", "libabsl_",
        "libglog", "libgflags")
foreign = sorted(p for p in mapped
                 if not p.startswith(site + "/") and os.path.basename(p).startswith(ours))
assert not foreign, f"host libraries mapped beside the wheel's: {foreign}"
assert any(p.startswith(f"{site}/offload/lib/libgrpc") for p in mapped), sorted(mapped)
if transport == "ucx":
    modules = sorted(p for p in mapped if "/ucx/lib" in p)
    assert modules and all(p.startswith(f"{site}/offload/lib/ucx/") for p in modules), modules
print(f"trained: loss {losses[0]:.3f} -> {losses[-1]:.3f} on {opt.transport} {device.type}")
opt.close()
