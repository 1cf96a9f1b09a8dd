"""Each host's step rate, from `tpulaunch.heartbeat(step=N)`, and which host falls behind (pure).

Samples are taken when the driver sees a new step number in a poll reply, on the driver's clock
(hosts' clocks may disagree). A host's current rate is over the last `WINDOW_S` seconds and is
measured up to *now*, so a host that stops reporting (stopped, swapping, stuck in I/O) decays
towards 0 instead of keeping its last pace. A straggler is a host whose rate is below `ratio`
times the median rate of the hosts that report steps, once the median host has made
`MIN_STEPS` steps in the window (no verdict on too little evidence).

In lockstep SPMD training every collective waits for the slowest host, so all hosts step at its
pace; a host is then seen falling behind only where hosts are not in lockstep (input pipelines,
evaluation, data jobs, asynchronous dispatch running ahead).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0
MIN_STEPS = 5


@dataclass(frozen=True)
class Straggler:
    process: int  # index into the attempt's hosts
    rate: float  # its steps/s now
    median: float  # the median host's steps/s now


class StepRates:
    """Per-host (time, step) samples and the rates and verdicts they give."""

    def __init__(self, hosts: int, window_s: float = WINDOW_S, min_steps: int = MIN_STEPS) -> None:
        self.window_s, self.min_steps = window_s, min_steps
        self.samples: list[deque[tuple[float, int]]] = [deque() for _ in range(hosts)]
        self.first: list[tuple[float, int] | None] = [None] * hosts
        self.flagged: set[int] = set()

    def record(self, i: int, step: int | None, now: float) -> None:
        """Host `i` said it is at `step` (seen at `now`); repeats of the same step are not news."""
        if step is None:
            return
        q = self.samples[i]
        if q and q[-1][1] == step:
            return
        if self.first[i] is None:
            self.first[i] = (now, step)
        q.append((now, step))
        while len(q) > 2 and q[1][0] <= now - self.window_s:
            q.popleft()  # keep one sample at or before the window's start: the base of the rate

    def last(self, i: int) -> int | None:
        q = self.samples[i]
        return q[-1][1] if q else None

    def steps_in_window(self, i: int) -> int:
        """Steps since the base sample (the last one at or before the window's start)."""
        q = self.samples[i]
        return q[-1][1] - q[0][1] if q else 0

    def rate(self, i: int, now: float) -> float | None:
        """Steps per second from the base sample up to `now`; None before two samples."""
        q = self.samples[i]
        if len(q) < 2 or now <= q[0][0]:
            return None
        return max(0.0, (q[-1][1] - q[0][1]) / (now - q[0][0]))

    def overall(self, i: int) -> float | None:
        """Steps per second from the host's first reported step to its last (for the summary)."""
        first, q = self.first[i], self.samples[i]
        if first is None or not q or q[-1][0] <= first[0]:
            return None
        return (q[-1][1] - first[1]) / (q[-1][0] - first[0])

    def stragglers(self, ratio: float, now: float, among: set[int]) -> tuple[list[Straggler], list[int]]:
        """(hosts newly below `ratio` x the median, hosts back to pace) among the running hosts."""
        rates = {i: r for i in among if (r := self.rate(i, now)) is not None}
        if len(rates) < 2 or ratio <= 0:
            return [], []
        median = statistics.median(rates.values())
        evidence = statistics.median(self.steps_in_window(i) for i in rates)
        if median <= 0 or evidence < self.min_steps:
            return [], []
        new = [Straggler(i, r, median) for i, r in sorted(rates.items())
               if r < ratio * median and i not in self.flagged]
        back = [i for i in sorted(self.flagged) if i in rates and rates[i] >= ratio * median]
        self.flagged |= {s.process for s in new}
        self.flagged -= set(back)
        return new, back
