"""An optimizer server of this process's own: ``cpu_optimizer_server`` as a child process.

``python3 -m offload.server [flags]`` runs the package's ``cpu_optimizer_server`` itself (the same
flags, ``--help`` included), e.g. a server for a pool from an installed wheel.

``offload.torch.AdamW(servers=None)`` starts one on 127.0.0.1 with a fresh token (handed over in
the child's environment, never its argv), reaches it over shared memory, and stops it when the
optimizer is closed or the interpreter exits. On Linux the child also dies with its parent
(PR_SET_PDEATHSIG), so a killed training script leaves no server behind. The signal follows the
thread that started the server: build the optimizer on a thread that lives as long as training
(the main thread, as scripts do).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import secrets
import select
import signal
import subprocess
import tempfile
import time
import weakref
from typing import Callable, List, Optional

from offload.native import OffloadError, server_binary

_PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: the forked child of a threaded process (torch, OpenMP) must not
# dlopen before exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent(parent: int, cpus: Optional[List[int]] = None) -> Callable[[], None]:
    def run() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    return run


def _make_idle(pid: int) -> None:
    """Every thread of process `pid` under SCHED_IDLE (lowering needs no privilege); the threads
    they start later inherit it. Again until a pass finds none left, for a thread started by one
    not yet moved while the pass ran."""
    while True:
        moved = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                if os.sched_getscheduler(int(tid)) != os.SCHED_IDLE:
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                    moved += 1
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        if moved == 0:
            return


class LocalServer:
    """One cpu_optimizer_server child; ``address`` and ``token`` reach it."""

    def __init__(self, threads: int = 0, memory_limit_mib: int = 0, start_timeout: float = 60.0,
                 extra_flags: Optional[List[str]] = None, token: Optional[str] = None,
                 state_dir: Optional[str] = None, state_memory_mib: int = 0,
                 cpus: Optional[List[int]] = None, idle: bool = False):
        """state_dir: the server's disk tier (``--state_dir``): jobs whose state does not fit
        memory_limit_mib, or that ask for the disk, keep it in files there, streamed through a
        ring of state_memory_mib (0: the server's default). cpus: the cores the server may run
        on, where not this process's (offload.placement: this process may have been moved off
        the cores its server is to have). idle: run the server under SCHED_IDLE, on the cycles no
        other process of the machine wants (OffloadOptions.server_priority)."""
        self.token = token or secrets.token_hex(16)
        self._log = tempfile.NamedTemporaryFile(prefix="offload-server-", suffix=".log",
                                                delete=False)
        flags = ["--listen=127.0.0.1:0", f"--threads={threads}", "--ucx=false"]
        if memory_limit_mib > 0:
            flags.append(f"--memory_limit_mib={memory_limit_mib}")
        if state_dir:
            os.makedirs(state_dir, exist_ok=True)
            flags.append(f"--state_dir={state_dir}")
        if state_memory_mib > 0:
            flags.append(f"--state_memory_mib={state_memory_mib}")
        flags += extra_flags or []
        env = dict(os.environ, OFFLOAD_TOKEN=self.token)
        self.process = subprocess.Popen([server_binary()] + flags, env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=self._log,
                                        preexec_fn=_die_with_parent(os.getpid(), cpus))
        self._log.close()  # the child writes it; log_tail() reads it by name
        self._finalizer = weakref.finalize(self, LocalServer._stop, self.process, self._log.name)
        atexit.register(self._finalizer)
        self.address = self._wait_for_port(start_timeout)
        if idle:  # once started: its start-up does not wait for an idle machine
            _make_idle(self.process.pid)

    def _wait_for_port(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        out = self.process.stdout
        line = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.1)
            if ready:
                chunk = os.read(out.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
                m = re.search(rb"listening port=(\d+)", line)
                if m:
                    return f"127.0.0.1:{int(m.group(1))}"
            elif self.process.poll() is not None:
                break
        tail = self.log_tail()  # before close(), which deletes the log
        self.close()
        raise OffloadError(14, f"cpu_optimizer_server did not start: {tail}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self._log.name, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _stop(process: subprocess.Popen, log: str) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()
        try:
            os.unlink(log)
        except OSError:
            pass


def main() -> None:
    """Replaces this process with cpu_optimizer_server and the given flags: its signals, output
    and exit code are the program's own."""
    import sys
    program = server_binary()
    os.execv(program, [program] + sys.argv[1:])


if __name__ == "__main__":
    main()
