"""Stops some threads of a process while the others run on: a server whose Adam threads are stuck
(a disk that blocks, a wedged lock) while its gRPC threads still answer keepalives and heartbeats.
SIGSTOP stops every thread; ptrace stops one (PTRACE_SEIZE, then PTRACE_INTERRUPT).

usage: freeze_threads.py PID NAME_PREFIX SECONDS
Stops every thread of PID whose name (/proc/PID/task/TID/comm) starts with NAME_PREFIX, prints
"frozen N", keeps them stopped for SECONDS, lets them go and prints "thawed". Exits 77 where
ptrace is not allowed (a container without CAP_SYS_PTRACE, Yama), 1 when no thread matches.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import time

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
WALL = 0x40000000  # __WALL: wait for threads too

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long


def ptrace(request: int, tid: int) -> None:
    if libc.ptrace(request, tid, None, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")


def main() -> int:
    pid, prefix, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    tids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip().startswith(prefix):
                tids.append(int(tid))
    if not tids:
        print(f"no thread of {pid} is named {prefix}*", file=sys.stderr)
        return 1
    frozen = []
    try:
        for tid in tids:
            try:
                ptrace(PTRACE_SEIZE, tid)
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EACCES) and not frozen:
                    print(f"SKIP: {e}", file=sys.stderr)
                    return 77
                raise
            frozen.append(tid)
            ptrace(PTRACE_INTERRUPT, tid)
            os.waitpid(tid, WALL)  # the thread has stopped
        print(f"frozen {len(frozen)}", flush=True)
        time.sleep(seconds)
    finally:
        for tid in frozen:
            ptrace(PTRACE_DETACH, tid)
    print("thawed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
