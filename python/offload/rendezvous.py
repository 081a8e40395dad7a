"""A torch job's torch.distributed rendezvous that only its own attempt can use (ARCHITECTURE.md
section 7, "Torch jobs").

On the pool, rank 0 of a torch job serves torch.distributed's TCPStore on ``MASTER_PORT``, a port
every trainer pod can reach, and the store checks nobody. Any rank of any other job could read
the addresses the job's ranks publish there, or write its own and join the job's process groups.
So inside a job, every key of the job's store lives under a prefix derived from the attempt's
shard secret (``$OFFLOAD_TOKEN``, which only the attempt's ranks are handed): HMAC-SHA256 of a fixed
label under that secret. The store has no way to list its keys, so without the secret no key of
the job can be named, read, written or waited for: a stranger who connects reaches an empty
store. What it can still do is connect and load the store with keys of its own; the traffic is
not encrypted (section "Authentication and TLS").

:func:`install` makes ``env://`` (``torch.distributed.init_process_group("gloo")`` with no store)
do this, so a script written for ``torchrun`` needs no change, as long as it imports ``offload``
first (``offload.torch`` installs it on import); :func:`init_process_group` does it explicitly.
Outside a job both leave torch alone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
from typing import Any, Callable, Iterator, Optional, Tuple

_LABEL = b"offload torch.distributed rendezvous v1"
_torch_env_handler: Optional[Callable[..., Iterator[Tuple[Any, int, int]]]] = None


def key_prefix(secret: str) -> str:
    """The prefix of every key of the job's store: not derivable without the attempt's secret."""
    digest = hmac.new(secret.encode(), _LABEL, hashlib.sha256).hexdigest()
    return f"offload-{digest}/"


def _secret() -> Optional[str]:
    """The attempt's shard secret inside a torch job on the pool; None elsewhere."""
    if not os.environ.get("OFFLOAD_CONTROL_DIR"):
        return None
    return os.environ.get("OFFLOAD_SHARD_TOKEN") or os.environ.get("OFFLOAD_TOKEN") or None


def _job_env_handler(url: str, **kwargs: Any) -> Iterator[Tuple[Any, int, int]]:
    """torch's own env:// rendezvous, its store wrapped under the attempt's prefix."""
    import torch.distributed as dist

    assert _torch_env_handler is not None
    inner = _torch_env_handler(url, **kwargs)
    store, rank, world_size = next(inner)
    secret = _secret()
    if secret is not None:
        store = dist.PrefixStore(key_prefix(secret), store)
    yield store, rank, world_size
    # torch's handler cannot rendezvous twice either: let it say so.
    next(inner)


def install() -> bool:
    """Makes env:// rendezvous through the job's prefix (idempotent). False where torch.distributed
    is not available; the handler itself only changes anything inside a job."""
    global _torch_env_handler
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    if handlers.get("env") is not _job_env_handler:
        _torch_env_handler = handlers["env"]
        handlers["env"] = _job_env_handler
    return True


def init_process_group(backend: str = "gloo", **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, init_method="env://", ...)`` with the job's
    rendezvous: the ranks, world size and master from the job's environment."""
    import torch.distributed as dist

    if not install():
        raise RuntimeError("torch.distributed is not available in this torch")
    dist.init_process_group(backend, init_method="env://", **kwargs)
