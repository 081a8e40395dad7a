"""Offload's Python front end: the optimizer servers behind the interfaces PyTorch users know.

``offload.torch.AdamW`` is a ``torch.optim.Optimizer`` whose fp32 master weights and Adam moments
live on optimizer servers (``cpu_optimizer_server``), reached through the C ABI of
``liboffload_c.so`` (``optimizer_client/capi/offload_c.h``, bound in ``offload.native``). This
package holds no numerics of its own: rounding, statistics, the loss scale, skipping and clipping
are the C++ side's. Where the job runs (servers, TLS, transport, state tier) is an
``offload.options.OffloadOptions``.

A torch training script run as a job on the optimizer-server pool finds its servers, credential
and checkpoint directory in its environment (``offload.job``) and reports its progress with
``offload.report(step=..., loss=..., tokens=...)``.

A job's torch.distributed rendezvous is reachable only with its attempt's secret
(``offload.rendezvous``): importing ``offload`` after torch.distributed, or ``offload.torch``,
makes ``env://`` use it.

``import offload.torch`` needs torch; ``import offload`` does not.
"""

import sys as _sys

from offload import job, rendezvous
from offload.native import OffloadError, library_path
from offload.job import report
from offload.options import OffloadOptions

if "torch.distributed" in _sys.modules:
    rendezvous.install()

__all__ = ["OffloadError", "OffloadOptions", "job", "library_path", "rendezvous", "report"]
__version__ = "0.1.0"
