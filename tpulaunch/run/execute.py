"""Execute one attempt of a LaunchPlan on the Ray cluster this process is connected to.

1. Reserve one placement-group bundle per host of every slice, all or nothing; bundle `i` carries
   the label selector `ray.io/tpu-slice-name=<slice>, ray.io/tpu-worker-id=<worker>`, so the
   agent of process `i` lands on TPU worker `i` (physical order), never wherever Ray had room.
2. Find (or start) the long-lived HostAgent of each host, check its node labels, hand it its
   pickled HostState; an agent with a spare process of the same environment skips the import.
3. Supervise: one long-poll in flight per agent, so a dead agent or node is known as that host's
   death (`node lost`, `agent died`), never mistaken for its peers'. Lines stream to the sink and
   to `attempt-<k>/host-<i>.log`. The first failure (a non-zero exit, a lost host, a preemption)
   stops every other host (fail fast). `--timeout` and `--stall-timeout` dump every host's Python
   stacks (py-spy) into its log directory, then stop all. A signal stops all.
4. Always: kill the agents and remove the placement group. Returns the `Attempt`; which host
   failed first is decided once every host is over (see `summary.first_failure`).
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from tpulaunch.discover.ray_labels import SLICE as LABEL_SLICE
from tpulaunch.discover.ray_labels import WORKER as LABEL_WORKER
from tpulaunch.errors import ClusterError
from tpulaunch.host.agent import agent_for, dumps_state
from tpulaunch.plan.launch import HostState, LaunchPlan
from tpulaunch.run import summary as S

POLL_WAIT_S = 1.0  # how long an agent holds a poll open when its host is quiet
LOST_AFTER_S = 30.0  # an agent that answers no poll for this long is lost
HEAD_PROBE_EVERY_S = 2.0
HEAD_LOST_AFTER = 3  # consecutive refused probes of the Ray head (GCS)


class Sink(Protocol):
    """Where host output and progress go (the CLI renders; tests collect)."""

    def host_line(self, process: int, stream: str, text: str) -> None: ...

    def progress(self, message: str) -> None: ...


class Interrupts(Protocol):
    received: int | None  # the signal received (SIGINT/SIGTERM), if any


@dataclass
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
    debug: bool = False  # say more (why a host did not get a spare)


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


def attempt_dir(plan: LaunchPlan) -> Path:
    return Path(plan.log_dir) / f"attempt-{plan.attempt}"


def execute(plan: LaunchPlan, sink: Sink, limits: Limits, interrupts: Interrupts,
            gcs_address: str | None = None) -> S.Attempt:
    """Run one attempt of the plan (see module docstring)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    t0 = time.time()
    log_dir = attempt_dir(plan)
    log_dir.mkdir(parents=True, exist_ok=True)
    hosts = [S.HostResult(h.process_index, h.slice_index, h.worker_id, log=str(log_dir / f"host-{h.process_index}.log"))
             for h in plan.hosts]
    logs = {h.process_index: open(log_dir / f"host-{h.process_index}.log", "a", buffering=1) for h in plan.hosts}
    run = _Supervision(plan, sink, limits, interrupts, hosts, logs, gcs_address)
    pg = None
    try:
        topo = plan.topology
        bundles = [{"TPU": float(topo.chips_per_host)} for _ in plan.hosts]
        selectors = [{LABEL_SLICE: h.slice_name, LABEL_WORKER: str(h.worker_id)} for h in plan.hosts]
        sink.progress(f"reserving {len(bundles)} host(s) of {len(plan.slices)} slice(s) (all or nothing)")
        pg = placement_group(bundles, strategy="STRICT_SPREAD", bundle_label_selector=selectors,
                             name=f"tpulaunch-{plan.run_id}-{plan.attempt}")
        if not run.wait_ready(pg.ready(), limits.schedule_timeout_s):
            if run.interrupts.received is None:
                raise ClusterError(
                    f"Ray could not give this run its {len(bundles)} host(s) within {limits.schedule_timeout_s:.0f} s:"
                    f" {_diagnose(plan)}",
                    "check `tpulaunch cluster status`, or raise --schedule-timeout",
                )
        else:
            run.timings["schedule_s"] = time.time() - t0
            run.start_agents()
            run.timings["agents_s"] = time.time() - t0
            if run.interrupts.received is None:
                sink.progress(f"running on {len(plan.hosts)} host(s)" + (f", attempt {plan.attempt}" if plan.attempt else ""))
                run.supervise()
    except KeyboardInterrupt:
        import signal

        run.interrupts.received = signal.SIGINT
        run.stop_all("interrupted")
    finally:
        for f in logs.values():
            f.close()
        if not run.head_lost:  # with the head gone every Ray call would wait for it, then kill us
            run.release()
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass
    return run.result(time.time() - t0)


class _Supervision:
    """The state of one attempt while it runs."""

    def __init__(self, plan: LaunchPlan, sink: Sink, limits: Limits, interrupts: Interrupts,
                 hosts: list[S.HostResult], logs: dict, gcs_address: str | None) -> None:
        self.plan, self.sink, self.limits, self.interrupts = plan, sink, limits, interrupts
        self.hosts, self.logs = hosts, logs
        self.agents: list = []
        self.raylet_of: dict[int, str] = {}  # host -> its node's raylet host:port
        self.timings: dict[str, float] = {}
        self.outcome: str | None = None  # set by a timeout, a stall, a signal or a lost head
        self.note: str | None = None
        self.failed_fast = False
        self.pending: set[int] = set()
        self.gcs = gcs_address
        self.head_lost = False
        self.t0 = time.time()
        self.head_refusals = 0
        self.next_head_probe = 0.0

    # -- starting -----------------------------------------------------------------------------

    def wait_ready(self, ref: object, timeout_s: float) -> bool:
        """Wait for a Ray object, a signal or the deadline, whichever comes first."""
        import ray

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.interrupts.received is not None:
                return False
            ready, _ = ray.wait([ref], timeout=min(0.5, max(0.0, end - time.monotonic())))
            if ready:
                return True
        return False

    def start_agents(self) -> None:
        import ray
        plan = self.plan
        # One long-lived agent per host, found again by later runs (with a spare process ready).
        self.agents = [agent_for(h.slice_name, h.worker_id) for h in plan.hosts]
        self.sink.progress("starting host agents")
        infos_ref = [a.info.remote() for a in self.agents]
        if not self.wait_ready_all(infos_ref, self.limits.schedule_timeout_s):
            if self.interrupts.received is None:
                raise ClusterError(
                    f"the host agents did not start within {self.limits.schedule_timeout_s:.0f} s",
                    "Ray could not start their worker processes; see the raylet logs of the cluster",
                )
            return
        raylets = {n["NodeID"]: f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}" for n in ray.nodes() if n.get("Alive")}
        for i, (h, info, r) in enumerate(zip(plan.hosts, ray.get(infos_ref), self.hosts)):
            r.node_ip = info["node_ip"]
            self.raylet_of[i] = raylets.get(info["node_id"], "")
            got = (info["labels"].get(LABEL_SLICE), info["labels"].get(LABEL_WORKER))
            if got != (h.slice_name, str(h.worker_id)):
                raise ClusterError(
                    f"host agent {h.process_index} landed on {got}, not ({h.slice_name}, {h.worker_id})",
                    "the cluster's TPU labels are inconsistent; restart it",
                )
        cwd = plan.workdir if plan.emulated else None  # emulated hosts run in place
        started = ray.get([a.start.remote(
            dumps_state(HostState.for_host(plan, h)), h.env, run_id=plan.run_id, command=list(plan.command) or None,
            framework=plan.framework, check_tpu=not plan.emulated, kill_stale=self.limits.kill_stale, cwd=cwd,
            watch_preemption=self.limits.watch_preemption, grace_s=self.limits.preemption_grace_s)
            for a, h in zip(self.agents, plan.hosts)])
        warm = sum(1 for s in started if s["prewarmed"])
        self.timings["prewarmed_hosts"] = warm
        if warm < len(started):
            why = next(s["why"] for s in started if not s["prewarmed"])
            self.debug(f"{len(started) - warm} host(s) started a fresh process: {why}")
        self.pending = set(range(len(self.agents)))
        now = time.time()
        for r in self.hosts:
            r.last_seen = now

    def wait_ready_all(self, refs: list, timeout_s: float) -> bool:
        import ray

        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.interrupts.received is None:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(0.5, max(0.0, end - time.monotonic())))
            if len(ready) == len(refs):
                return True
        return False

    # -- supervising --------------------------------------------------------------------------

    def supervise(self) -> None:
        import ray

        outstanding: dict[object, int] = {}
        activity = {i: time.monotonic() for i in self.pending}
        beat = {i: 0.0 for i in self.pending}
        unanswered_since = {i: time.monotonic() for i in self.pending}
        while self.pending:
            if self._check_stop_conditions(activity):
                break
            for i in self.pending - set(outstanding.values()):
                outstanding[self.agents[i].poll.remote(5000, POLL_WAIT_S)] = i
            ready, _ = ray.wait(list(outstanding), num_returns=1, timeout=0.5)
            if ready:
                more, _ = ray.wait([r for r in outstanding if r not in ready], num_returns=len(outstanding) - len(ready),
                                   timeout=0)
                ready += more
            now = time.monotonic()
            for ref in ready:
                i = outstanding.pop(ref)
                try:
                    got = ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    if now - unanswered_since[i] > LOST_AFTER_S:
                        self._lost(i, f"agent unreachable for {LOST_AFTER_S:.0f} s")
                    continue
                except ray.exceptions.RayActorError as e:
                    self._lost(i, self._why_dead(i, e))
                    continue
                unanswered_since[i] = now
                self.hosts[i].last_seen = time.time()
                if got["lines"] or got["activity"] > beat[i]:
                    activity[i] = now
                beat[i] = got["activity"]
                self._write(i, got["lines"])
                self.hosts[i].wall_s = got["wall"]
                if got["preempted"] and not self.hosts[i].preempted:
                    self.hosts[i].preempted = got["preempted"]
                    self._fail_fast(i, f"host {self.plan.hosts[i].process_index} is preempted ({got['preempted']})",
                                    grace=self.limits.preemption_grace_s)
                if got["code"] is not None:
                    self.hosts[i].phases = got.get("phases") or {}
                    self._ended(i, got["code"], got["ended"])

    def _check_stop_conditions(self, activity: dict[int, float]) -> bool:
        """Signals, --timeout, --stall-timeout and a lost Ray head end the attempt for every host."""
        if self.interrupts.received is not None:
            import signal

            name = signal.Signals(self.interrupts.received).name
            self.sink.progress(f"received {name}: stopping every host")
            self.outcome = S.INTERRUPTED
            self.stop_all("interrupted")
            return True
        now = time.monotonic()
        if self.limits.deadline is not None and now >= self.limits.deadline:
            self._dump_and_stop(S.TIMEOUT, "the run reached its --timeout")
            return True
        stall = self.limits.stall_timeout_s
        if stall and self.pending and all(now - activity[i] >= stall for i in self.pending):
            self._dump_and_stop(S.STALLED, f"no output or heartbeat from any host for {stall:g} s")
            return True
        if self.gcs and now >= self.next_head_probe:
            self.next_head_probe = now + HEAD_PROBE_EVERY_S
            self.head_refusals = 0 if _reachable(self.gcs) else self.head_refusals + 1
            if self.head_refusals >= HEAD_LOST_AFTER:
                self._head_lost()
                return True
        return False

    def _write(self, i: int, lines: list) -> None:
        p = self.plan.hosts[i].process_index
        if lines and "first_line_s" not in self.timings:
            self.timings["first_line_s"] = time.time() - self.t0
        for stream, text in lines:
            self.logs[p].write(text + "\n")
            self.sink.host_line(p, stream, text)

    def _ended(self, i: int, code: int, ended: float | None) -> None:
        r = self.hosts[i]
        r.exit_code, r.ended_at = code, ended or time.time()
        if r.reason is None:
            r.reason = S.exit_reason(code) if not r.preempted else f"preempted: {r.preempted}, then {S.exit_reason(code)}"
        self.pending.discard(i)
        if code != 0 and not r.stopped_by_tpulaunch:
            self._fail_fast(i, f"host {self.plan.hosts[i].process_index} {S.exit_reason(code)}")

    def _lost(self, i: int, why: str) -> None:
        r = self.hosts[i]
        r.lost, r.reason = True, why
        self.pending.discard(i)
        self._fail_fast(i, f"host {self.plan.hosts[i].process_index} lost ({why})")

    def _why_dead(self, i: int, err: Exception) -> str:
        """`node lost` when the agent's Ray node is gone (its raylet no longer answers), else
        `agent died`. Ray's own error may not say yet: a killed raylet takes its workers with it
        before the head has marked the node dead."""
        if getattr(err, "preempted", False):
            return "node preempted"
        if "node has died" in str(err).lower():
            return "node lost"
        raylet = self.raylet_of.get(i)
        if raylet and not _reachable(raylet):
            return "node lost"
        return "agent died"

    def _fail_fast(self, i: int, what: str, grace: float | None = None) -> None:
        if self.failed_fast:
            return
        self.failed_fast = True
        if self.pending:
            self.sink.progress(f"{what}: stopping the other hosts")
            self.stop_all("stopped by tpulaunch", grace=grace, wait=False)

    # -- stopping -----------------------------------------------------------------------------

    def stop_all(self, why: str, grace: float | None = None, wait: bool = True) -> None:
        """SIGTERM every pending host (SIGKILL after the grace period); drain them if `wait`."""
        import ray

        grace = self.limits.grace_s if grace is None else grace
        refs = []
        for i in sorted(self.pending):
            self.hosts[i].stopped_by_tpulaunch = True
            refs.append(self.agents[i].terminate.remote(grace))
        if wait and refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=grace + 15)
            except Exception:  # noqa: BLE001
                pass
            self._drain()

    def _drain(self) -> None:
        """Collect what stopped hosts printed last and their exit codes (bounded)."""
        import ray

        for i in sorted(self.pending):
            try:
                got = ray.get(self.agents[i].poll.remote(100000, 0.0), timeout=10)
            except Exception:  # noqa: BLE001 - lost with its node
                continue
            self._write(i, got["lines"])
            self.hosts[i].wall_s = got["wall"]
            if got["code"] is not None:
                r = self.hosts[i]
                r.exit_code, r.ended_at, r.reason = got["code"], got["ended"], S.exit_reason(got["code"])
        self.pending.clear()

    def _dump_and_stop(self, outcome: str, why: str) -> None:
        """Every pending host's Python stacks into its log directory, then stop them all."""
        import ray

        self.outcome = outcome
        self.sink.progress(f"{why}: dumping every host's Python stacks (py-spy)")
        order = sorted(self.pending)
        dumps = []
        for i in order:
            try:
                dumps.append(ray.get(self.agents[i].dump_stacks.remote(), timeout=40))
            except Exception as e:  # noqa: BLE001
                dumps.append(f"(no dump: {e})")
        where: dict[str, list[int]] = {}
        for i, text in zip(order, dumps):
            p = self.plan.hosts[i].process_index
            path = attempt_dir(self.plan) / f"host-{p}.stacks.txt"
            path.write_text(text)
            self.hosts[i].stacks = str(path)
            where.setdefault(innermost_frame(text), []).append(p)
        parts = "; ".join(f"host{'s' if len(ps) > 1 else ''} {','.join(map(str, ps))}: in {frame}"
                          for frame, ps in where.items())
        self.note = f"{why}; stacks in {attempt_dir(self.plan)}/host-<i>.stacks.txt ({parts})"
        self.stop_all("timed out")

    def _head_lost(self) -> None:
        """The Ray head (GCS) is gone: no Ray call can stop the hosts, so stop local ones directly."""
        from tpulaunch.cluster.connect import forget_cluster

        self.outcome = S.LOST
        self.head_lost = True
        forget_cluster()
        head = next((i for i in self.pending if self.plan.hosts[i].slice_index == 0 and self.plan.hosts[i].worker_id == 0),
                    min(self.pending))
        self.sink.progress(f"the Ray head at {self.gcs} stopped answering: head node lost")
        r = self.hosts[head]
        r.lost, r.reason = True, "head node lost (the Ray head stopped answering)"
        for i in self.pending - {head}:
            self.hosts[i].stopped_by_tpulaunch = True
            self.hosts[i].reason = "stopped by tpulaunch (the Ray head was lost)"
        if self.plan.emulated:
            from tpulaunch.cluster.processes import stop_run_processes

            stop_run_processes(self.plan.run_id, self.limits.grace_s)
        self.pending.clear()

    def release(self) -> None:
        """Every agent forgets the run; on a cluster that stays up each starts a spare for the next."""
        import ray

        warm = self.limits.keep_warm and not self.plan.command
        refs = [a.release.remote(warm, self.plan.framework, h.env) for a, h in zip(self.agents, self.plan.hosts)]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=15)
        except Exception:  # noqa: BLE001 - an agent lost with its node
            pass

    def debug(self, message: str) -> None:
        if self.limits.debug:
            self.sink.progress(message)

    # -- the result ----------------------------------------------------------------------------

    def result(self, wall_s: float) -> S.Attempt:
        first = S.first_failure(self.hosts)
        outcome = self.outcome or S.outcome_of(first)
        if outcome == S.LOST and first is not None and not first.lost:
            first = next((h for h in self.hosts if h.lost), first)
        signum = self.interrupts.received
        code = S.exit_code_for(outcome, first, signum)
        import signal as _signal

        return S.Attempt(
            index=self.plan.attempt, outcome=outcome, exit_code=code, hosts=self.hosts,
            log_dir=str(attempt_dir(self.plan)), first_failure=asdict(first) if first else None,
            note=self.note, wall_s=wall_s, timings=self.timings,
            signal=_signal.Signals(signum).name if outcome == S.INTERRUPTED and signum else None,
        )


_FRAME = re.compile(r"^\s+(\S.*\(.*:\d+\))\s*$")


def innermost_frame(dump: str) -> str:
    """The innermost frame of the main thread in a `py-spy dump` ("wait_forever (hang.py:5)")."""
    lines = dump.splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith("Thread") and "MainThread" in line), None)
    for line in lines[(start + 1) if start is not None else 0:]:
        m = _FRAME.match(line)
        if m:
            frame = m.group(1)
            return re.sub(r"\(([^()]*/)?([^/()]+:\d+)\)$", r"(\2)", frame)
    return "an unknown place (no Python stack)"


def _reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False
