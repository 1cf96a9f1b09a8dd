"""Execute one attempt of a LaunchPlan on the Ray cluster this process is connected to.

1. Reserve one placement-group bundle per host of every slice, all or nothing; bundle `i` carries
   the label selector `ray.io/tpu-slice-name=<slice>, ray.io/tpu-worker-id=<worker>`, so the
   agent of process `i` lands on TPU worker `i` (physical order), never wherever Ray had room.
2. Find (or start) the long-lived HostAgent of each host, check its node labels, hand it its
   HostState; an agent with a spare process of the same environment skips the import.
3. Supervise (`supervise`): gather what the hosts say (`Fleet.events`), the Ray head's probes,
   signals and the time; write lines to the sink and the host logs; hand every fact to the
   `AttemptWatch` and carry out what it decides (fail fast, dump stacks and stop, stop all).
4. Always: release the agents and remove the placement group. Returns the `Attempt`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from tpulaunch.discover.ray_labels import SLICE as LABEL_SLICE
from tpulaunch.discover.ray_labels import WORKER as LABEL_WORKER
from tpulaunch.errors import ClusterError
from tpulaunch.host.agent import agent_for, retire_other_agents
from tpulaunch.host.protocol import AgentInfo, HostOptions
from tpulaunch.host.ranks import PREFIX_RE as RANK_PREFIX_RE
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.run import watch as W
from tpulaunch.run.fleet import Fleet, RayFleet, Reply, node_death, reachable, why_agent_died
from tpulaunch.run.paths import RunPaths
from tpulaunch.run.record.events import Event
from tpulaunch.run.record.timeline import Timeline
from tpulaunch.run.status import RunState, RunView
from tpulaunch.run.summary import Attempt, Cause, HostResult, Outcome

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tpulaunch.host.agent import HostAgent

HEAD_PROBE_EVERY_S = 2.0
STATUS_EVERY_S = 2.0  # how often the sink hears where every host is
STOP_DRAIN_S = 15.0  # after stopping every host: how long to wait for their last words, beyond the grace


class Sink(Protocol):
    """Where host output, progress and the run's status go (the CLI renders; a detached run's
    supervisor also writes the status to `status.json`; tests collect). A protocol: the client's
    `PrintSink` and the supervisor's `StatusFile` are sinks without importing this module."""

    def host_line(self, process: int, stream: str, text: str) -> None:
        raise NotImplementedError

    def progress(self, message: str) -> None:
        raise NotImplementedError

    def status(self, view: RunView) -> None:
        """Where the run is: every few seconds during an attempt, and at each change of phase."""


class Interrupts(Protocol):
    received: int | None  # the signal received (SIGINT/SIGTERM), if any
    raise_now: bool  # a signal raises at once (nothing runs that must be stopped first) instead of being noted


@dataclass(frozen=True)
class Limits:
    """How long things may take, and what to do on the way out."""

    schedule_timeout_s: float = 120.0
    grace_s: float = 3.0  # SIGTERM -> SIGKILL when tpulaunch stops hosts
    preemption_grace_s: float = 30.0  # a preempted script's time to save its checkpoint
    deadline: float | None = None  # time.monotonic() by which the run must end (--timeout)
    stall_timeout_s: float | None = None  # no output or heartbeat from any host for this long
    kill_stale: bool = False
    watch_preemption: bool = False  # ask the metadata server for preemption notices
    keep_warm: bool = False  # the cluster outlives the run: leave a spare process on every host
    keep_children: bool = False  # leave what a host's script started running after it exits
    # a host that failed by exiting: how long after its exit its node may take to be seen gone
    # (`lost_with_their_nodes`); the run sets it when a lost host can be survived (--max-preemptions)
    node_settle_s: float = 0.0
    preflight: bool = True  # check every host (versions, ports, chips, ids) before any script starts
    straggler_ratio: float = 0.7  # name a host below this x the median step rate (0: never)
    debug: bool = False  # say more (why a host did not get a spare)
    # elastic runs on fewer slices: asked with the watch and the time; a reason ends the attempt to grow
    grow: Callable[[W.AttemptWatch, float], str | None] | None = None


class HostLogs:
    """`attempt-<k>/host-<i>.log`, appended per batch of lines (no file held open per host)."""

    def __init__(self, paths: RunPaths, attempt: int) -> None:
        self.paths, self.attempt = paths, attempt
        paths.attempt(attempt).mkdir(parents=True, exist_ok=True)

    def path(self, process: int) -> Path:
        return self.paths.host_log(self.attempt, process)

    def write(self, process: int, lines: tuple[tuple[str, str], ...]) -> None:
        with open(self.path(process), "a", encoding="utf-8", errors="replace") as f:
            f.write("".join(text + "\n" for _stream, text in lines))
        by_rank: dict[str, list[str]] = {}  # a host of one process per device: its lines come as "[rank R] ..."
        for _stream, text in lines:
            m = RANK_PREFIX_RE.match(text)
            if m:
                by_rank.setdefault(m.group(1), []).append(text[m.end():])
        for rank, texts in by_rank.items():
            path = self.paths.rank_log(self.attempt, process, int(rank))
            path.parent.mkdir(exist_ok=True)
            with open(path, "a", encoding="utf-8", errors="replace") as f:
                f.write("".join(t + "\n" for t in texts))

    def touch(self, process: int) -> None:
        self.path(process).touch()


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


def _wait_ready(refs: list, timeout_s: float, interrupts: Interrupts) -> bool:
    """Wait for every Ray object, a signal or the deadline, whichever comes first."""
    import ray

    end = time.monotonic() + timeout_s
    while time.monotonic() < end and interrupts.received is None:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(0.5, max(0.0, end - time.monotonic())))
        if len(ready) == len(refs):
            return True
    return False


def host_options(plan: LaunchPlan, limits: Limits) -> HostOptions:
    """What every agent of this run is told about how to run its host."""
    return HostOptions(
        cwd=plan.job.workdir if plan.local else None,  # emulated hosts run in place
        check_tpu=not plan.emulated, kill_stale=limits.kill_stale, watch_preemption=limits.watch_preemption,
        metadata_host=plan.job.user_env.get("TPULAUNCH_METADATA_HOST") or None,
        preemption_grace_s=limits.preemption_grace_s, keep_children=limits.keep_children,
    )


@dataclass(frozen=True)
class Placed:
    """Each host's agent handle, what it said of itself, and the hosts whose agent died first."""

    agents: list[ActorHandle[HostAgent]]
    infos: list[AgentInfo]
    dead: dict[int, tuple[Cause, str]]


def place_agents(plan: LaunchPlan, timeout_s: float, interrupts: Interrupts) -> Placed | None:
    """Find (or start) each host's agent and check it sits on its TPU worker; None if interrupted.
    An agent that died before it answered (its node gone as it started) is its host's loss."""
    import ray

    agents = [cast("ActorHandle[HostAgent]", agent_for(h.slice_name, h.worker_id)) for h in plan.hosts]
    refs = [a.info.remote() for a in agents]
    if not _wait_ready(refs, timeout_s, interrupts):
        if interrupts.received is None:
            raise ClusterError(f"the host agents did not start within {timeout_s:.0f} s",
                               "Ray could not start their worker processes; see the raylet logs of the cluster")
        return None
    infos: list[AgentInfo] = []
    dead: dict[int, tuple[Cause, str]] = {}
    for i, ref in enumerate(refs):
        try:
            infos.append(ray.get(ref))
        except ray.exceptions.RayActorError as e:
            cause, why = why_agent_died(e)
            ray_says = node_death(e)
            dead[i] = (cause, f"{why} as its agent started" + (f": {ray_says}" if ray_says else ""))
    if dead:
        return Placed(agents, [], dead)
    for h, info in zip(plan.hosts, infos, strict=True):
        got = (info.labels.get(LABEL_SLICE), info.labels.get(LABEL_WORKER))
        if got != (h.slice_name, str(h.worker_id)):
            raise ClusterError(f"host agent {h.process_index} landed on {got}, not ({h.slice_name}, {h.worker_id})",
                               "the cluster's TPU labels are inconsistent; restart it")
    retire_other_agents([(h.slice_name, h.worker_id) for h in plan.hosts])
    return Placed(agents, infos, {})


def execute(plan: LaunchPlan, sink: Sink, limits: Limits, interrupts: Interrupts,
            gcs_address: str | None = None, timeline: Timeline | None = None) -> Attempt:
    """Run one attempt of the plan on Ray (see the module docstring)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    t0 = time.time()
    paths = RunPaths.of(plan.job.log_dir)
    logs, watch = attempt_watch(plan, limits)
    timeline = timeline or Timeline(None)
    watch.on_step = lambda host, reply, at: timeline.on_step(plan.attempt, host, reply, at)
    hosts = watch.hosts
    timings: dict[str, float] = {}
    fleet: RayFleet | None = None
    pg = None
    head_lost = False
    try:
        bundles = [{"TPU": float(plan.topology.chips_per_host)} for _ in plan.hosts]
        selectors = [{LABEL_SLICE: h.slice_name, LABEL_WORKER: str(h.worker_id)} for h in plan.hosts]
        sink.progress(f"reserving {len(bundles)} host(s) of {len(plan.slices)} slice(s) (all or nothing)")
        pg = placement_group(bundles, strategy="STRICT_SPREAD", bundle_label_selector=selectors,
                             name=f"tpulaunch-{plan.run_id}-{plan.attempt}")
        if not _wait_ready([pg.ready()], limits.schedule_timeout_s, interrupts):
            if interrupts.received is None:
                raise ClusterError(
                    f"Ray could not give this run its {len(bundles)} host(s) within {limits.schedule_timeout_s:.0f} s:"
                    f" {_diagnose(plan)}",
                    "check `tpulaunch cluster status`, or raise --schedule-timeout",
                )
        else:
            timings["schedule_s"] = time.time() - t0
            sink.progress("starting host agents")
            placed = place_agents(plan, limits.schedule_timeout_s, interrupts)
            for i, (cause, why) in (placed.dead if placed else {}).items():
                sink.progress(f"host {i} lost ({why})")
                watch.on_gone(i, cause, why)
            if placed is not None and not placed.dead:
                agents, infos = placed.agents, placed.infos
                raylets = _raylets(infos)
                for r, info in zip(hosts, infos, strict=True):
                    r.node_ip = info.node_ip
                fleet = RayFleet(agents, raylets, head=gcs_address or "")
                probe = (lambda: reachable(gcs_address)) if gcs_address else None
                head_lost = drive(plan, fleet, watch, sink, logs, limits, interrupts, timings, probe, t0, timeline)
                if not head_lost:
                    lost_with_their_nodes(fleet, watch.hosts, limits.node_settle_s, sink)
    except KeyboardInterrupt:
        import signal

        interrupts.received = signal.SIGINT
        action = watch.check(time.monotonic(), signal.SIGINT)
        if fleet is not None and action is not None:
            fleet.stop(action.hosts, limits.grace_s)
    finally:
        if not head_lost:  # with the head gone every Ray call would wait for it, then kill us
            if fleet is not None:
                warm = limits.keep_warm and not plan.job.command
                fleet.release(plan.states() if warm else None)
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:  # best effort: the attempt is over either way
                    pass
    if watch.signal is None and interrupts.received is not None and watch.outcome is None:
        watch.check(time.monotonic(), interrupts.received)  # interrupted before the hosts ran
    a = watch.result(str(paths.attempt(plan.attempt)), time.time() - t0, timings)
    a.slices, a.reason = [s.name for s in plan.slices], plan.reason
    return a


def attempt_watch(plan: LaunchPlan, limits: Limits) -> tuple[HostLogs, W.AttemptWatch]:
    """The attempt's host logs (each touched: every host has its log, even one that never printed)
    and its watch."""
    logs = HostLogs(RunPaths.of(plan.job.log_dir), plan.attempt)
    hosts = [HostResult(h.process_index, h.slice_index, h.worker_id, log=str(logs.path(h.process_index)))
             for h in plan.hosts]
    for h in plan.hosts:
        logs.touch(h.process_index)
    rules = W.StopRules(limits.deadline, limits.stall_timeout_s, limits.preemption_grace_s, limits.straggler_ratio)
    watch = W.AttemptWatch(plan.attempt, hosts, rules, time.monotonic())
    watch.grow = limits.grow
    return logs, watch


def drive(plan: LaunchPlan, fleet: Fleet, watch: W.AttemptWatch, sink: Sink, logs: HostLogs, limits: Limits,
          interrupts: Interrupts, timings: dict, probe_head: Callable[[], bool] | None = None,
          t0: float | None = None, timeline: Timeline | None = None) -> bool:
    """One attempt on hosts whose agents are placed: preflight, start, supervise until every host
    is over. Returns True when the Ray head was lost. `t0`: when the attempt began (timings).
    (The scale harness drives this with simulated hosts.)"""
    t0 = t0 or time.time()
    timeline = timeline or Timeline(None)
    options = host_options(plan, limits)
    if limits.preflight:
        timeline.emit(Event.PREFLIGHT_START, attempt=plan.attempt)
        ok = _preflight(plan, fleet, options, watch, sink, timings, limits)
        timeline.emit(Event.PREFLIGHT_END, attempt=plan.attempt, ok=ok)
        if not ok:
            return False
    started = fleet.start(plan.states(), options, limits.schedule_timeout_s)
    now = time.time()
    for host, s in enumerate(started):
        timeline.emit(Event.HOST_START, now, attempt=plan.attempt, host=host, prewarmed=s.prewarmed)
    timings["agents_s"] = time.time() - t0
    warm = sum(1 for s in started if s.prewarmed)
    timings["prewarmed_hosts"] = warm
    if warm < len(started) and limits.debug:
        why = next(s.why for s in started if not s.prewarmed)
        sink.progress(f"{len(started) - warm} host(s) started a fresh process: {why}")
    watch.started(time.time())
    if interrupts.received is None:
        sink.progress(f"running on {len(plan.hosts)} host(s)" + (f", attempt {plan.attempt}" if plan.attempt else ""))
    return supervise(plan, fleet, watch, sink, logs, limits, interrupts, timings, probe_head)


def _preflight(plan: LaunchPlan, fleet: Fleet, options: HostOptions, watch: W.AttemptWatch, sink: Sink,
               timings: dict, limits: Limits) -> bool:
    """Check every host before any script starts; False (and the attempt ends) on an error."""
    from tpulaunch.run import preflight

    t = time.time()
    reports = fleet.preflight(plan.states(), options, preflight.requests(plan), limits.schedule_timeout_s)
    found = preflight.findings(plan, reports)
    timings["preflight_s"] = time.time() - t
    watch.findings = [f.to_dict() for f in found]
    for f in found:
        sink.progress(("preflight: " if f.error else "preflight warning: ") + f.line())
    if any(f.error for f in found):
        watch.preflight_failed(watch.findings)
        return False
    return True


def lost_with_their_nodes(fleet: RayFleet, hosts: list[HostResult], settle_s: float, sink: Sink) -> list[int]:
    """Hosts that failed by exiting while their node went away are lost with it, not failed.

    A VM that goes away (preempted, its node stopped) ends its processes in no set order: the
    script may die first (SIGKILL; SIGTERM at a shutdown) and its agent report that exit before
    the agent and the raylet are gone, so the loop heard `killed by signal 9`, not a loss, and
    the run ended as the script's failure (--max-restarts) instead of surviving the preemption
    (--max-preemptions, --recreate). At the attempt's end, each such host whose Ray node no
    longer answers is lost with it (waiting until `settle_s` after its exit was heard for the
    node to go; a failure of the script's own leaves the node up). Returns their indices."""
    suspects = [i for i, r in enumerate(hosts) if r.cause is Cause.EXITED and r.exit_code not in (None, 0)
                and not (r.stopped_by_tpulaunch or r.lost or r.preempted) and fleet.raylets[i]]
    end = max((hosts[i].last_seen or 0.0 for i in suspects), default=0.0) + settle_s
    gone: list[int] = []
    while suspects:
        for i in [i for i in suspects if fleet.node_gone(i)]:
            suspects.remove(i)
            gone.append(i)
            r = hosts[i]
            r.lost, r.cause, r.reason = True, Cause.NODE_LOST, f"node lost (its process {r.reason} as it went)"
            sink.progress(f"host {r.process_index}: its Ray node is gone too: {r.reason}")
        if not suspects or time.time() >= end:
            break
        time.sleep(0.25)
    return sorted(gone)


def _raylets(infos: list[AgentInfo]) -> list[str]:
    import ray

    by_node = {n["NodeID"]: f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}" for n in ray.nodes() if n.get("Alive")}
    return [by_node.get(info.node_id, "") for info in infos]


def supervise(plan: LaunchPlan, fleet: Fleet, watch: W.AttemptWatch, sink: Sink, logs: HostLogs, limits: Limits,
              interrupts: Interrupts, timings: dict, probe_head: Callable[[], bool] | None = None) -> bool:
    """Run the attempt until every host is over. Returns True when the Ray head was lost."""
    t0 = time.time()
    stop_deadline: float | None = None  # once every host was told to stop: how long we wait for them
    next_probe = 0.0
    next_status = 0.0
    head = next((h.process_index for h in plan.hosts if h.slice_index == 0 and h.worker_id == 0), 0)
    while watch.pending:
        now = time.monotonic()
        if stop_deadline is None:
            action = watch.check(now, interrupts.received)
            if action is not None:
                stop_deadline = _carry_out(action, plan, fleet, watch, sink, logs, limits)
        elif now >= stop_deadline:
            break  # the hosts that did not answer keep no exit code
        for event in fleet.events(0.5):
            if isinstance(event, Reply):
                if event.reply.lines:
                    _write(event.host, event.reply.lines, sink, logs, timings, t0)
                action = watch.on_reply(event.host, event.reply, event.at_monotonic, event.at)
            else:
                action = watch.on_gone(event.host, event.cause, event.why)
            if action is not None and stop_deadline is None:
                stop_deadline = _carry_out(action, plan, fleet, watch, sink, logs, limits)
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + STATUS_EVERY_S
            if stop_deadline is None:
                for line in watch.stragglers(time.monotonic()):
                    sink.progress(line)
            sink.status(RunView(plan.run_id, RunState.RUNNING, plan.attempt, watch.view(time.monotonic())))
        if probe_head is not None and stop_deadline is None and time.monotonic() >= next_probe:
            next_probe = time.monotonic() + HEAD_PROBE_EVERY_S
            action = watch.on_head_probe(probe_head(), head)
            if action is not None:
                sink.progress(f"{action.why}")
                if plan.local:
                    from tpulaunch.cluster.processes import stop_run_processes

                    stop_run_processes(plan.run_id, limits.grace_s)
                return True
    return False


def _write(process: int, lines: tuple[tuple[str, str], ...], sink: Sink, logs: HostLogs, timings: dict,
           t0: float) -> None:
    if "first_line_s" not in timings:
        timings["first_line_s"] = time.time() - t0
    logs.write(process, lines)
    for stream, text in lines:
        sink.host_line(process, stream, text)


def _carry_out(action: W.StopOthers | W.StopAll, plan: LaunchPlan, fleet: Fleet, watch: W.AttemptWatch, sink: Sink,
               logs: HostLogs, limits: Limits) -> float | None:
    """Do what the watch decided. Returns the deadline for the stopped hosts' last words when the
    attempt now ends for everyone (StopAll), else None (fail fast: the others end as they end)."""
    if isinstance(action, W.StopOthers):
        sink.progress(action.why)
        fleet.stop(action.hosts, limits.grace_s if action.grace_s is None else action.grace_s)
        return None
    sink.progress(action.why + (": dumping every host's Python stacks (py-spy)" if action.dump_stacks else ""))
    if action.dump_stacks:
        order = list(action.hosts)
        dumps = fleet.dump_stacks(order, 40.0)
        paths = logs.paths
        for i in order:
            path = paths.host_stacks(plan.attempt, plan.hosts[i].process_index)
            path.write_text(dumps.get(i, "(no dump)"))
            watch.hosts[i].stacks = str(path)
        by_process = {plan.hosts[i].process_index: dumps.get(i, "") for i in order}
        where = W.where_hosts_are(by_process)
        watch.note = f"{action.why}; stacks in {paths.attempt(plan.attempt)}/host-<i>.stacks.txt ({where})"
        if action.outcome is Outcome.STALLED:  # which hosts caused it: what the others wait for
            from tpulaunch.run import hang

            hung = hang.triage(by_process, [hang.HostRef(h.process_index, h.slice_index, h.worker_id)
                                            for h in plan.hosts])
            watch.hang = hung
            watch.note = (f"{action.why}; {hung.line}; stacks in {paths.attempt(plan.attempt)}/host-<i>.stacks.txt"
                          f" ({where})")
            sink.progress(hung.line)
    fleet.stop(action.hosts, limits.grace_s)
    return time.monotonic() + limits.grace_s + STOP_DRAIN_S
