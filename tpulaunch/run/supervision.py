"""How a run is supervised: the request's budgets, limits, recovery and lifecycle, typed and checked
once by `prepare` (which makes it from the request), beside the plan. Nothing after `prepare` reads
the request or the CLI's strings.

* `Budgets` (`run.policy`): how many restarts and preemptions the run may survive, and how;
* `Recovery`: how a lost slice comes back (`--recreate`, the waits, an elastic run's growing back);
* `Watching`: what the watch of an attempt enforces (timeouts, stalls, stragglers, preflight);
* `Lifecycle`: what outlives the run (a cluster it started, what its scripts started).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpulaunch.run.policy import Budgets

if TYPE_CHECKING:
    from tpulaunch.cluster.record import ClusterInfo
    from tpulaunch.run.execute import Limits

# A host whose process failed as its VM went away: how long after its exit its Ray node may take
# to be seen gone, for the loss to count as a preemption (`execute.lost_with_their_nodes`)
NODE_SETTLE_S = 5.0


@dataclass(frozen=True)
class Recovery:
    recreate: bool = False  # a preempted slice is made again by its provider (`run.recovery.recreate`)
    preemption_wait: float = 600.0  # how long to wait for a lost slice to be whole again
    preemption_grace: float = 30.0  # a preempted script's time between SIGTERM and SIGKILL
    # elastic: grow back this long after the lost slices are back (None: at a checkpoint)
    grow_after: float | None = None


@dataclass(frozen=True)
class Watching:
    schedule_timeout: float = 120.0  # Ray must give the whole slice within this
    timeout: float | None = None  # wall clock for the whole run
    stall_timeout: float | None = None  # no output or heartbeat from any host for this long
    straggler_ratio: float = 0.7  # name a host whose step rate is below this x the median (0: never)
    preflight: bool = True  # check every host before any script starts (`run.preflight`)


@dataclass(frozen=True)
class Lifecycle:
    keep_cluster: bool = False  # leave an emulated cluster this run starts up for the next runs
    idle_timeout: float = 1800.0  # ... and stop it after this long unused
    keep_children: bool = False  # leave what a host's script started running after it exits


@dataclass(frozen=True)
class Supervision:
    budgets: Budgets = field(default_factory=Budgets)
    recovery: Recovery = field(default_factory=Recovery)
    watching: Watching = field(default_factory=Watching)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    def check(self, cluster: ClusterInfo | None, local: bool) -> None:
        """Refuse (one line) recovery that could never work on this cluster, before anything starts:
        `--recreate` and `--replace-hung` (the CLI, the Python client and a supervisor alike)."""
        from tpulaunch.run.recovery import recreate

        if self.recovery.recreate:
            recreate.check(cluster, local, self.budgets.max_preemptions)
        if self.budgets.replace_hung:
            recreate.check_replace(cluster, local, self.budgets.max_restarts, self.budgets.min_slices or None)

    def limits(self, *, emulated: bool, watch_metadata: bool, keep_warm: bool, debug: bool,
               started: float | None = None) -> Limits:
        """An attempt's limits (`execute.Limits`) for a run that started at `started` (monotonic)."""
        from tpulaunch.run.execute import Limits

        w = self.watching
        t0 = time.monotonic() if started is None else started
        return Limits(
            schedule_timeout_s=w.schedule_timeout, preemption_grace_s=self.recovery.preemption_grace,
            deadline=t0 + w.timeout if w.timeout else None, stall_timeout_s=w.stall_timeout,
            kill_stale=self.budgets.kill_stale, debug=debug, keep_warm=keep_warm,
            keep_children=self.lifecycle.keep_children, preflight=w.preflight, straggler_ratio=w.straggler_ratio,
            watch_preemption=not emulated or watch_metadata,
            node_settle_s=NODE_SETTLE_S if self.budgets.max_preemptions else 0.0,
        )
