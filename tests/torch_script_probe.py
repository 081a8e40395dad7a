"""A hostile torch job script for tests/torch_script_isolation_test.sh (issue 60 part 1).

It runs as a torch job's command on a trainer pool worker and tries to reach everything of the
worker's it can find from inside: the files named in the worker's command line (its token, its
TLS key), the worker's process (environment, memory, descriptors, signals), the job controller's
WorkerService and JobService with what it was handed and with every token it managed to read,
and the other torch scripts running on the same pod (their environment holds their own
attempt's shard secret). Each try prints one line, ``probe: refused WHAT: WHY`` or
``probe: REACHED WHAT: WHAT IT GOT``; the exit status is the number of things reached (0: the
worker kept everything to itself). It needs only the standard library and grpcio, sends its
RPCs as raw bytes (an empty request: a call that gets past authentication answers something
other than UNAUTHENTICATED or PERMISSION_DENIED), and waits up to --peer_wait seconds for
another probe to appear so that two jobs running at once each try the other.

With --victim it is instead one rank of a two-rank job that meets its peer through
torch.distributed's env:// rendezvous (offload imported first, as a job's script does), and rank
0 publishes a key through the store its process group got, then holds until --until exists.
With --attack FILE it is a rank of another job that, once FILE names the victim's rendezvous
("host port"), tries to read that key from the victim's store and to join the victim's group as
its rank 1, with its own job's environment.
"""
import argparse
import os
import signal
import sys
import time

reached = []


def report(what: str, ok: bool, detail: str) -> None:
    detail = " ".join(detail.split())[:200]
    if ok:
        reached.append(what)
        print(f"probe: REACHED {what}: {detail}", flush=True)
    else:
        print(f"probe: refused {what}: {detail}", flush=True)


def try_read(what: str, path: str) -> str:
    """The file's text where it could be read, else ''."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            entries = os.listdir(path)
            report(what, True, f"{path} lists {len(entries)} entries")
            return ""
        with open(path, "rb") as f:
            data = f.read(4096)
        report(what, True, f"{path}: {data[:80]!r}")
        return data.decode(errors="replace")
    except OSError as e:
        report(what, False, f"{path}: {e.strerror}")
        return ""


def try_signal(what: str, pid: int) -> None:
    try:
        os.kill(pid, 0)
        report(what, True, f"signal 0 to pid {pid} delivered")
    except OSError as e:
        report(what, False, f"pid {pid}: {e.strerror}")


def cmdline(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def owner(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def worker_pid() -> int:
    """The pool worker that started this script: the nearest ancestor running gpu_trainer."""
    pid = os.getppid()
    while pid > 1:
        if any(a.endswith("gpu_trainer") for a in cmdline(pid)[:1]):
            return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return os.getppid()


def try_rpcs(controller: str, tokens: dict) -> None:
    import grpc

    channel = grpc.insecure_channel(controller)
    calls = [("WorkerService", "RegisterWorker"), ("WorkerService", "Heartbeat"),
             ("WorkerService", "RendezvousGet"), ("JobService", "ListJobs")]
    for name, token in tokens.items():
        metadata = [("authorization", "Bearer " + token)] if token else None
        for service, method in calls:
            what = f"{service}.{method} with {name}"
            rpc = channel.unary_unary(f"/offload.v1.{service}/{method}",
                                      request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)
            try:
                rpc(b"", metadata=metadata, timeout=10)
                report(what, True, "answered OK")
            except grpc.RpcError as e:
                refused = e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                       grpc.StatusCode.PERMISSION_DENIED)
                report(what, not refused, f"{e.code().name} {e.details()}")


MARKER = "published by the victim's rank 0"


def victim(until: str) -> int:
    import torch
    import torch.distributed as dist

    import offload  # noqa: F401  (the job's rendezvous, as offload.torch would install it)

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"probe: victim rank {dist.get_rank()} all_reduce {int(t.item())}", flush=True)
    if dist.get_rank() == 0:
        store, _, _ = next(dist.rendezvous("env://", rank=0, world_size=2))
        store.set("marker", MARKER)
        print("probe: victim ready", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(until) and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    return 0 if os.path.exists(until) else 1


def attack(target_file: str) -> int:
    import datetime

    import torch.distributed as dist

    from offload import rendezvous

    deadline = time.monotonic() + 120
    while not os.path.exists(target_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    host, port = open(target_file).read().split()
    client = dist.TCPStore(host, int(port), 2, False, datetime.timedelta(seconds=3),
                           wait_for_workers=False)
    own_secret = os.environ.get("OFFLOAD_TOKEN", "")
    for name, store in (("no prefix", client),
                        ("this job's prefix", dist.PrefixStore(rendezvous.key_prefix(own_secret),
                                                               client))):
        try:
            value = store.get("marker").decode()
            report(f"the other job's store key with {name}", True, value)
        except RuntimeError as e:
            report(f"the other job's store key with {name}", False, str(e).splitlines()[0])
    # Join the other job as its rank 1, through env:// with this job's own secret.
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK="1", WORLD_SIZE="2")
    rendezvous.install()
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
        report("joining the other job's process group", True, f"rank {dist.get_rank()}")
    except RuntimeError as e:
        report("joining the other job's process group", False, str(e).splitlines()[0])
    print(f"probe: reached {len(reached)}: {', '.join(reached) or 'nothing'}", flush=True)
    return len(reached)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer_wait", type=float, default=0.0)
    parser.add_argument("--victim", action="store_true")
    parser.add_argument("--until", default="")
    parser.add_argument("--attack", default="")
    args = parser.parse_args()
    if args.victim:
        return victim(args.until)
    if args.attack:
        return attack(args.attack)
    worker = worker_pid()
    worker_argv = cmdline(worker)
    print(f"probe: uid {os.getuid()} gid {os.getgid()} groups {sorted(os.getgroups())}; "
          f"worker pid {worker} uid {owner(worker)}", flush=True)
    if os.getuid() == owner(worker):
        report("the worker's user", True, f"this script runs as the worker's uid {os.getuid()}")
    # What it may use: a home of its own (caches, configs).
    home = os.environ.get("HOME", "")
    try:
        with open(os.path.join(home, ".probe"), "w") as f:
            f.write("x")
        print(f"probe: home {home} is writable", flush=True)
    except OSError as e:
        print(f"probe: home {home} is not writable: {e.strerror}", flush=True)

    # Every file the worker was told about on its command line (world-readable in /proc).
    tokens = {"the attempt's shard secret": os.environ.get("OFFLOAD_TOKEN", ""), "no token": ""}
    for arg in worker_argv[1:]:
        flag, _, value = arg.partition("=")
        if value.startswith("/"):
            text = try_read(f"the worker's {flag} file", value)
            if flag == "--token_file" and text.strip():
                tokens["the token read from " + value] = text.strip().splitlines()[0]
    # The worker's process.
    for part in ("environ", "mem", "maps", "fd", "cwd", "root", "auxv"):
        text = try_read(f"the worker's /proc/{part}", f"/proc/{worker}/{part}")
        for entry in text.split("\0"):
            if entry.startswith("OFFLOAD_TOKEN="):
                tokens["the worker's $OFFLOAD_TOKEN"] = entry.split("=", 1)[1]
    try_signal("a signal to the worker", worker)
    # The controller, with what the script was handed and whatever it read.
    controller = next((a.split("=", 1)[1] for a in worker_argv if a.startswith("--controller=")),
                      "")
    if controller:
        try_rpcs(controller, tokens)
    else:
        report("the controller's address", False, "not in the worker's command line")

    # Other scripts of the pod: their environment holds their attempt's secret.
    deadline = time.monotonic() + args.peer_wait
    peers = []
    while True:
        peers = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
                 and any("torch_script_probe" in a for a in cmdline(int(p))[1:2])]
        if peers or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for peer in peers:
        try_read(f"another script's environment (pid {peer}, uid {owner(peer)})",
                 f"/proc/{peer}/environ")
        try_signal(f"a signal to another script (pid {peer})", peer)
    if args.peer_wait > 0 and not peers:
        print("probe: no other script appeared", flush=True)
        return 100
    # Wait for a peer still probing, so that it finds this one too.
    time.sleep(min(args.peer_wait, 2.0))
    print(f"probe: reached {len(reached)}: {', '.join(reached) or 'nothing'}", flush=True)
    return len(reached)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(main())
