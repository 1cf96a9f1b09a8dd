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
from dataclasses import replace

from tpulaunch import discover
from tpulaunch.cluster import emulated, reaper
from tpulaunch.cluster.connect import connect, disconnect, ray_output_to
from tpulaunch.cluster.ports import free_port
from tpulaunch.cluster.processes import stop_run_processes
from tpulaunch.cluster.record import ClusterInfo, driver_log_path, load_record, save_record
from tpulaunch.errors import LaunchError, TpulaunchError
from tpulaunch.host.agent import agent_for
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.run import elastic, policy, recreate
from tpulaunch.run.execute import Limits, Sink, execute
from tpulaunch.run.paths import RunPaths
from tpulaunch.run.timeline import Timeline
from tpulaunch.run.prepare import LaunchRequest, Prepared, Target, recorded_slices
from tpulaunch.run.status import RunState, RunView
from tpulaunch.run.summary import Attempt, Cause, Outcome, RunSummary, exit_code_for, first_failure, outcome_of


# A host whose process failed as its VM went away: how long after its exit its Ray node may take
# to be seen gone, for the loss to count as a preemption (`execute.lost_with_their_nodes`)
NODE_SETTLE_S = 5.0


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
        self._old: dict[int, object] = {}

    def __enter__(self) -> "Interrupts":
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
            signal.signal(sig, old)  # type: ignore[arg-type]


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
        from tpulaunch.discover import ray_labels

        from tpulaunch import providers

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
    plan, req = prep.plan, prep.request
    if req.recreate:  # refused before anything starts: no head to survive the slice, nothing to re-create
        recreate.check(prep.cluster, plan.local, req.max_preemptions)
    paths = RunPaths.of(plan.job.log_dir)
    umask = os.umask(0o077)  # a run's files (host logs can hold secrets) are this user's alone
    try:
        paths.root.mkdir(parents=True, exist_ok=True)
        return _launch(prep, sink, connection, paths, dashboard=dashboard, quiet_ray=quiet_ray, debug=debug)
    finally:
        os.umask(umask)


def _launch(prep: Prepared, sink: Sink, connection: Connection | None, paths: RunPaths, *, dashboard: bool,
            quiet_ray: bool, debug: bool) -> RunSummary:
    plan, req = prep.plan, prep.request
    conn = connection or Connection(Target(prep.cluster), prep.runtime_env)
    t0 = time.monotonic()
    timeline = Timeline(paths.events)
    timeline.emit("run_start", run_id=plan.run_id, hosts=len(plan.hosts), slices=[s.name for s in plan.slices],
                  emulated=plan.emulated)
    limits = Limits(
        schedule_timeout_s=req.schedule_timeout, preemption_grace_s=req.preemption_grace,
        deadline=t0 + req.timeout if req.timeout else None, stall_timeout_s=req.stall_timeout,
        kill_stale=req.kill_stale, debug=debug, keep_warm=prep.cluster is not None or req.keep_cluster,
        keep_children=req.keep_children, preflight=req.preflight, straggler_ratio=req.straggler_ratio,
        watch_preemption=not plan.emulated or "TPULAUNCH_METADATA_HOST" in plan.job.user_env,
        node_settle_s=NODE_SETTLE_S if req.max_preemptions else 0.0,
    )
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
                timeline.emit("cluster_start", how="start")
                early: list = []
                owned = cluster = emulated.start_emulated(
                    list(plan.slices), plan.topology, dashboard=dashboard, progress=sink.progress,
                    on_head=lambda c: _early(c, conn, plan, early))
                _wait(early, 60.0)  # every spare spawned before its host's start() can look for it
                phases["cluster_start_s"] = time.monotonic() - t
                timeline.emit("cluster_ready", how="start")
            else:
                t = time.monotonic()
                timeline.emit("cluster_start", how="connect")
                conn.connect(cluster)
                phases["connect_s"] = time.monotonic() - t
                timeline.emit("cluster_ready", how="connect")
            sigs.raise_now = False
            save_record(cluster, paths.cluster)
            with reaper.in_use(cluster.temp_dir):
                spent, note = _attempts(plan, req, sink, limits, sigs, cluster, attempts, timeline)
        except Interrupted as e:
            interrupted = e.signum
        finally:
            interrupted = interrupted or sigs.received  # a stop between attempts (waiting for a slice) too
            sigs.raise_now = False
            conn.close()
            if owned is not None and not (req.keep_cluster and interrupted is None and _keep(owned, req, sink)):
                sink.progress("stopping the emulated Ray cluster")
                emulated.stop_cluster(owned)
            if plan.local and not req.keep_children:
                stop_run_processes(plan.run_id)  # a host Ray could no longer reach (its node lost)
    summary = _summary(plan, attempts, spent, note, interrupted, time.monotonic() - t0, phases)
    timeline.emit("run_end", outcome=str(summary.outcome), exit_code=summary.exit_code)
    paths.summary.write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def _early(cluster: ClusterInfo, conn: Connection, plan: LaunchPlan, refs: list) -> None:
    """The head of a new emulated cluster is up: connect, and let each host's agent start its
    framework import as soon as its node joins, while the other nodes are still starting."""
    conn.connect(cluster)
    if not plan.job.command:
        refs.extend(agent_for(h.slice_name, h.worker_id).prewarm.remote(state) for h, state in zip(plan.hosts, plan.states()))


def _wait(refs: list, timeout_s: float) -> None:
    import ray

    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def _keep(cluster: ClusterInfo, req: LaunchRequest, sink: Sink) -> bool:
    """Leave the cluster this run started up for the next runs (`--keep-cluster`), if none is recorded."""
    rec = load_record()
    if rec is not None and (rec.running_here or rec.remote):
        sink.progress(f"not keeping the emulated cluster: another one is recorded as up ({rec.address})")
        return False
    cluster.kept, cluster.idle_timeout = True, req.idle_timeout
    save_record(cluster)
    assert cluster.temp_dir is not None and cluster.cluster_id is not None
    reaper.start(cluster.temp_dir, cluster.cluster_id, req.idle_timeout)
    sink.progress(f"kept the emulated cluster at {cluster.address} for the next runs (stops after"
                  f" {req.idle_timeout:g} s unused; `tpulaunch cluster down` stops it now)")
    return True


def _attempts(plan: LaunchPlan, req: LaunchRequest, sink: Sink, limits: Limits, sigs: Interrupts,
              cluster: ClusterInfo, attempts: list[Attempt], timeline: Timeline) -> tuple[policy.Spent, str | None]:
    """Run attempts until the policy finishes the run; returns what was spent and why it finished."""
    regrowths: list[elastic.Regrowth] = []  # lost slices coming back while the run trains on the others
    healings: list = []  # slices a spare replaced, coming back as spares (elastic.Regrowth, elastic.Background)
    if not cluster.slices:  # a cluster known by its address: its slices are the ones the run found there
        cluster.slices = list(plan.slices)
    try:
        return _attempt_loop(plan, req, sink, limits, sigs, cluster, attempts, timeline, regrowths, healings)
    finally:
        for r in [*regrowths, *healings]:
            r.cancel()


def _preempted_by_the_provider(a: Attempt, plan: LaunchPlan, cluster: ClusterInfo) -> None:
    """`--recreate`: a host whose process failed on a slice its provider says was preempted (the
    Cloud TPU API, the Kubernetes API) was preempted: its VM's or node's shutdown may end the script
    before its agent and raylet, so the loop heard an exit, not a loss. Asked once per such slice."""
    if a.outcome is not Outcome.FAILED:
        return
    known = {s.name for s in cluster.slices} or {h.slice_name for h in plan.hosts}
    names = sorted({plan.hosts[h.process_index].slice_name for h in a.hosts
                    if not (h.exit_code in (None, 0) or h.stopped_by_tpulaunch or h.lost or h.preempted)} & known)
    if not names:
        return
    verdicts = recreate.preempted_slices(cluster, names)
    for h in a.hosts:
        if h.exit_code in (None, 0) or h.stopped_by_tpulaunch or h.lost or h.preempted:
            continue
        name = plan.hosts[h.process_index].slice_name
        why = verdicts.get(name)
        if why:
            h.preempted, h.cause, h.reason = f"slice {name}: {why}", Cause.PREEMPTED, f"preempted ({why}), then {h.reason}"
    if any(verdicts.values()):
        a.first_failure = first_failure(a.hosts)
        a.outcome = outcome_of(a.first_failure)
        a.exit_code = exit_code_for(a.outcome, a.first_failure)


def _grow_when(regrowths: list[elastic.Regrowth]):  # noqa: ANN202 - the watch's grow callback, or None
    """Grow back once every lost slice is back (a slice that could not come back keeps the run small)."""
    if not regrowths:
        return None

    def ask(watch, now: float) -> str | None:  # noqa: ANN001
        if any(r.error for r in regrowths):
            return None
        whys = [r.should_grow(watch, now) for r in regrowths]
        return whys[-1] if all(whys) else None

    return ask


def _attempt_loop(plan: LaunchPlan, req: LaunchRequest, sink: Sink, limits: Limits, sigs: Interrupts,
                  cluster: ClusterInfo, attempts: list[Attempt], timeline: Timeline,
                  regrowths: list[elastic.Regrowth], healings: list) -> tuple[policy.Spent, str | None]:
    budgets = policy.Budgets(req.max_restarts, req.max_preemptions, req.kill_stale, req.min_slices or 0,
                             req.replace_hung)
    spent = policy.Spent()
    gcs = None if cluster.address.startswith("ray://") else cluster.address
    current = full = plan  # full: every slice the run asked for; current: the ones this attempt runs on
    while True:
        timeline.emit("attempt_start", attempt=current.attempt, slices=[s.name for s in current.slices],
                      reason=current.reason)
        a = execute(current, sink, replace(limits, grow=_grow_when(regrowths)), sigs, gcs_address=gcs,
                    timeline=timeline)
        if req.recreate:
            _preempted_by_the_provider(a, current, cluster)
        attempts.append(a)
        timeline.attempt_over(current.attempt)
        for h in a.hosts:  # each host's end: the last steps of a failed attempt are seen here only
            timeline.emit("host_end", h.ended_at or h.last_seen or time.time(), attempt=current.attempt,
                          host=h.process_index, step=h.step, exit_code=h.exit_code, failed=h.failed)
        first = a.first_failure
        timeline.emit("attempt_end", attempt=current.attempt, outcome=str(a.outcome), exit_code=a.exit_code,
                      host=first.process_index if first else None, why=a.who)
        hit = {current.hosts[h.process_index].slice_name for h in a.hosts if h.lost or h.preempted}
        decision = policy.decide(a, budgets, spent, whole_slices=len(current.slices) - len(hit))
        first = a.first_failure
        who = f"host {first.process_index} {first.reason}" if first else "the attempt"
        if decision.action is policy.Action.FINISH:
            return spent, decision.why
        if decision.action in (policy.Action.SHRINK, policy.Action.GROW):
            spent = decision.spent
            if decision.action is policy.Action.GROW:  # slices preempted again while they were brought back
                spent = replace(spent, preemptions=spent.preemptions + sum(r.again for r in regrowths))
            if sigs.received is not None:
                return spent, None
            current, full = _resize(decision.action, a, current, full, sorted(hit), regrowths, req, sink, cluster,
                                    timeline, spent)
            continue
        if decision.action is policy.Action.REPLACE:
            spent = decision.spent
            sink.status(RunView(plan.run_id, RunState.RESTARTING, a.index, tuple(), attempts_brief(attempts),
                                note=a.hang.line if a.hang else None))
            if sigs.received is not None:
                return spent, None
            sigs.raise_now = True  # no host runs while the slices are replaced: a stop ends it at once
            try:
                current, full, why = _replace_hung(a, current, full, req, sink, cluster, timeline, sigs, healings)
            finally:
                sigs.raise_now = False
            if why is not None:
                return spent, why
            continue
        sink.status(RunView(plan.run_id, RunState.RESTARTING, a.index, tuple(), attempts_brief(attempts),
                            note=f"attempt {a.index}: {a.outcome}: {who}"))
        spent = decision.spent
        if sigs.received is not None:
            return spent, None
        if decision.action is policy.Action.WAIT_FOR_SLICE and current is full:
            swapped = _swap_in_spares(sorted(hit), a, current, cluster, req, sink, timeline, healings,
                                      "a preemption or a lost host")
            if swapped is not None:  # a spare took each lost slice's place: no wait for them at all
                _lost_to_preemption(a, sorted(hit), cluster)
                current = full = swapped.for_attempt(current.attempt + 1, _fresh_endpoints(swapped), "preemption")
                continue
        if decision.action is policy.Action.WAIT_FOR_SLICE:
            if current is not full:  # too few slices left to go on: wait for the whole run's again
                for r in regrowths:
                    r.cancel()
                regrowths.clear()
                hit |= {s.name for s in full.slices} - {s.name for s in current.slices}
                current = full.for_attempt(current.attempt, full.endpoints, current.reason)
            sigs.raise_now = True  # no host runs while the slice is awaited: a stop ends the wait at once
            try:
                t0 = time.monotonic()
                if req.recreate:
                    lost = sorted(hit)
                    timeline.emit("recreate_start", slices=lost)
                    back = recreate.Comeback(cluster, lost, sink.progress,
                                             budget=req.max_preemptions - spent.preemptions)
                    failed: TpulaunchError | None = None
                    try:
                        slices = back.run(req.preemption_wait)
                    except TpulaunchError as e:
                        failed = e
                    spent = replace(spent, preemptions=spent.preemptions + back.again)  # preempted again meanwhile
                    recs = back.made
                    a.recreated = list(recs)
                    timeline.emit("recreate_end", slices=lost, ok=failed is None)
                    if failed is not None:
                        return spent, (f"the slice was not made again within --preemption-wait"
                                       f" {req.preemption_wait:g} s: {failed.line()}")
                    if recs:  # the Cloud TPU API's word: these hosts were not just lost, their slice was preempted
                        a.outcome = Outcome.PREEMPTED
                        a.note = "; ".join(dict.fromkeys(f"slice {r.slice} preempted ({r.why})" for r in recs))
                        current = current.on_slices(recreate.in_run_order(current.slices, slices))
                left = max(1.0, req.preemption_wait - (time.monotonic() - t0))
                sink.progress(f"{who}: waiting up to {left:.0f} s for the slice to be whole again in Ray"
                              f" (preemption {spent.preemptions} of {req.max_preemptions})")
                t1 = time.monotonic()
                if not _wait_for_slice(current, cluster, left, sigs, sink):
                    return spent, f"the slice was not whole again within --preemption-wait {req.preemption_wait:g} s"
                for r in a.recreated:
                    r.steps["ray_whole_s"] = time.monotonic() - t1
                current = _where_ray_has_them(current)
            finally:
                sigs.raise_now = False
        else:
            sink.progress(f"{who}: restarting the whole slice (restart {spent.restarts} of {req.max_restarts})")
        if sigs.received is not None:
            return spent, None
        reason = "preemption" if decision.action is policy.Action.WAIT_FOR_SLICE else "restart"
        current = current.for_attempt(current.attempt + 1, _fresh_endpoints(current), reason)
        if current.mesh.num_slices == full.mesh.num_slices:
            full = current


def _swap_in_spares(lost: list[str], a: Attempt, current: LaunchPlan, cluster: ClusterInfo, req: LaunchRequest,
                    sink: Sink, timeline: Timeline, healings: list | None, why: str) -> LaunchPlan | None:
    """A spare of the run's shape, whole and free in Ray, for each slice in `lost`: the plan with them
    in the lost ones' places (same slice ids; process indices, `MEGASCALE_*` and the mesh made afresh
    for that fleet), the record saying the lost ones are the spares now, and the lost ones brought
    back in the background (as spares). None when there are not spares enough (the run waits instead)."""
    from tpulaunch import providers
    from tpulaunch.discover import ray_labels

    provider = providers.of(cluster)
    spares = provider.spares()
    if not spares:
        return None
    t0 = time.monotonic()
    topo = current.topology
    now = {s.name: s for s in ray_labels.read_slices()}
    ready = [n for n in spares if n in now and now[n].intact(topo.num_hosts) and not now[n].busy
             and _same_shape(now[n], topo)]
    if len(ready) < len(lost):
        sink.progress(f"{len(ready)} spare(s) of {topo.accelerator_type} ({topo.topology}) whole and free, {len(lost)}"
                      " needed: waiting for the lost slice(s) instead")
        return None
    swaps = {name: now[spare].to_spec() for name, spare in zip(lost, ready)}
    for name, spare in zip(lost, ready):
        provider.swap(name, spare)
    plan = current.swapped(swaps)
    took = time.monotonic() - t0
    a.replaced = [{"slice": name, "how": f"spare {spec.name}", "spare": spec.name, "why": why, "seconds": round(took, 3)}
                  for name, spec in swaps.items()]
    timeline.emit("swap", slices=list(swaps), spares=[s.name for s in swaps.values()])
    sink.progress("; ".join(f"spare {spec.name} takes {name}'s place" for name, spec in swaps.items())
                  + f" ({took:.2f} s): {name if len(lost) == 1 else 'they'} come(s) back as spare(s) in the background")
    if healings is not None:
        healings.append(elastic.Regrowth(cluster, current, list(swaps), recreate=req.recreate, wait_s=req.preemption_wait,
                                         grow_after=None, say=sink.progress, budget=0, spare=True))
    return plan


def _lost_to_preemption(a: Attempt, lost: list[str], cluster: ClusterInfo) -> None:
    """A spare took the lost slices' places: the provider's word (once) on whether they were preempted,
    which the recreate path hears as it makes them again, and a spare's swap does not wait for."""
    if a.outcome is not Outcome.LOST:
        return
    verdicts = {n: why for n, why in recreate.preempted_slices(cluster, lost).items() if why}
    if verdicts:
        a.outcome = Outcome.PREEMPTED
        a.note = "; ".join(f"slice {n} preempted ({why})" for n, why in verdicts.items())


def _same_shape(s, topo) -> bool:  # noqa: ANN001 - a ray_labels.RaySlice, the run's Topology
    """A spare is used only when it is the run's shape: a spare of another shape never is."""
    from tpulaunch.plan import topology as topo_mod

    try:
        t = topo_mod.resolve(topology=s.topology or None, accelerator=s.pod_type)
    except TpulaunchError:
        return False
    return (t.generation.name, t.topology, t.num_hosts) == (topo.generation.name, topo.topology, topo.num_hosts)


def _replace_hung(a: Attempt, current: LaunchPlan, full: LaunchPlan, req: LaunchRequest, sink: Sink,
                  cluster: ClusterInfo, timeline: Timeline, sigs: Interrupts,
                  healings: list) -> tuple[LaunchPlan, LaunchPlan, str | None]:
    """`--replace-hung`: the hang's culprit slices are made again by the cluster's provider (or, where
    it cannot, dropped under --min-slices), then the whole run restarts from its checkpoint. Returns
    (the next plan, the full one, why the run ends instead or None)."""
    from tpulaunch import providers
    from tpulaunch.host import frameworks

    assert a.hang is not None
    names = [current.slices[k].name for k in a.hang.slices]
    provider = providers.of(cluster)
    if current is full:
        swapped = _swap_in_spares(names, a, current, cluster, req, sink, timeline, None, a.hang.line)
        if swapped is not None:  # a spare took each hung slice's place; the hung ones are made again as spares
            if provider.replace_refusal() is None:
                healings.append(elastic.Background(
                    f"slice(s) {', '.join(names)} made again as spares",
                    lambda: provider.replace(names, a.hang.line, req.preemption_wait, sink.progress), sink.progress))
            nxt = swapped.for_attempt(current.attempt + 1, _fresh_endpoints(swapped), "restart")
            return nxt, nxt, None
    t0 = time.monotonic()
    timeline.emit("replace_start", slices=names, why=a.hang.line)
    if provider.replace_refusal() is None:
        try:
            recs, slices = provider.replace(names, a.hang.line, req.preemption_wait, sink.progress)
        except TpulaunchError as e:
            timeline.emit("replace_end", slices=names, ok=False)
            return current, full, f"the hung slice(s) {', '.join(names)} could not be replaced: {e.line()}"
        current = current.on_slices(recreate.in_run_order(current.slices, slices))
        left = max(1.0, req.preemption_wait - (time.monotonic() - t0))
        if not _wait_for_slice(current, cluster, left, sigs, sink):
            timeline.emit("replace_end", slices=names, ok=False)
            return current, full, f"the replaced slice(s) were not whole in Ray within --preemption-wait {req.preemption_wait:g} s"
        current = _where_ray_has_them(current)
        took = time.monotonic() - t0
        a.replaced = [{"slice": r.slice, "how": "made again", "why": a.hang.line, "seconds": round(took, 2),
                       **({"replica": r.replica} if r.replica else {})} for r in recs]
        timeline.emit("replace_end", slices=names, ok=True)
        sink.progress(f"replaced {', '.join(names)} after the hang ({took:.1f} s): restarting the whole run from its"
                      " checkpoint")
        nxt = current.for_attempt(current.attempt + 1, _fresh_endpoints(current), "restart")
        return nxt, nxt if nxt.mesh.num_slices == full.mesh.num_slices else full, None
    keep = [s.name for s in current.slices if s.name not in names]
    if req.min_slices and len(keep) >= req.min_slices:  # dropped: the run goes on without them
        a.replaced = [{"slice": n, "how": "dropped", "why": a.hang.line, "seconds": 0.0} for n in names]
        timeline.emit("replace_end", slices=names, ok=True)
        sink.progress(f"dropping {', '.join(names)} after the hang: going on on {', '.join(keep)}")
        small = current.on_fleet(keep, frameworks.get(current.framework).emulation_env(current.topology, len(keep)))
        nxt = small.for_attempt(current.attempt + 1, _fresh_endpoints(small), "shrink")
        return nxt, nxt, None
    timeline.emit("replace_end", slices=names, ok=False)
    return current, full, f"the hung slice(s) {', '.join(names)} cannot be replaced: {provider.replace_refusal()}"


def _resize(action: policy.Action, a: Attempt, current: LaunchPlan, full: LaunchPlan, hit: list[str],
            regrowths: list[elastic.Regrowth], req: LaunchRequest, sink: Sink, cluster: ClusterInfo,
            timeline: Timeline, spent: policy.Spent) -> tuple[LaunchPlan, LaunchPlan]:
    """The next attempt of an elastic run: on the slices left whole (shrink; the lost ones start
    coming back), or on every slice of the run again (grow). Returns (the next plan, the full one)."""
    from tpulaunch.host import frameworks

    n = full.mesh.num_slices
    if action is policy.Action.SHRINK:
        keep = [s.name for s in current.slices if s.name not in hit]
        regrowths.append(elastic.Regrowth(cluster, full, hit, recreate=req.recreate, wait_s=req.preemption_wait,
                                          grow_after=req.grow_after, say=sink.progress,
                                          budget=req.max_preemptions - spent.preemptions))
        sink.progress(f"{a.who}: going on at once on {len(keep)} of {n} slices ({', '.join(keep)}) while"
                      f" {', '.join(hit)} come(s) back (preemption {spent.preemptions} of {req.max_preemptions})")
        timeline.emit("shrink", attempt=current.attempt + 1, slices=keep, lost=hit)
        small = full.on_fleet(keep, frameworks.get(full.framework).emulation_env(full.topology, len(keep)))
        return small.for_attempt(current.attempt + 1, _fresh_endpoints(small), "shrink"), full
    back = [s for r in regrowths for s in r.lost]
    a.recreated = [rec for r in regrowths for rec in r.recreated]
    specs = next((r.slices for r in reversed(regrowths) if r.slices), None)
    regrowths.clear()
    if specs:  # re-created slices have new VMs and addresses
        full = full.on_slices(recreate.in_run_order(full.slices, specs))
    full = _where_ray_has_them(full)
    sink.progress(f"growing back to all {n} slices ({', '.join(back)} returned)")
    timeline.emit("grow", attempt=current.attempt + 1, slices=[s.name for s in full.slices], back=back)
    full = full.for_attempt(current.attempt + 1, _fresh_endpoints(full), "grow")
    return full, full


def _where_ray_has_them(plan: LaunchPlan) -> LaunchPlan:
    """A plan of slices found through Ray's labels, at the addresses Ray has their hosts at now: a
    slice that came back (a KubeRay replica made again, a VM rejoined) has new ones. Others as they are."""
    if plan.local or not plan.slices or plan.slices[0].source != "ray":
        return plan
    from tpulaunch.discover import ray_labels

    now = [s.to_spec() for s in ray_labels.read_slices()]
    fresh = [s for s in now if s.name in {p.name for p in plan.slices}]
    if len(fresh) != len(plan.slices) or any(len(s.workers) != plan.topology.num_hosts for s in fresh):
        return plan  # not whole in Ray after all: the next attempt's own wait says so
    return plan.on_slices(recreate.in_run_order(plan.slices, fresh))


def attempts_brief(attempts: list[Attempt]) -> tuple[dict, ...]:
    """Each attempt in a line's worth of data (status shows the history)."""
    out = []
    for a in attempts:
        out.append({"index": a.index, "outcome": str(a.outcome), "exit_code": a.exit_code, "who": a.who,
                    "log_dir": a.log_dir, "reason": a.reason, "slices": list(a.slices),
                    **({"recreated": [r.to_dict() for r in a.recreated]} if a.recreated else {}),
                    **({"hang": a.hang.to_dict()} if a.hang is not None else {}),
                    **({"replaced": list(a.replaced)} if a.replaced else {})})
    return tuple(out)


def _fresh_endpoints(plan: LaunchPlan):  # noqa: ANN202 - Endpoints
    """A new process group per attempt; on one machine also new ports (the old ones may linger)."""
    if not plan.local:
        return plan.endpoints
    return plan.endpoints.moved(master_port=free_port(), group_port=free_port(), jax_port=free_port(),
                                emulation_port=free_port(), exit_port=free_port())


def _wait_for_slice(plan: LaunchPlan, cluster: ClusterInfo, wait_s: float, sigs: Interrupts, sink: Sink) -> bool:
    """Until every host of the plan's slices is alive and free in Ray (or `wait_s` passes, or a stop)."""
    return elastic.wait_whole(cluster, plan.topology, [s.name for s in plan.slices], wait_s,
                              lambda: sigs.received is not None, sink.progress)


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
