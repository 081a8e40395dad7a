"""Disjoint cores for the trainer and its local server (``optimizer_cores=``).

A local ``cpu_optimizer_server`` shares the host with the script that started it. Left alone, the
server's Adam threads and torch's compute threads take turns on the same cores, and a torch
thread waiting for its core holds up every other thread at the next barrier of its op. With
``optimizer_cores`` the server's Adam workers are pinned to those cores, one each, and this
process's threads (and so the threads they start later, torch's included) keep to the others, as
prime-rl and SuperOffload place their CPU optimizers.
"""

from __future__ import annotations

import os
from typing import Iterable, List, Optional, Tuple

# The cores this process could run on before keep_off first moved it: a second optimizer (or one
# made again after close()) places itself within the same cores as the first.
_before_placement: Optional[List[int]] = None


def process_cores() -> List[int]:
    """The cores this process may run on, as they were before any placement moved it."""
    if _before_placement is not None:
        return list(_before_placement)
    return sorted(os.sched_getaffinity(0))


def cpu_list(cpus: Iterable[int]) -> str:
    """The cores as a Linux CPU list (cpuset(7)), the server's ``--optimizer_cores``."""
    out: List[str] = []
    cpus = sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def split(optimizer_cores: Iterable[int]) -> Tuple[List[int], List[int]]:
    """(the optimizer's cores, the trainer's: every other core this process may use), checked:
    the optimizer's are distinct cores this process may use, and they leave the trainer one."""
    allowed = process_cores()
    cores = list(optimizer_cores)
    if not cores or not all(isinstance(c, int) and not isinstance(c, bool) for c in cores):
        raise ValueError(f"optimizer_cores must be a non-empty list of core numbers, not "
                         f"{optimizer_cores!r}")
    if len(set(cores)) != len(cores):
        raise ValueError(f"optimizer_cores lists a core twice: {cores}")
    outside = sorted(set(cores) - set(allowed))
    if outside:
        raise ValueError(f"optimizer_cores {outside} are not cores this process may run on "
                         f"({cpu_list(allowed)})")
    trainer = [c for c in allowed if c not in set(cores)]
    if not trainer:
        raise ValueError(f"optimizer_cores takes every core this process may run on "
                         f"({cpu_list(allowed)}): leave the trainer at least one")
    return sorted(cores), trainer


def keep_off(trainer_cores: List[int]) -> None:
    """Moves every thread of this process onto `trainer_cores`, and lowers torch's intra-op
    threads to their number where it is larger: two compute threads on one core would wait for
    each other at every barrier."""
    global _before_placement
    if _before_placement is None:
        _before_placement = sorted(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), trainer_cores)
        except (ProcessLookupError, PermissionError):  # a thread that has just ended
            pass
    import torch
    if torch.get_num_threads() > len(trainer_cores):
        torch.set_num_threads(len(trainer_cores))
