"""Where an optimizer's job runs: ``OffloadOptions``, the servers and how to reach them.

One dataclass holds what says where and how the optimizer servers are reached and keep the
job's state (the servers, credential, TLS, transport, timeouts, the local server's settings and
the state tier); ``offload.torch.AdamW(..., options=OffloadOptions(...))`` takes it whole, and
each of its fields is also a keyword of AdamW, as before. A torch job on the pool
(``offload.job``) fills what the script left open from its environment, here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from offload import job as _job
from offload import native
from offload.native import NativeOptimizer

if TYPE_CHECKING:  # started only where no servers are given: `import offload` stays light
    from offload.server import LocalServer

# Seconds; a torch job's parallel.shard_step_timeout_floor replaces it ($OFFLOAD_STEP_TIMEOUT_FLOOR).
_DEFAULT_STEP_TIMEOUT_FLOOR = 60.0


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """Where the optimizer's job runs and how it is reached.

    servers: None starts a local ``cpu_optimizer_server`` child process (over shared memory);
      a list of "host:port" uses running servers (with ``token``); "inprocess" runs the same
      shard engine in this process, without a server.
    token: the running servers' credential (default ``$OFFLOAD_TOKEN``).
    transport: "auto", "shm", "grpc" or "ucx".
    threads: Adam threads of the local server or the in-process engine (0: every core).
    job_id: the job's name on the servers (default: a fresh one).
    tls_ca, tls_cert, tls_key, tls_server_name: TLS to the servers (cert and key: mutual TLS).
    call_timeout: seconds any call to a server may take.
    step_timeout_floor: inside a step, a server that has not answered within 10x its median step,
      and at least this many seconds, is hung: the step raises naming it (at most call_timeout).
    state_dir: the local server's disk tier (``--state_dir``, servers=None only).
    optimizer_state: "auto" (on disk when the state does not fit the server's memory limit),
      "memory" or "disk": where the servers keep this job's fp32 state.
    server_memory_mib: the local server's ``--memory_limit_mib`` (0: its default).
    trace_file: write a Chrome trace of every step there (backward, the gradients' sends, step)
      at close() and at write_trace().
    state_dtype: the servers' Adam moments: None or torch.float32 (fp32, 12 bytes of state a
      parameter with the fp32 master weights) or torch.bfloat16 (8 bytes; also "fp32", "bf16").
      bf16 moments stay bf16 in memory and on the disk tier alike, and the weights' update is
      computed in fp32 from them; the checkpoint records which.
    state_rounding: how bf16 moments are stored: "stochastic" (default; unbiased, the same bits
      on every run) or "nearest" (which freezes exp_avg_sq where beta2's decay is under half a
      bf16 ulp, as with beta2 = 0.999).
    optimizer_cores: cores for the local server alone (servers=None): its Adam workers are
      pinned to them, one each (``threads`` 0: one worker per core), and this process's threads
      keep to the other cores, torch's intra-op threads lowered to their number where more
      (``offload.placement``). None: both use every core.
    server_priority: the local server's scheduling (servers=None): "normal" (default), or
      "idle" (SCHED_IDLE: it runs only on cycles no other process wants, so the update it
      overlaps with this process's forward and backward, ``update_in_backward`` or
      ``delay_update``, takes only what torch leaves, and its commit, which this process waits
      for, gets the cores then). Only where this process is the machine's one busy neighbour:
      beside other busy processes an idle server gets almost nothing.
    """

    servers: Any = None
    token: Optional[str] = None
    transport: str = "auto"
    threads: int = 0
    job_id: Optional[str] = None
    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_server_name: Optional[str] = None
    call_timeout: float = 600.0
    step_timeout_floor: float = _DEFAULT_STEP_TIMEOUT_FLOOR
    state_dir: Optional[str] = None
    optimizer_state: str = "auto"
    server_memory_mib: int = 0
    trace_file: Optional[str] = None
    optimizer_cores: Optional[Tuple[int, ...]] = None
    state_dtype: Any = None
    state_rounding: str = "stochastic"
    server_priority: str = "normal"

    def __post_init__(self) -> None:
        if self.optimizer_state not in native.TIERS:
            raise ValueError(f"optimizer_state must be one of {sorted(native.TIERS)}, not "
                             f"{self.optimizer_state!r}")
        _state_dtype_name(self.state_dtype)  # checks it
        if self.state_rounding not in native.ROUNDINGS:
            raise ValueError(f"state_rounding must be one of {sorted(native.ROUNDINGS)}, not "
                             f"{self.state_rounding!r}")
        if self.server_priority not in ("normal", "idle"):
            raise ValueError(f"server_priority must be 'normal' or 'idle', not "
                             f"{self.server_priority!r}")
        if self.optimizer_cores is not None:
            object.__setattr__(self, "optimizer_cores", tuple(self.optimizer_cores))

    def with_keywords(self, keywords: Dict[str, Any]) -> "OffloadOptions":
        """These options with the keywords (fields by name) that differ from their default; a
        field set both here and by a keyword is refused."""
        changes: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = keywords.get(f.name, f.default)
            if value == f.default:
                continue
            if getattr(self, f.name) != f.default:
                raise ValueError(f"{f.name} is given twice, as {f.name}= and in options=: "
                                 "set it in one place")
            changes[f.name] = value
        return dataclasses.replace(self, **changes) if changes else self

    def in_this_job(self, process_group: Any) -> Tuple["OffloadOptions", Any]:
        """What a torch job on the pool (offload.job) fills when no servers are given: its
        servers, id, transport, TLS files, step timeout floor (the job's
        parallel.shard_step_timeout_floor) and ranks. Outside a job, these options as they are."""
        servers = _job.servers()
        if self.servers is not None or servers is None:
            return self, process_group
        env = os.environ.get
        filled = dataclasses.replace(
            self, servers=servers, job_id=self.job_id or _job.job_id(),
            transport=(env("OFFLOAD_TRANSPORT") or "auto") if self.transport == "auto"
            else self.transport,
            tls_ca=self.tls_ca or env("OFFLOAD_TLS_CA"),
            tls_cert=self.tls_cert or env("OFFLOAD_TLS_CERT"),
            tls_key=self.tls_key or env("OFFLOAD_TLS_KEY"),
            tls_server_name=self.tls_server_name or env("OFFLOAD_TLS_SERVER_NAME"),
            step_timeout_floor=float(env("OFFLOAD_STEP_TIMEOUT_FLOOR") or self.step_timeout_floor)
            if self.step_timeout_floor == _DEFAULT_STEP_TIMEOUT_FLOOR else self.step_timeout_floor)
        if process_group is None:
            from offload.ranks import job_group
            process_group = job_group()
        return filled, process_group

    def reach(self, world: int) -> Tuple[List[str], Optional[str], Optional[LocalServer]]:
        """The servers' addresses (none: the in-process engine) and token, and the local server
        started for them, if any."""
        servers, token = self.servers, self.token
        if self.optimizer_cores is not None and servers is not None:
            raise ValueError("optimizer_cores= places the local server's (servers=None) Adam "
                             "threads; a running server takes --optimizer_cores itself")
        if servers is None:
            if world > 1:
                raise ValueError("several ranks need running servers: pass servers=[...] and "
                                 "token=...")
            from offload.server import LocalServer
            extra: List[str] = []
            trainer_cores = server_cpus = None
            if self.optimizer_cores is not None:
                from offload import placement
                cores, trainer_cores = placement.split(self.optimizer_cores)
                extra.append(f"--optimizer_cores={placement.cpu_list(cores)}")
                server_cpus = placement.process_cores()
            server = LocalServer(threads=self.threads, state_dir=self.state_dir,
                                 memory_limit_mib=self.server_memory_mib, extra_flags=extra,
                                 cpus=server_cpus, idle=self.server_priority == "idle")
            if trainer_cores is not None:
                placement.keep_off(trainer_cores)
            return [server.address], server.token, server
        if self.state_dir is not None:
            raise ValueError("state_dir= is the local server's (servers=None); running servers "
                             "have their own --state_dir")
        if self.server_priority != "normal":
            raise ValueError("server_priority= is the local server's (servers=None); running "
                             "servers and the in-process engine keep their own scheduling")
        if isinstance(servers, str):
            if servers == "inprocess":
                if world > 1:
                    raise ValueError("servers='inprocess' is one process's engine: several ranks "
                                     "need running servers")
                return [], None, None
            servers = [servers]
        servers = list(servers)
        if not servers:
            raise ValueError("servers=[] names no server; use None for a local one")
        if token is None:
            token = os.environ.get("OFFLOAD_TOKEN")
        return servers, token, None

    def create_job(self, ranks: Any, *, num_params: int, dtype: int, groups: Any,
                   loss_scale: float, loss_scale_window: int, grad_clip: float,
                   adam_form: int) -> Tuple[NativeOptimizer, str, Optional[LocalServer]]:
        """The job on the servers, a local one started first where there is none: rank 0 creates
        it, then the others join it; every rank learns whether all did. Returns this rank's
        optimizer, the job id and the local server, if any."""
        addresses, token, server = self.reach(ranks.world)
        job_id = self.job_id if self.job_id is not None else ranks.from_rank0(fresh_job_id())
        shards = (native.c_str * max(1, len(addresses)))(*[a.encode() for a in addresses])
        enc = lambda s: s.encode() if s else None  # noqa: E731
        config = native.OffloadConfig(
            abi_version=native.ABI_VERSION, job_id=job_id.encode(), num_params=num_params,
            world_size=ranks.world, rank=ranks.rank, create_job=1 if ranks.rank == 0 else 0,
            dtype=dtype, num_groups=len(groups), groups=groups, num_shards=len(addresses),
            shard_addresses=shards, threads=self.threads, transport=self.transport.encode(),
            token=enc(token), tls_ca=enc(self.tls_ca), tls_cert=enc(self.tls_cert),
            tls_key=enc(self.tls_key), tls_server_name=enc(self.tls_server_name),
            call_timeout_seconds=self.call_timeout,
            step_timeout_floor_seconds=self.step_timeout_floor, loss_scale_init=loss_scale,
            loss_scale_window=loss_scale_window, grad_clip=grad_clip,
            trace_file=enc(self.trace_file), state_tier=native.TIERS[self.optimizer_state],
            adam_form=adam_form, state_dtype=_STATE_DTYPES[_state_dtype_name(self.state_dtype)],
            state_rounding=native.ROUNDINGS[self.state_rounding])
        create = lambda: NativeOptimizer.create(config)  # noqa: E731
        created, error = native.attempt(create) if ranks.rank == 0 else (None, None)
        ranks.agree(error, "creating the job")
        if ranks.rank != 0:
            created, error = native.attempt(create)
        ranks.agree(error, "joining the job")
        return created, job_id, server


_STATE_DTYPES = {"fp32": native.FP32, "bf16": native.BF16}


def _state_dtype_name(dtype: Any) -> str:
    """"fp32" or "bf16" for a torch dtype (str(torch.bfloat16) is "torch.bfloat16", so no torch
    import here), a name, or None (fp32)."""
    if dtype is None:
        return "fp32"
    name = str(dtype).replace("torch.", "")
    names = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16",
             "bfloat16": "bf16"}
    if name not in names:
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, not {dtype!r}")
    return names[name]


def fresh_job_id() -> str:
    return f"torch-{os.getpid()}-{secrets.token_hex(4)}"
