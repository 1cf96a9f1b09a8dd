"""Elastic multislice (`--min-slices K`): train on the slices that survive, grow back when the lost ones return.

When a slice is lost (preempted, its node gone) and at least K slices are left whole, the next
attempt starts at once on those (`LaunchPlan.on_fleet`: the plan computed afresh for the smaller
fleet, the DCN axis of the mesh shrunk). Meanwhile `Regrowth` brings the lost slices back in a
thread of its own: through the Cloud TPU API (`--recreate`), by starting lost emulated hosts
again, or by waiting for them in Ray. Once every host of them is alive and free in Ray, the
running attempt is ended to grow back: at the first checkpoint a host reports after that
(`tpulaunch.heartbeat(step=N, checkpoint=True)`), or `--grow-after S` seconds after, whichever the
run asked for. Growing is a planned restart: it counts against no budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.errors import LaunchError, TpulaunchError
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.plan.mesh import elastic_axis
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.plan.topology import Topology
from tpulaunch.run.recovery.recreate import Comeback
from tpulaunch.run.summary import Recreation

if TYPE_CHECKING:
    from tpulaunch.run.watch import AttemptWatch


def check(plan: LaunchPlan, min_slices: int) -> None:
    """`--min-slices` on a plan: at most its slices, and the slices on one axis that can shrink."""
    n = plan.mesh.num_slices
    if not 1 <= min_slices <= n:
        raise LaunchError(f"--min-slices {min_slices} is not between 1 and the run's {n} slice(s)",
                          "give at most --num-slices; with --min-slices equal to it the run never shrinks")
    if n > 1 and min_slices < n and elastic_axis(plan.mesh) is None:
        raise LaunchError("--min-slices needs the slices on one mesh axis to shrink",
                          f"name that axis with --dcn, e.g. --dcn data={n}")


def whole(slices: list[str], hosts_per_slice: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(hosts of these slices not alive in Ray, hosts alive but busy), by (slice, worker id)."""
    from tpulaunch.discover import ray_labels

    want = {(s, w) for s in slices for w in range(hosts_per_slice)}
    have = {(s.name, w): (alive, busy) for s in ray_labels.read_slices() for w, _ip, alive, busy in s.workers}
    missing = sorted(k for k in want if not have.get(k, (False, False))[0])
    busy = sorted(k for k in want if k not in missing and have[k][1])
    return missing, busy


def wait_whole(cluster: ClusterInfo, topology: Topology, slices: list[str], wait_s: float,
               stopped: Callable[[], bool], say: Callable[[str], None],
               poll: Callable[[float], object] = time.sleep) -> bool:
    """Until every host of these slices is alive and free in Ray: True; False when `wait_s` passes
    or `stopped()`. On an emulated cluster on this machine a lost host is started again, as a
    repaired TPU VM rejoins a real slice; on a real cluster something else must bring it back
    (`--recreate`, `tpulaunch cluster up --tpu` again, a queued resource, an autoscaler)."""
    deadline = time.monotonic() + wait_s
    restarted = False
    while not stopped():
        missing, busy = whole(slices, topology.num_hosts)
        if not missing and not busy:
            return True
        if missing and not restarted and cluster.emulated and cluster.running_here:
            from tpulaunch.cluster import emulated

            say("starting the lost emulated host(s) again: " + ", ".join(f"{s} worker {w}" for s, w in missing))
            emulated.restart_hosts(cluster, topology, missing)
            restarted = True
            continue
        if time.monotonic() >= deadline:
            return False
        poll(0.5)
    return False


def failure_line(e: Exception) -> str:
    """A background thread's failure in one line: tpulaunch's own line, or the exception's type and text."""
    return e.line() if isinstance(e, TpulaunchError) else f"{type(e).__name__}: {e}"


class Regrowth:
    """The lost slices coming back while the run trains on the others (a thread of its own).

    `ready_at` (time.monotonic()) is set once every host of them is alive and free in Ray;
    `error` says why they did not come back within `wait_s`. `slices` are the cluster's slice
    specs after a re-creation (new addresses), for the grown plan."""

    def __init__(self, cluster: ClusterInfo, plan: LaunchPlan, lost: list[str], *, recreate: bool, wait_s: float,
                 grow_after: float | None, say: Callable[[str], None], budget: int = 0, spare: bool = False) -> None:
        self.cluster, self.lost, self.recreate, self.wait_s = cluster, lost, recreate, wait_s
        self.grow_after, self.say = grow_after, say
        self.spare = spare  # they come back as spares (a spare took their place): the run does not grow
        self.topology = plan.topology
        self.ready_at: float | None = None
        self.error: str | None = None
        self.slices: list[SliceSpec] | None = None
        self._stop = threading.Event()
        # budget: the preemptions left; a slice preempted again while it is made again spends one
        self._comeback = Comeback(cluster, lost, say, budget=budget, stopped=self._stop.is_set, pause=self._stop.wait)
        self._thread = threading.Thread(target=self._run, name="tpulaunch-regrowth", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._stop.set()

    @property
    def again(self) -> int:
        """Preemptions spent: the slices were preempted again while they came back."""
        return self._comeback.again

    @property
    def recreated(self) -> list[Recreation]:
        """The slices made again (`--recreate`), each with its steps timed."""
        return list(self._comeback.made)

    def _run(self) -> None:
        end = time.monotonic() + self.wait_s
        try:
            if self.recreate:
                self.slices = self._comeback.run(end - time.monotonic())
            if wait_whole(self.cluster, self.topology, self.lost, end - time.monotonic(), self._stop.is_set,
                          self.say, poll=self._stop.wait):
                self.ready_at = time.monotonic()
                if self.spare and not self._stop.is_set():  # the run is over: its Ray connection closes
                    from tpulaunch.host.agent import warm_agents

                    warm_agents([(name, w) for name in self.lost for w in range(self.topology.num_hosts)])
                    self.say(f"slice(s) {', '.join(self.lost)} back in Ray: spare(s) now")
                else:
                    self.say(f"slice(s) {', '.join(self.lost)} back in Ray: the run grows back to them"
                             + (f" {self.grow_after:g} s from now" if self.grow_after is not None
                                else " at its next checkpoint"))
            elif not self._stop.is_set():
                self.error = f"slice(s) {', '.join(self.lost)} not back within --preemption-wait {self.wait_s:g} s"
                self.say(self.error + ": the run goes on without them")
        except Exception as e:  # a thread's failure must not pass unseen
            self.error = failure_line(e)
            self.say(f"slice(s) {', '.join(self.lost)} not brought back: {self.error}; the run goes on without them")

    def healing(self) -> set[str]:
        """The slices still coming back (none once they are back, or will not be)."""
        return set() if self.ready_at is not None or self.error is not None or self._stop.is_set() else set(self.lost)

    def should_grow(self, watch: AttemptWatch, now: float) -> str | None:
        """Asked by the running attempt's watch: a reason to end it and grow back, or None."""
        if self.ready_at is None:
            return None
        back = f"slice(s) {', '.join(self.lost)} are back"
        if self.grow_after is not None:
            due = now >= self.ready_at + self.grow_after
            return f"{back}: growing back ({self.grow_after:g} s after)" if due else None
        step = watch.saved_since(self.ready_at)
        return f"{back}: growing back after the checkpoint of step {step}" if step is not None else None


class Background:
    """Work on the cluster that goes on while the run does (a hung slice made again as a spare): a
    thread of its own; its failure is said, never raised into the run."""

    def __init__(self, what: str, fn: Callable[[], object], say: Callable[[str], None],
                 slices: Iterable[str] = ()) -> None:
        self.what, self.say, self.slices = what, say, tuple(slices)
        self.error: str | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name="tpulaunch-background", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
            self.say(f"{self.what}: done")
        except Exception as e:  # a thread's failure must not pass unseen
            self.error = failure_line(e)
            self.say(f"{self.what}: not done: {self.error}")
        finally:
            self.done.set()

    def healing(self) -> set[str]:
        """The slices it is making again, until it is done."""
        return set() if self.done.is_set() else set(self.slices)

    def cancel(self) -> None:
        """Nothing to stop midway (a re-creation asked for goes on); the run only stops waiting for it."""
