"""A script's side of a torch job on the optimizer-server pool (ARCHITECTURE.md section 7, "Torch
jobs").

The job controller runs a torch job's command on a trainer pool worker, which puts the job in the
command's environment: ``OFFLOAD_SERVERS`` (the attempt's optimizer servers), ``OFFLOAD_TOKEN``
(their credential for ``OFFLOAD_JOB_ID``), ``OFFLOAD_CHECKPOINT_DIR``, ``OFFLOAD_TRANSPORT``,
torch.distributed's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``,
and ``OFFLOAD_CONTROL_DIR``, a directory the worker watches: :func:`report` replaces
``progress.json`` there (the JSON of ``offload.v1.ScriptProgress``), and the worker writes the
controller's answer to ``request.json`` (a pause, a cancel, a checkpoint asked for).
``offload.torch.AdamW`` built without ``servers=`` joins the job's servers, its checkpoints default
to the job's directory, and at each step it reports its step count (unless the script reports
itself) and carries out the controller's requests.

Outside a job (no ``OFFLOAD_CONTROL_DIR``) every function here does nothing, so one script runs by
hand and on the pool.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

# At most this often the progress file is replaced, however often the script reports: the worker
# reads it every 200 ms. The last report is written at exit whatever the time.
_MIN_INTERVAL = 0.25

_REQUESTS = {"JOB_REQUEST_NONE": "none", "JOB_REQUEST_PAUSE": "pause",
             "JOB_REQUEST_CANCEL": "cancel", "JOB_REQUEST_CHECKPOINT": "checkpoint"}


def control_dir() -> Optional[str]:
    """The worker's control directory of this job, or None outside a job."""
    return os.environ.get("OFFLOAD_CONTROL_DIR") or None


def active() -> bool:
    """Whether this process is a torch job's rank on the pool."""
    return control_dir() is not None


def servers() -> Optional[List[str]]:
    """The job's optimizer servers ($OFFLOAD_SERVERS), or None."""
    value = os.environ.get("OFFLOAD_SERVERS", "")
    return [s for s in value.split(",") if s] or None


def job_id() -> Optional[str]:
    """The job id its optimizer servers know this attempt by ($OFFLOAD_JOB_ID), or None."""
    return os.environ.get("OFFLOAD_JOB_ID") or None


def checkpoint_dir() -> Optional[str]:
    """The job's checkpoint directory ($OFFLOAD_CHECKPOINT_DIR), or None."""
    return os.environ.get("OFFLOAD_CHECKPOINT_DIR") or None


class _Progress:
    """What this rank has reported, and the file it goes to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fields: Dict[str, Any] = {}
        self.tokens = 0.0
        self.last_time: Optional[float] = None
        self.last_step: Optional[int] = None
        self.by_script = False  # the script called report(): the optimizer's count is not needed
        self.written = 0.0
        self.dirty = False

    def write(self, force: bool) -> None:
        directory = control_dir()
        if directory is None or not self.dirty:
            return
        now = time.monotonic()
        if not force and now - self.written < _MIN_INTERVAL:
            return
        text = json.dumps(dict(self.fields, tokens=self.tokens))
        path = os.path.join(directory, "progress.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError:
            return  # the worker removed the directory: the attempt is over anyway
        self.written = now
        self.dirty = False


_progress = _Progress()
atexit.register(lambda: _flush())


def _flush() -> None:
    with _progress.lock:
        _progress.write(force=True)


def report(step: Optional[int] = None, loss: Optional[float] = None,
           tokens: Optional[float] = None, *, total_steps: Optional[int] = None,
           val_loss: Optional[float] = None, lr: Optional[float] = None,
           loss_scale: Optional[float] = None, grad_norm: Optional[float] = None) -> None:
    """Reports this rank's progress to the job controller: ``step`` completed steps, the last
    ``loss``, ``tokens`` trained on since the last report (e.g. this step's batch: the total and
    tokens/s are kept here), ``total_steps`` for the ETA. They reach the job's status
    (``offloadctl watch``, REST ``GET /v1/jobs/{id}``), its events and the worker's Prometheus
    metrics (``offload_trainer_step``, ``_loss``, ``_tokens_total``...). Cheap to call every step.
    Does nothing outside a job."""
    if not active():
        return
    _record(step, loss, tokens, total_steps=total_steps, val_loss=val_loss, lr=lr,
            loss_scale=loss_scale, grad_norm=grad_norm, by_script=True)


def _record(step: Optional[int], loss: Optional[float], tokens: Optional[float], *,
            by_script: bool, **more: Optional[float]) -> None:
    p = _progress
    with p.lock:
        if by_script:
            p.by_script = True
        elif p.by_script:
            return
        now = time.monotonic()
        if tokens:
            p.tokens += float(tokens)
            if p.last_time is not None and now > p.last_time:
                p.fields["tokens_per_s"] = float(tokens) / (now - p.last_time)
        if step is not None:
            p.fields["step"] = int(step)
        if loss is not None:
            p.fields["loss"] = float(loss)
        for name, value in more.items():
            if value is not None:
                p.fields[name] = int(value) if name == "total_steps" else float(value)
        p.last_time = now
        p.dirty = True
        p.write(force=False)


def _optimizer_stepped(step: int, loss_scale: float) -> None:
    """offload.torch's count after each step, for a script that reports nothing itself."""
    _record(step, None, None, by_script=False, loss_scale=loss_scale)


def _checkpointed(directory: str, step: int, request_done: Optional[int] = None) -> None:
    """A checkpoint was written (and, for a controller's request, which one it carried out)."""
    p = _progress
    with p.lock:
        p.fields["checkpoint_dir"] = directory
        p.fields["checkpoint_step"] = int(step)
        if request_done is not None:
            p.fields["checkpoint_request_done"] = int(request_done)
        p.dirty = True
        p.write(force=True)


def checkpoint_request_done() -> int:
    """The last checkpoint request of the controller this rank carried out."""
    with _progress.lock:
        return int(_progress.fields.get("checkpoint_request_done", 0))


def request() -> Tuple[str, int]:
    """The controller's current request of this job, as the worker last wrote it: ("none",
    "pause", "cancel" or "checkpoint"; the number of checkpoint requests so far). ("none", 0)
    outside a job or before the worker's first answer."""
    directory = control_dir()
    if directory is None:
        return "none", 0
    try:
        with open(os.path.join(directory, "request.json")) as f:
            reply = json.load(f)
    except (OSError, ValueError):
        return "none", 0
    return (_REQUESTS.get(reply.get("request", ""), "none"),
            int(reply.get("checkpoint_request", 0) or 0))
