"""One launch from start to end: get a Ray cluster (start an emulated one if none was given),
run attempts of the whole slice as `run.policy` decides, clean up whatever this launch started,
and write `summary.json`.

`Connection` is the launch's one connection to an existing cluster: it reads the slices a real
cluster holds (for `prepare`) and the run reuses it. SIGINT/SIGTERM at any moment (cluster
start, ray.init, the run) stop everything this launch started and end it with 130/143 within
seconds.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

from tpulaunch import discover
from tpulaunch.cluster import emulated, reaper
from tpulaunch.cluster.connect import connect, disconnect, ray_output_to
from tpulaunch.cluster.processes import stop_run_processes
from tpulaunch.cluster.record import ClusterInfo, driver_log_path, load_record, save_record
from tpulaunch.errors import LaunchError
from tpulaunch.host.agent import agent_for
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.run import policy
from tpulaunch.run.context import RunContext
from tpulaunch.run.execute import Sink
from tpulaunch.run.loop import run_attempts
from tpulaunch.run.paths import RunPaths
from tpulaunch.run.prepare import LaunchRequest, Prepared, Target, recorded_slices
from tpulaunch.run.record.events import Event
from tpulaunch.run.record.timeline import Timeline
from tpulaunch.run.summary import Attempt, Outcome, RunSummary, exit_code_for
from tpulaunch.run.supervision import Lifecycle

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tpulaunch.host.agent import HostAgent


class Interrupted(BaseException):
    """A SIGINT/SIGTERM while something blocking ran (cluster start, connect)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Interrupts:
    """SIGINT/SIGTERM for the whole launch: raised at once while starting, then a flag the
    supervision loop checks (so every host is stopped and drained before the run ends)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.raise_now = True
        self._old: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # what signal.signal returns

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        first = self.received is None
        self.received = self.received or signum
        if self.raise_now and first:
            raise Interrupted(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Connection:
    """The launch's connection to the cluster it runs on: opened at most once, closed at the end."""

    def __init__(self, target: Target, runtime_env: dict | None = None) -> None:
        self.target = target
        self.runtime_env = runtime_env
        self.open = False

    def cluster_slices(self, req: LaunchRequest) -> discover.ClusterSlices | None:
        """What the cluster holds, for `prepare`: an emulated cluster's record, or (a real cluster)
        the slices its nodes' TPU labels describe, read over this connection."""
        cluster = self.target.cluster
        if cluster is None:
            return None
        if cluster.emulated:
            return recorded_slices(cluster)
        if req.slices.queued_resource:
            return discover.ClusterSlices(False)  # its slices come from the Cloud TPU API
        from tpulaunch import providers
        from tpulaunch.discover import ray_labels

        with ray_output_to(driver_log_path(), True):
            self.connect(cluster)
            found = ray_labels.read_slices()
        return discover.ClusterSlices(False, ray_slices=tuple(found), spares=tuple(providers.of(cluster).spares()))

    def connect(self, cluster: ClusterInfo) -> None:
        if not self.open:
            connect(cluster, self.runtime_env)
            self.open = True

    def close(self) -> None:
        if self.open:
            disconnect()
            self.open = False


def launch(prep: Prepared, sink: Sink, connection: Connection | None = None, *, dashboard: bool = False,
           quiet_ray: bool = False, debug: bool = False) -> RunSummary:
    """Get a cluster, run the attempts, clean up; returns (and writes) the run's summary."""
    paths = RunPaths.of(prep.plan.job.log_dir)
    umask = os.umask(0o077)  # a run's files (host logs can hold secrets) are this user's alone
    try:
        paths.root.mkdir(parents=True, exist_ok=True)
        return _launch(prep, sink, connection, paths, dashboard=dashboard, quiet_ray=quiet_ray, debug=debug)
    finally:
        os.umask(umask)


def _launch(prep: Prepared, sink: Sink, connection: Connection | None, paths: RunPaths, *, dashboard: bool,
            quiet_ray: bool, debug: bool) -> RunSummary:
    plan, sup = prep.plan, prep.supervision
    conn = connection or Connection(Target(prep.cluster), prep.runtime_env)
    t0 = time.monotonic()
    timeline = Timeline(paths.events)
    timeline.emit(Event.RUN_START, run_id=plan.run_id, hosts=len(plan.hosts), slices=[s.name for s in plan.slices],
                  emulated=plan.emulated)
    limits = sup.limits(emulated=plan.emulated, watch_metadata="TPULAUNCH_METADATA_HOST" in plan.job.user_env,
                        keep_warm=prep.cluster is not None or sup.lifecycle.keep_cluster, debug=debug, started=t0)
    attempts: list[Attempt] = []
    phases: dict[str, float] = {}  # launch-level timings (the attempts add theirs)
    spent = policy.Spent()
    note: str | None = None
    owned: ClusterInfo | None = None
    interrupted: int | None = None
    with Interrupts() as sigs, ray_output_to(paths.ray_log, quiet_ray):
        try:
            cluster = prep.cluster
            if cluster is None:
                if not plan.local:
                    raise LaunchError(
                        "this slice is real but no Ray cluster was given",
                        "bring Ray up on it with `tpulaunch cluster up --tpu NAME` and pass --address auto",
                    )
                sink.progress(
                    f"starting an emulated Ray cluster: {len(plan.hosts)} host node(s) for "
                    f"{plan.mesh.num_slices} x {plan.topology.accelerator_type} ({plan.topology.topology})"
                )
                t = time.monotonic()
                timeline.emit(Event.CLUSTER_START, how="start")
                early: list = []
                owned = cluster = emulated.start_emulated(
                    list(plan.slices), plan.topology, dashboard=dashboard, progress=sink.progress,
                    on_head=lambda c: _early(c, conn, plan, early))
                _wait(early, 60.0)  # every spare spawned before its host's start() can look for it
                phases["cluster_start_s"] = time.monotonic() - t
                timeline.emit(Event.CLUSTER_READY, how="start")
            else:
                t = time.monotonic()
                timeline.emit(Event.CLUSTER_START, how="connect")
                conn.connect(cluster)
                phases["connect_s"] = time.monotonic() - t
                timeline.emit(Event.CLUSTER_READY, how="connect")
            sigs.raise_now = False
            save_record(cluster, paths.cluster)
            if not cluster.slices:  # a cluster known by its address: its slices are the ones the run found there
                cluster.slices = list(plan.slices)
            ctx = RunContext(sup, sink, limits, sigs, cluster, timeline, attempts)
            with reaper.in_use(cluster.temp_dir):
                try:
                    spent, note = run_attempts(plan, ctx)
                finally:
                    ctx.cancel_background()
        except Interrupted as e:
            interrupted = e.signum
        finally:
            interrupted = interrupted or sigs.received  # a stop between attempts (waiting for a slice) too
            sigs.raise_now = False
            conn.close()
            life = sup.lifecycle
            if owned is not None and not (life.keep_cluster and interrupted is None and _keep(owned, life, sink)):
                sink.progress("stopping the emulated Ray cluster")
                emulated.stop_cluster(owned)
            if plan.local and not life.keep_children:
                stop_run_processes(plan.run_id)  # a host Ray could no longer reach (its node lost)
    summary = _summary(plan, attempts, spent, note, interrupted, time.monotonic() - t0, phases)
    timeline.emit(Event.RUN_END, outcome=str(summary.outcome), exit_code=summary.exit_code)
    paths.summary.write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def _early(cluster: ClusterInfo, conn: Connection, plan: LaunchPlan, refs: list) -> None:
    """The head of a new emulated cluster is up: connect, and let each host's agent start its
    framework import as soon as its node joins, while the other nodes are still starting."""
    conn.connect(cluster)
    if not plan.job.command:
        refs.extend(cast("ActorHandle[HostAgent]", agent_for(h.slice_name, h.worker_id)).prewarm.remote(state)
                    for h, state in zip(plan.hosts, plan.states(), strict=True))


def _wait(refs: list, timeout_s: float) -> None:
    import ray

    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def _keep(cluster: ClusterInfo, life: Lifecycle, sink: Sink) -> bool:
    """Leave the cluster this run started up for the next runs (`--keep-cluster`), if none is recorded."""
    rec = load_record()
    if rec is not None and (rec.running_here or rec.remote):
        sink.progress(f"not keeping the emulated cluster: another one is recorded as up ({rec.address})")
        return False
    cluster.kept, cluster.idle_timeout = True, life.idle_timeout
    save_record(cluster)
    assert cluster.temp_dir is not None and cluster.cluster_id is not None
    reaper.start(cluster.temp_dir, cluster.cluster_id, life.idle_timeout)
    sink.progress(f"kept the emulated cluster at {cluster.address} for the next runs (stops after"
                  f" {life.idle_timeout:g} s unused; `tpulaunch cluster down` stops it now)")
    return True


def _summary(plan: LaunchPlan, attempts: list[Attempt], spent: policy.Spent, note: str | None,
             interrupted: int | None, wall_s: float, phases: dict[str, float]) -> RunSummary:
    last = attempts[-1] if attempts else None
    if last is None:
        outcome = Outcome.INTERRUPTED if interrupted else Outcome.FAILED
        code = exit_code_for(outcome, None, interrupted)
    else:
        outcome, code = last.outcome, last.exit_code
    if interrupted and outcome is not Outcome.INTERRUPTED:  # a stopped run is 143 (130) whatever it was doing
        outcome, code = Outcome.INTERRUPTED, exit_code_for(Outcome.INTERRUPTED, None, interrupted)
    signum = interrupted or (signal.Signals[last.signal].value if last and last.signal else None)
    return RunSummary(
        run_id=plan.run_id, exit_code=code, emulated=plan.emulated,
        slices=[s.to_dict() for s in plan.slices], mesh=plan.mesh.to_dict(devices=False),
        hosts=last.hosts if last else [], first_failure=last.first_failure if last else None,
        log_dir=plan.job.log_dir, wall_s=wall_s, timings={**phases, **(last.timings if last else {})},
        interrupted=signal.Signals(signum).name if outcome is Outcome.INTERRUPTED and signum else None,
        outcome=outcome, attempts=attempts, restarts=spent.restarts, preemptions=spent.preemptions,
        note=(last.note if last and last.note else note),
    )
