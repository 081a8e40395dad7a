"""The steps committed on the servers, as this rank counts them, and the delayed update.

``step`` counts the commits (skipped ones included: the servers' completed_step), ``adam_step``
the updates applied (the t of bias correction), and ``lag`` per parameter the updates it missed
(applied steps in which it had no gradient): its own step count, torch's ``state["step"]``, is
``adam_step - lag``. From them come the range steps a commit takes.

The delayed parameter update (``delay_update``, the ZeRO-Offload paper's DPU): a commit may run
on the servers while the model computes; its weights wait in ``Weights.next16`` until the next
step puts them into the parameters (``apply_pending``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from offload import native
from offload.layout import FlatLayout
from offload.native import NativeOptimizer, OffloadStepReport
from offload.weights import Weights


class Commits:
    """The job's counters and the delayed update in flight, if any."""

    def __init__(self, layout: FlatLayout, opt: NativeOptimizer, weights: Weights,
                 delay: bool, delay_warmup: int) -> None:
        self._layout, self._native, self._weights = layout, opt, weights
        self.step = 0  # steps committed (the servers' completed_step)
        self.adam_step = 0  # of them, updates applied (the t of bias correction)
        self.lag = [0] * len(layout)
        self.delay, self.delay_warmup = delay, delay_warmup
        self.in_flight = False  # a delayed commit runs on the servers
        self.pending_update = False  # next16 holds an update the parameters have not
        self.last_report: Optional[Dict[str, Any]] = None  # the last commit's, as a dict

    def restore(self, step: int, adam_step: int, lag: List[int]) -> None:
        """The counters of a loaded state."""
        self.step, self.adam_step, self.lag = step, adam_step, lag
        self.last_report = None

    def trace(self, name: str, begin: float) -> None:
        """A span of the open step's from `begin` (time.monotonic()) until now."""
        self._native.trace_phase(name, self.step + 1, begin, time.monotonic())

    def range_step_runs(self, unused: Sequence[int]) -> List[List[int]]:
        """The coming update's [offset, n, t] runs (layout.range_step_runs)."""
        return self._layout.range_step_runs(unused, self.adam_step, self.lag)

    def set_range_steps(self, unused: Sequence[int], abort: Callable[[], None]) -> None:
        """Tells the commit the range steps of the parameters without a gradient (`unused`) and
        of those that missed updates. Any failure ends the step (abort), nothing applied."""
        runs = self.range_step_runs(unused)
        if not runs:
            return  # the library starts every step with none
        try:
            self._native.set_range_steps(runs)
        except BaseException:
            abort()
            raise

    def delayed_now(self) -> bool:
        """Whether the coming commit is a delayed one (after the warm-up's ordinary steps)."""
        return self.delay and self.step >= self.delay_warmup

    def commit(self, stats: Any, lrs: List[float], max_norm: float,
               delayed: bool) -> OffloadStepReport:
        """Commits the open step: the updated weights of the partition go to the host copy, or
        (delayed) to next16 while the servers work; the caller has put the update of the step
        before into the parameters first (apply_pending)."""
        w = self._weights
        if delayed:
            return self._native.commit(stats, lrs, max_norm, w.host_ptr(w.next16), delayed=True)
        return self._native.commit(stats, lrs, max_norm, w.host_ptr(w.host16))

    def committed(self, report: OffloadStepReport, unused: Sequence[int], delayed: bool) -> None:
        """The counters after a commit (report), its weights in the parameters unless it was
        skipped or is delayed, and the report kept (in_flight is the caller's to set, under its
        lock)."""
        if not report.skipped:
            for i in unused:
                self.lag[i] += 1
        self.step = int(report.step)
        if delayed:  # the shards' count comes with wait(); this is what it will be
            self.adam_step += 0 if report.skipped else 1
            report.adam_step = self.adam_step
            report.skipped_steps = self.step - self.adam_step
        else:
            self.adam_step = int(report.adam_step)
        if not report.skipped and not delayed:
            self._weights.gather(self._weights.host16)
        self.last_report = native.report_dict(report)

    def wait(self) -> None:
        """The delayed commit in flight, if any, done on the servers: its weights wait in next16
        until apply_pending. A commit that failed raises here; its update is lost (the servers
        applied nothing)."""
        if not self.in_flight:
            return
        self.in_flight = False
        report = self._native.wait_commit()
        self.adam_step = int(report.adam_step)
        self.pending_update = not report.skipped

    def apply_pending(self) -> None:
        """The delayed update, once its commit is done, into the parameters (every rank)."""
        self.wait()
        if self.pending_update:
            self.pending_update = False
            self._weights.gather(self._weights.next16)

    def forget_pending(self) -> None:
        """A state loaded replaces whatever a delayed commit would have applied (one that failed
        has nothing to lose)."""
        try:
            self.wait()
        except native.OffloadError:
            pass
        self.pending_update = False
