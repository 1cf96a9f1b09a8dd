"""One launch from start to end: get a Ray cluster (start an emulated one if none was given),
run attempts of the whole slice within the restart and preemption budgets, clean up whatever this
launch started, and write `summary.json`.

A run is a sequence of attempts. After a failed attempt (a host exited non-zero) the whole slice
is relaunched (new process group, `TPULAUNCH_RESTART_COUNT` one more) while `--max-restarts`
allows; exits 2 (bad input), 86 (boot failure) and 87 (TPU busy, without --kill-stale) are never
retried: a rerun would fail the same way. After a lost or preempted host, `--max-preemptions`
allows a relaunch once the slice is whole again in Ray (an emulated host is started again), for
up to `--preemption-wait` seconds. Timeouts (`--timeout`, `--stall-timeout`) and signals end the run.

SIGINT/SIGTERM at any moment (cluster start, ray.init, the run) stop everything this launch
started and end it with 130/143 within seconds.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

from tpulaunch.cluster import emulated, reaper
from tpulaunch.cluster.connect import connect, disconnect, ray_output_to
from tpulaunch.cluster.ports import free_port
from tpulaunch.cluster.processes import stop_run_processes
from tpulaunch.cluster.record import ClusterInfo, load_record, save_record
from tpulaunch.errors import ExitCode, LaunchError
from tpulaunch.host.agent import agent_for
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.run import summary as S
from tpulaunch.run.execute import Limits, Sink, execute
from tpulaunch.run.prepare import Prepared


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


def launch(prep: Prepared, sink: Sink, *, dashboard: bool = False, quiet_ray: bool = False,
           debug: bool = False) -> S.RunSummary:
    """Get a cluster, run the attempts, clean up; returns (and writes) the run's summary."""
    plan, req = prep.plan, prep.request
    run_dir = Path(plan.log_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    limits = Limits(
        schedule_timeout_s=req.schedule_timeout, preemption_grace_s=req.preemption_grace,
        deadline=t0 + req.timeout if req.timeout else None, stall_timeout_s=req.stall_timeout,
        kill_stale=req.kill_stale, debug=debug, keep_warm=prep.cluster is not None or req.keep_cluster,
        watch_preemption=not plan.emulated or any("TPULAUNCH_METADATA_HOST" in h.env for h in plan.hosts),
    )
    attempts: list[S.Attempt] = []
    phases: dict[str, float] = {}  # launch-level timings (the attempts add theirs)
    budget = {"restarts": 0, "preemptions": 0}
    note: str | None = None
    owned: ClusterInfo | None = None
    cluster: ClusterInfo | None = None
    interrupted: int | None = None
    with Interrupts() as sigs, ray_output_to(run_dir / "ray.log", quiet_ray):
        try:
            cluster = prep.cluster
            if cluster is None:
                if not plan.emulated:
                    raise LaunchError(
                        "this slice is real but no Ray cluster was given",
                        "bring Ray up on it with `tpulaunch cluster up --tpu NAME` and pass --address auto",
                    )
                sink.progress(
                    f"starting an emulated Ray cluster: {len(plan.hosts)} host node(s) for "
                    f"{plan.mesh.num_slices} x {plan.topology.accelerator_type} ({plan.topology.topology})"
                )
                t = time.monotonic()
                early: list = []
                owned = cluster = emulated.start_emulated(list(plan.slices), plan.topology, dashboard=dashboard,
                                                          progress=sink.progress, on_head=lambda c: _early(c, plan, early))
                _wait(early, 60.0)  # every spare spawned before its host's start() can look for it
                phases["cluster_start_s"] = time.monotonic() - t
            else:
                t = time.monotonic()
                connect(cluster, prep.runtime_env)
                phases["connect_s"] = time.monotonic() - t
            sigs.raise_now = False
            with reaper.in_use(cluster.temp_dir):
                note = _attempts(plan, req, sink, limits, sigs, cluster, attempts, budget)
        except Interrupted as e:
            interrupted = e.signum
        finally:
            sigs.raise_now = False
            disconnect()
            if owned is not None and not (req.keep_cluster and interrupted is None and _keep(owned, req, sink)):
                sink.progress("stopping the emulated Ray cluster")
                emulated.stop_cluster(owned)
            if plan.emulated:
                stop_run_processes(plan.run_id)  # a host Ray could no longer reach (its node lost)
    return _summary(prep, attempts, budget, note, interrupted, time.monotonic() - t0, phases)


def _early(cluster: ClusterInfo, plan: LaunchPlan, refs: list) -> None:
    """The head of a new emulated cluster is up: connect, and let each host's agent start its
    framework import as soon as its node joins, while the other nodes are still starting."""
    connect(cluster)
    if not plan.command:
        refs.extend(agent_for(h.slice_name, h.worker_id).prewarm.remote(plan.framework, h.env) for h in plan.hosts)


def _wait(refs: list, timeout_s: float) -> None:
    import ray

    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


def _keep(cluster: ClusterInfo, req, sink: Sink) -> bool:  # noqa: ANN001
    """Leave the cluster this run started up for the next runs (`--keep-cluster`), if none is recorded."""
    rec = load_record()
    if rec is not None and (rec.running_here or rec.remote):
        sink.progress(f"not keeping the emulated cluster: another one is recorded as up ({rec.address})")
        return False
    cluster.kept, cluster.idle_timeout = True, req.idle_timeout
    save_record(cluster)
    assert cluster.temp_dir is not None
    reaper.start(cluster.temp_dir, req.idle_timeout)
    sink.progress(f"kept the emulated cluster at {cluster.address} for the next runs (stops after"
                  f" {req.idle_timeout:g} s unused; `tpulaunch cluster down` stops it now)")
    return True


def _attempts(plan: LaunchPlan, req, sink: Sink, limits: Limits, sigs: Interrupts, cluster: ClusterInfo,  # noqa: ANN001
              attempts: list[S.Attempt], budget: dict[str, int]) -> str | None:
    """Run attempts until one ends the run; returns a note on why the last one was not retried."""
    current = plan
    while True:
        a = execute(current, sink, limits, sigs, gcs_address=None if cluster.address.startswith("ray://") else cluster.address)
        attempts.append(a)
        if a.outcome in (S.OK, S.INTERRUPTED, S.TIMEOUT, S.STALLED):
            return None
        first = a.first_failure or {}
        if a.outcome in (S.LOST, S.PREEMPTED):
            if budget["preemptions"] >= req.max_preemptions:
                return _spent("--max-preemptions", req.max_preemptions)
            if "head node" in (first.get("reason") or ""):
                return "the Ray head is gone with its node: no cluster to relaunch on"
            budget["preemptions"] += 1
            sink.progress(f"host {first.get('process_index')} {first.get('reason')}: waiting up to"
                          f" {req.preemption_wait:g} s for the slice to be whole again"
                          f" (preemption {budget['preemptions']} of {req.max_preemptions})")
            if not _wait_for_slice(current, cluster, req.preemption_wait, sigs, sink):
                return f"the slice was not whole again within --preemption-wait {req.preemption_wait:g} s"
        else:
            code = a.exit_code
            if code in S.NEVER_RETRIED or (code == ExitCode.TPU_BUSY and not req.kill_stale):
                return f"exit {code} is never retried: a rerun would fail the same way"
            if budget["restarts"] >= req.max_restarts:
                return _spent("--max-restarts", req.max_restarts)
            budget["restarts"] += 1
            sink.progress(f"host {first.get('process_index')} {first.get('reason')}: restarting the whole slice"
                          f" (restart {budget['restarts']} of {req.max_restarts})")
        if sigs.received is not None:
            return None
        current = plan.for_attempt(current.attempt + 1, **_fresh_ports(plan))


def _spent(flag: str, n: int) -> str | None:
    return f"{flag} {n} spent" if n else None


def _fresh_ports(plan: LaunchPlan) -> dict[str, int | None]:
    """A new process group per attempt; on one machine also new ports (the old ones may linger)."""
    if not plan.emulated:
        return {}
    jax = "JAX_COORDINATOR_ADDRESS" in plan.hosts[0].env
    return {"coordinator_port": free_port(), "group_port": free_port(), "jax_coordinator_port": free_port() if jax else None,
            "emulation_port": free_port()}


def _wait_for_slice(plan: LaunchPlan, cluster: ClusterInfo, wait_s: float, sigs: Interrupts, sink: Sink) -> bool:
    """Until every host of the plan's slices is alive and free in Ray (or `wait_s` passes).

    On an emulated cluster on this machine a lost host is started again, as a repaired TPU VM
    rejoins a real slice; on a real cluster something outside tpulaunch must bring it back
    (`tpulaunch cluster up --tpu` again, a queued resource, an autoscaler).
    """
    from tpulaunch.discover import ray_labels

    want = {(s.name, w.worker_id) for s in plan.slices for w in s.workers}
    deadline = time.monotonic() + wait_s
    restarted = False
    while sigs.received is None:
        have = {(s.name, w): (alive, busy) for s in ray_labels.read_slices() for w, _ip, alive, busy in s.workers}
        missing = sorted(k for k in want if not have.get(k, (False, False))[0])
        if not missing and not any(have[k][1] for k in want):
            return True
        if missing and not restarted and cluster.emulated and cluster.running_here:
            sink.progress("starting the lost emulated host(s) again: " + ", ".join(f"{s} worker {w}" for s, w in missing))
            emulated.restart_hosts(cluster, plan.topology, missing)
            restarted = True
            continue
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return False


def _summary(prep: Prepared, attempts: list[S.Attempt], budget: dict[str, int], note: str | None,
             interrupted: int | None, wall_s: float, phases: dict[str, float]) -> S.RunSummary:
    plan = prep.plan
    last = attempts[-1] if attempts else None
    if last is None:
        outcome = S.INTERRUPTED if interrupted else S.FAILED
        code = S.exit_code_for(outcome, None, interrupted)
    else:
        outcome, code = last.outcome, last.exit_code
    signum = interrupted or (signal.Signals[last.signal].value if last and last.signal else None)
    summary = S.RunSummary(
        run_id=plan.run_id, exit_code=code, emulated=plan.emulated,
        slices=[s.to_dict() for s in plan.slices], mesh=plan.mesh.to_dict(devices=False),
        hosts=last.hosts if last else [], first_failure=last.first_failure if last else None,
        log_dir=plan.log_dir, wall_s=wall_s, timings={**phases, **(last.timings if last else {})},
        interrupted=signal.Signals(signum).name if outcome == S.INTERRUPTED and signum else None,
        outcome=outcome, attempts=[a.to_dict() for a in attempts], restarts=budget["restarts"],
        preemptions=budget["preemptions"], note=(last.note if last and last.note else note),
    )
    (Path(plan.log_dir) / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary

