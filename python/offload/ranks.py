"""The ranks of one optimizer (torch.distributed, or one rank without it): who they are, and the
few collectives the front end runs between them outside the gradients' own (grad_hooks.py).

Every rank must learn of one rank's failure: a rank that raised alone would leave the others
waiting in the next collective. So a call that may fail on one rank (creating the job, loading,
committing) is ``agree``d on before anyone raises.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import torch

from offload.native import OffloadError


def job_group() -> Any:
    """A torch job's ranks (offload.job): torch.distributed's default group when the job has
    several, which the script must have set up (the job's MASTER_ADDR, RANK... are in its
    environment)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"this torch job has {world} ranks: call "
                           "torch.distributed.init_process_group('gloo') (the job's MASTER_ADDR, "
                           "MASTER_PORT, RANK and WORLD_SIZE are set) before building the "
                           "optimizer, or pass process_group=")
    return dist.group.WORLD


class Ranks:
    """``world`` ranks of ``group`` (None: this process alone), this one being ``rank``."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.world, self.rank = 1, 0
        if group is not None:
            import torch.distributed as dist
            self.world = dist.get_world_size(group)
            self.rank = dist.get_rank(group)

    def src0(self) -> int:
        """The global rank of the group's rank 0 (what torch.distributed's src= names)."""
        import torch.distributed as dist
        if self.group is None or self.group == dist.group.WORLD:
            return 0
        get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        return get(self.group, 0)

    def agree(self, error: Optional[OffloadError], what: str) -> None:
        """Raises on every rank when any rank has an error (one rank's failure must not leave
        the others waiting in a collective); with one rank, raises this rank's error."""
        rc, message = (error.code, error.message) if error is not None else (0, "")
        if self.world == 1:
            if rc:
                raise OffloadError(rc, message)
            return
        import torch.distributed as dist
        codes: List[Any] = [0] * self.world
        dist.all_gather_object(codes, (rc, message), group=self.group)
        if rc:
            raise OffloadError(rc, message)
        for r, (code, text) in enumerate(codes):
            if code:
                raise RuntimeError(f"rank {r} failed {what}: {OffloadError(code, text)}")

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's value on every rank (a Python object)."""
        if self.world == 1:
            return value
        import torch.distributed as dist
        box = [value]
        dist.broadcast_object_list(box, src=self.src0(), group=self.group)
        return box[0]

    def all_objects(self, value: Any) -> List[Any]:
        """Every rank's value, in rank order."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast_bytes(self, t: Any) -> None:
        """Rank 0's bytes of tensor t into every rank's (as bytes: gloo has no bfloat16)."""
        import torch.distributed as dist
        dist.broadcast(t.view(-1).view(torch.uint8), src=self.src0(), group=self.group)

    def backend(self) -> str:
        import torch.distributed as dist
        return dist.get_backend(self.group)
