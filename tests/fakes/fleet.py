"""Simulated hosts behind the supervision's seam (`run.fleet.Fleet`), for the scale harness.

`SimFleet` answers the loop exactly as `RayFleet` does (typed `Reply` / `Gone` events, the same
`PollReply`), for N hosts that print lines at a given rate, exit, get lost or hang, with no Ray
and no processes: the real supervision (`run.execute.supervise`, `AttemptWatch`, `HostLogs`, the
sink) runs unchanged on top of it, in one process, for N = 16, 256 or 2,304. It keeps what the
harness measures: lines sent per host, when each host was told to stop.

The Ray-backed variant (the same host models answering real Ray calls from a few actor
processes) is in `scripts/bench.d/scale.py`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

from tpulaunch.host.protocol import HostOptions, PollReply, PreflightReport, PreflightRequest, Started
from tpulaunch.plan.launch import LaunchPlan, build_plan
from tpulaunch.plan.contract import HostState
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
from tpulaunch.plan.topology import resolve
from tpulaunch.run.fleet import Event, Gone, Reply, cadence
from tpulaunch.run.summary import Cause

STOP_EXIT = 143  # a host told to stop ends as a script does on SIGTERM
STACK = "Thread 0x7f (idle): \"MainThread\"\n    train_step (train.py:12)\n    <module> (train.py:30)\n"


@dataclass(frozen=True)
class SimHost:
    """What one simulated host does, from its start (seconds on the fleet's clock)."""

    line_every_s: float | None = 1.0  # one line this often; None: quiet (a long compile, a hang)
    banner: tuple[str, ...] = ()  # lines printed at once when it starts
    exit_at_s: float | None = None
    exit_code: int = 0
    lost_at_s: float | None = None  # its node goes (an event `Gone`, as RayFleet reports it)
    step_every_s: float | None = None  # `tpulaunch.heartbeat(step=N)` this often


def sim_plan(accelerator: str, log_dir: str, run_id: str = "20261123-000000-scal") -> LaunchPlan:
    """A real plan of one slice of `accelerator` (its hosts at made-up addresses)."""
    topo = resolve(accelerator)
    spec = SliceSpec(name="sim", accelerator_type=topo.accelerator_type, topology=topo.topology, source="sim",
                     workers=tuple(WorkerEndpoint(w, f"10.{w // 65536}.{w // 256 % 256}.{w % 256}")
                                   for w in range(topo.num_hosts)))
    return build_plan(slices=[spec], mesh=plan_mesh(topo), script="train.py", framework="none", run_id=run_id,
                      coordinator_port=8476, emulated=False, log_dir=log_dir, workdir="/tmp")


@dataclass
class _Host:
    model: SimHost
    sent: int = 0  # lines produced
    step: int | None = None
    ended: bool = False
    told_to_stop: float | None = None
    pending: list[tuple[str, str]] = field(default_factory=list)


class SimFleet:
    """A `Fleet` of simulated hosts (see the module docstring). Thread-safe like RayFleet's queue."""

    def __init__(self, hosts: list[SimHost], stop_after_s: float = 0.05) -> None:
        self.hosts = [_Host(m) for m in hosts]
        self.stop_after_s = stop_after_s
        self.t0 = 0.0
        self._heap: list[tuple[float, int, int, str]] = []  # (due, seq, host, what)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.replies = 0  # poll replies delivered (what RayFleet would have made one call each for)
        self.failed_at: float | None = None  # when the first host failed (exit != 0 or lost)
        # as the agent's long poll does (`HostAgent.poll`): a chatty host's lines gather for batch_s
        self.batch_s = cadence(len(hosts))[1]

    # -- the Fleet protocol ---------------------------------------------------------------------

    def start(self, states: list[HostState], options: HostOptions, timeout_s: float) -> list[Started]:
        self.t0 = now = time.monotonic()
        for i, h in enumerate(self.hosts):
            m = h.model
            h.pending.extend(("stdout", line) for line in m.banner)
            h.sent += len(m.banner)
            if m.banner:
                self._push(now, i, "flush")
            if m.line_every_s:
                self._push(now + m.line_every_s, i, "line")
            if m.step_every_s:
                self._push(now + m.step_every_s, i, "step")
            if m.exit_at_s is not None:
                self._push(now + m.exit_at_s, i, "exit")
            if m.lost_at_s is not None:
                self._push(now + m.lost_at_s, i, "lost")
        return [Started(10_000 + i, False, "simulated") for i in range(len(self.hosts))]

    def preflight(self, states: list[HostState], options: HostOptions, requests: list[PreflightRequest],
                  timeout_s: float) -> list[PreflightReport]:
        return [PreflightReport(s.process_index, {}, str(s.slot.worker_id), str(s.slot.worker_id), s.slot.slice_name)
                for s in states]

    def events(self, timeout_s: float) -> list[Event]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                due = self._heap[0][0] if self._heap else None
            now = time.monotonic()
            if due is not None and due <= now:
                return self._collect(now)
            wake = deadline if due is None else min(deadline, due)
            if wake <= now:
                return []
            time.sleep(wake - now)

    def stop(self, hosts: Iterable[int], grace_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            for i in hosts:
                h = self.hosts[i]
                if h.told_to_stop is None and not h.ended:
                    h.told_to_stop = now
                    self._push_locked(now + self.stop_after_s, i, "stopped")

    def dump_stacks(self, hosts: Iterable[int], timeout_s: float) -> dict[int, str]:
        return {i: STACK for i in hosts}

    def release(self, prewarm: list[HostState] | None) -> None:
        pass

    # -- what the harness reads -----------------------------------------------------------------

    @property
    def lines_sent(self) -> int:
        return sum(h.sent for h in self.hosts)

    def stop_latency(self) -> float | None:
        """Seconds from the first failure to the last host told to stop (None: nothing failed)."""
        told = [h.told_to_stop for h in self.hosts if h.told_to_stop is not None]
        return (max(told) - self.failed_at) if told and self.failed_at is not None else None

    # -- inside ---------------------------------------------------------------------------------

    def _push(self, due: float, i: int, what: str) -> None:
        with self._lock:
            self._push_locked(due, i, what)

    def _push_locked(self, due: float, i: int, what: str) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), i, what))

    def _collect(self, now: float) -> list[Event]:
        """Everything due by `now`, as one reply per host that has news (or its loss)."""
        news: dict[int, int | None] = {}  # host -> exit code (None: still running)
        gone: list[Event] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                due, _, i, what = heapq.heappop(self._heap)
                h = self.hosts[i]
                if h.ended:
                    continue
                if what == "line":
                    h.sent += 1
                    first = not h.pending
                    h.pending.append(("stdout", f"step {h.sent} of host {i}: loss 0.{h.sent % 997:03d}"))
                    self._push_locked(due + (h.model.line_every_s or 1.0), i, "line")
                    if self.batch_s <= 0:
                        news.setdefault(i, None)
                    elif first:  # the reply goes once batch_s of lines are gathered (or the host ends)
                        self._push_locked(due + self.batch_s, i, "flush")
                elif what == "flush":
                    if h.pending:
                        news.setdefault(i, None)
                elif what == "step":
                    h.step = (h.step or 0) + 1
                    self._push_locked(due + (h.model.step_every_s or 1.0), i, "step")
                    news.setdefault(i, None)
                elif what in ("exit", "stopped"):
                    code = h.model.exit_code if what == "exit" else STOP_EXIT
                    h.ended = True
                    news[i] = code
                    if what == "exit" and code != 0 and self.failed_at is None:
                        self.failed_at = due
                elif what == "lost":
                    h.ended = True
                    if self.failed_at is None:
                        self.failed_at = due
                    if h.pending:  # what it printed before it went still reaches its log
                        news.setdefault(i, None)
                    gone.append(Gone(i, Cause.NODE_LOST, "node lost"))
        out: list[Event] = []
        for i, code in news.items():
            h = self.hosts[i]
            lines, h.pending = tuple(h.pending), []
            out.append(Reply(i, PollReply(lines=lines, code=code, wall_s=now - self.t0,
                                          ended=time.time() if code is not None else None, activity=time.time(),
                                          step=h.step)))
        self.replies += len(out)
        return out + gone
