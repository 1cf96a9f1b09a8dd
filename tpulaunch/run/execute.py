"""Execute a LaunchPlan on the Ray cluster we are connected to: gang-schedule the host agents, stream, fail fast, summarize.

`execute(plan, ...)` takes nothing but the plan and where Ray is. Steps:

1. Reserve one placement-group bundle per host of every slice, all or nothing; bundle `i` carries
   the label selector `ray.io/tpu-slice-name=<slice>, ray.io/tpu-worker-id=<worker>`, so the
   agent of process `i` lands on TPU worker `i` (physical order), never wherever Ray had room.
2. Start one HostAgent per bundle, check its node labels, hand it its pickled HostState.
3. Poll every agent for output and exit codes; stream lines to the sink and to per-host logs.
   The first non-zero exit stops every other host within seconds (fail fast).
4. On SIGINT/SIGTERM: stop every host, flush logs, and report 130/143.
5. Always: kill agents, remove the placement group, write `summary.json`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from tpulaunch.discover.ray_labels import SLICE as LABEL_SLICE
from tpulaunch.discover.ray_labels import WORKER as LABEL_WORKER
from tpulaunch.errors import ClusterError, ExitCode
from tpulaunch.host.agent import HostAgent, dumps_state
from tpulaunch.plan.launch import HostState, LaunchPlan

POLL_S = 0.1


class Sink(Protocol):
    """Where host output and progress go (the CLI renders; tests collect)."""

    def host_line(self, process: int, stream: str, text: str) -> None: ...

    def progress(self, message: str) -> None: ...


@dataclass
class HostResult:
    process_index: int
    slice_index: int
    worker_id: int
    exit_code: int | None = None
    wall_s: float = 0.0
    node_ip: str | None = None
    log: str = ""
    stopped_by_tpulaunch: bool = False


@dataclass
class RunSummary:
    run_id: str
    exit_code: int
    emulated: bool
    slices: list[dict]
    mesh: dict
    hosts: list[HostResult]
    first_failure: dict | None
    log_dir: str
    wall_s: float
    timings: dict = field(default_factory=dict)
    interrupted: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema"] = "tpulaunch.summary/v1"
        return d


class _Signals:
    """Turn SIGINT/SIGTERM into a flag the poll loop checks (restored on exit)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def _diagnose(plan: LaunchPlan) -> str:
    """Say what Ray lacks when the slice cannot be scheduled."""
    from tpulaunch.discover import ray_labels

    want = {(s.name, w.worker_id) for s in plan.slices for w in s.workers}
    have = {(s.name, w) for s in ray_labels.read_slices() for w, _ip, alive, _busy in s.workers if alive}
    missing = sorted(want - have)
    if missing:
        shown = ", ".join(f"{s} worker {w}" for s, w in missing[:8])
        return f"no alive Ray node carries {shown}" + (" ..." if len(missing) > 8 else "")
    return "every host is in the cluster but some are busy (their TPU resources are held by another run)"


def execute(
    plan: LaunchPlan,
    sink: Sink,
    *,
    schedule_timeout_s: float = 120.0,
    grace_s: float = 3.0,
    kill_stale: bool = False,
) -> RunSummary:
    """Run the plan on the Ray cluster this process is connected to (see module docstring)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t0 = time.time()
    topo = plan.topology
    log_dir = Path(plan.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results = [HostResult(h.process_index, h.slice_index, h.worker_id,
                          log=str(log_dir / f"host-{h.process_index}.log")) for h in plan.hosts]
    logs = {h.process_index: open(log_dir / f"host-{h.process_index}.log", "a", buffering=1) for h in plan.hosts}
    timings: dict[str, float] = {}
    agents: list = []
    pg = None
    interrupted: int | None = None
    first_failure: HostResult | None = None
    try:
        with _Signals() as sigs:
            bundles = [{"TPU": float(topo.chips_per_host)} for _ in plan.hosts]
            selectors = [{LABEL_SLICE: h.slice_name, LABEL_WORKER: str(h.worker_id)} for h in plan.hosts]
            sink.progress(f"reserving {len(bundles)} host(s) of {len(plan.slices)} slice(s) (all or nothing)")
            pg = placement_group(bundles, strategy="STRICT_SPREAD", bundle_label_selector=selectors,
                                 name=f"tpulaunch-{plan.run_id}")
            ready, _ = ray.wait([pg.ready()], timeout=schedule_timeout_s)
            if not ready:
                raise ClusterError(
                    f"Ray could not give this run its {len(bundles)} host(s) within {schedule_timeout_s:.0f} s: {_diagnose(plan)}",
                    "check `tpulaunch cluster status`, or raise --schedule-timeout",
                )
            timings["schedule_s"] = time.time() - t0
            actor_cls = ray.remote(HostAgent)
            opts: dict = {"num_cpus": 0, "max_concurrency": 4, "max_restarts": 0}
            for i, h in enumerate(plan.hosts):
                agents.append(actor_cls.options(
                    resources={"TPU": float(topo.chips_per_host)},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                    name=None, **opts,
                ).remote(h.process_index))
            sink.progress("starting host agents")
            try:
                infos = ray.get([a.info.remote() for a in agents], timeout=schedule_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"the host agents did not start within {schedule_timeout_s:.0f} s",
                    "Ray could not start their worker processes; see the raylet logs of the cluster",
                ) from None
            for h, info, r in zip(plan.hosts, infos, results):
                r.node_ip = info["node_ip"]
                got = (info["labels"].get(LABEL_SLICE), info["labels"].get(LABEL_WORKER))
                if got != (h.slice_name, str(h.worker_id)):
                    raise ClusterError(
                        f"host agent {h.process_index} landed on {got}, not ({h.slice_name}, {h.worker_id})",
                        "the cluster's TPU labels are inconsistent; restart it",
                    )
            timings["agents_s"] = time.time() - t0
            cwd = plan.workdir if plan.emulated else None  # emulated hosts run in place
            ray.get([a.start.remote(dumps_state(HostState.for_host(plan, h)), h.env, list(plan.command) or None,
                                    not plan.emulated, kill_stale, cwd)
                     for a, h in zip(agents, plan.hosts)])
            sink.progress(f"running on {len(agents)} host(s)")
            first_failure, interrupted = _supervise(plan, agents, results, logs, sink, sigs, grace_s)
    except KeyboardInterrupt:
        interrupted = signal.SIGINT
        _stop_all(agents, grace_s)
    finally:
        for f in logs.values():
            f.close()
        for a in agents:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
    if interrupted is not None:
        code = ExitCode.INTERRUPTED if interrupted == signal.SIGINT else ExitCode.TERMINATED
    elif first_failure is not None:
        code = first_failure.exit_code or 1
    else:
        code = 0
    summary = RunSummary(
        run_id=plan.run_id, exit_code=code, emulated=plan.emulated,
        slices=[s.to_dict() for s in plan.slices], mesh=plan.mesh.to_dict(devices=False),
        hosts=results, first_failure=asdict(first_failure) if first_failure else None,
        log_dir=str(log_dir), wall_s=time.time() - t0, timings=timings,
        interrupted=signal.Signals(interrupted).name if interrupted else None,
    )
    (log_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def _supervise(plan, agents, results, logs, sink, sigs, grace_s):  # noqa: ANN001, ANN202 - internal
    """Poll until every host ended; fail fast on the first failure. Returns (first_failure, signal)."""
    import ray

    pending = set(range(len(agents)))
    first_failure = None
    while pending:
        if sigs.received is not None:
            sink.progress(f"received {signal.Signals(sigs.received).name}: stopping every host")
            _stop_all([agents[i] for i in pending], grace_s)
            _drain(agents, pending, results, logs, sink)
            return first_failure, sigs.received
        idx = sorted(pending)
        try:
            polled = ray.get([agents[i].poll.remote() for i in idx], timeout=60)
        except ray.exceptions.RayActorError as e:
            # The actor (its node, its process) died: that host failed.
            for i in idx:
                results[i].exit_code = results[i].exit_code if results[i].exit_code is not None else 1
            sink.progress(f"a host agent died: {str(e).splitlines()[0]}")
            first_failure = first_failure or results[idx[0]]
            break
        failed_now = []
        for i, (lines, code, wall, ended) in zip(idx, polled):
            for stream, text in lines:
                logs[plan.hosts[i].process_index].write(text + "\n")
                sink.host_line(plan.hosts[i].process_index, stream, text)
            results[i].wall_s = wall
            if code is not None:
                results[i].exit_code = code
                pending.discard(i)
                if code != 0:
                    failed_now.append((ended or time.time(), i))
        if failed_now and first_failure is None:
            # Several hosts can end in one poll (peers of a dead host error out of a collective
            # within milliseconds): blame the one that ended first, not the first polled.
            i = min(failed_now)[1]
            first_failure = results[i]
            if pending:
                sink.progress(f"host {plan.hosts[i].process_index} exited {first_failure.exit_code}:"
                              " stopping the other hosts")
                for j in pending:
                    results[j].stopped_by_tpulaunch = True
                _stop_all([agents[j] for j in pending], grace_s)
        if pending:
            time.sleep(POLL_S)
    return first_failure, None


def _stop_all(agents: list, grace_s: float) -> None:
    import ray

    if not agents:
        return
    try:
        ray.get([a.terminate.remote(grace_s) for a in agents], timeout=grace_s + 15)
    except Exception:  # noqa: BLE001 - the loop's next poll reports what is left
        pass


def _drain(agents, pending, results, logs, sink) -> None:  # noqa: ANN001 - internal
    import ray

    for i in sorted(pending):
        try:
            lines, code, wall, _ended = ray.get(agents[i].poll.remote(100000), timeout=10)
        except Exception:  # noqa: BLE001
            continue
        for stream, text in lines:
            logs[results[i].process_index].write(text + "\n")
            sink.host_line(results[i].process_index, stream, text)
        results[i].exit_code = code
        results[i].wall_s = wall
        results[i].stopped_by_tpulaunch = True
