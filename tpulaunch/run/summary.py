"""What a run produced: each host's result, each attempt, who failed first, and the exit code.

A run is a sequence of attempts of the whole slice. Each attempt has its own logs
(`runs/<id>/attempt-<k>/host-<i>.log`) and its first failure; `summary.json` lists them.

Which host failed first matters most when a host dies: its peers error out of the next collective
within milliseconds and exit too. So the first failure is decided when the attempt is over, from
when each failing host ended (its own clock) and, for a lost host (node or agent gone), the last
time the driver heard from it; a lost host is blamed before peers that ended after it went quiet.

Exit codes come from one table (`exit_code_for`), the README's.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass, field
from enum import Enum

from tpulaunch.errors import ExitCode
from tpulaunch.providers.base import Recreation
from tpulaunch.run.hang import Hang


class Outcome(str, Enum):
    """How an attempt (and so a run) ended."""

    OK = "ok"
    FAILED = "failed"  # a host's process exited non-zero (or was killed by a signal)
    LOST = "lost"  # a host's node or agent died, or the Ray head went away
    PREEMPTED = "preempted"  # a host was told it is going away (GCE notice, SIGTERM to its agent)
    TIMEOUT = "timeout"  # --timeout
    STALLED = "stalled"  # --stall-timeout
    INTERRUPTED = "interrupted"  # SIGINT / SIGTERM to tpulaunch
    PREFLIGHT = "preflight"  # the checks before any script found what would make the run hang or fail
    GROWN = "grown"  # stopped by tpulaunch to grow back to slices that returned (`--min-slices`): not a failure

    def __str__(self) -> str:
        return self.value


class Cause(str, Enum):
    """Why one host ended (the reason line says it in words)."""

    EXITED = "exited"  # its process ended by itself: `exit N` or `killed by signal N`
    STOPPED = "stopped"  # tpulaunch stopped it (fail fast, a timeout, a signal)
    PREEMPTED = "preempted"
    NODE_LOST = "node-lost"
    AGENT_DIED = "agent-died"
    UNREACHABLE = "unreachable"  # its agent answered no poll for too long
    HEAD_LOST = "head-lost"  # the Ray head went away with this host's node (worker 0)
    NOT_STARTED = "not-started"  # it never started (refused: a busy TPU, a command not found)

    def __str__(self) -> str:
        return self.value


SUMMARY_SCHEMA = "tpulaunch.summary/v2"

# Exits no restart can mend: bad input, a framework that cannot boot, a busy TPU (without --kill-stale).
NEVER_RETRIED = (ExitCode.USAGE, ExitCode.BOOT_FAILED)


@dataclass
class HostResult:
    """One host in one attempt (filled in while the attempt runs)."""

    process_index: int
    slice_index: int
    worker_id: int
    exit_code: int | None = None
    reason: str | None = None  # exit N, killed by signal N, node lost, agent died, preempted (...)
    wall_s: float = 0.0
    node_ip: str | None = None
    log: str = ""
    stacks: str | None = None  # where `py-spy dump` of this host went (timeouts)
    stopped_by_tpulaunch: bool = False
    lost: bool = False
    preempted: str | None = None
    ended_at: float | None = None  # when the host process ended (its host's clock)
    last_seen: float | None = None  # when the driver last heard from it (driver clock)
    phases: dict = field(default_factory=dict)  # import_s, boot_s, mesh_s (from the host's bootstrap)
    cause: Cause | None = None
    step: int | None = None  # the last step it reported (`tpulaunch.heartbeat(step=N)`)
    step_rate: float | None = None  # steps/s from its first reported step to its last, in this attempt
    rank: int | None = None  # a host of one process per device (torch_tpu): the rank that failed it
    went_with: int | None = None  # went with its slice, lost or preempted through this host (never blamed first)

    @property
    def failed(self) -> bool:
        """Whether it counts as a failure of the attempt (not when it exited 0, or was stopped by
        tpulaunch after another failed)."""
        return self.lost or bool(self.preempted) or (self.exit_code not in (None, 0) and not self.stopped_by_tpulaunch)

    @staticmethod
    def from_dict(d: dict) -> HostResult:
        known = {f for f in HostResult.__dataclass_fields__}
        doc = {k: v for k, v in d.items() if k in known}
        return HostResult(**{**doc, "cause": Cause(doc["cause"]) if doc.get("cause") else None})


@dataclass
class Attempt:
    index: int
    outcome: Outcome
    exit_code: int
    hosts: list[HostResult]
    log_dir: str
    first_failure: HostResult | None = None
    note: str | None = None  # the one line that says what happened (timeouts: who was stuck where)
    wall_s: float = 0.0
    timings: dict = field(default_factory=dict)
    signal: str | None = None  # SIGINT / SIGTERM when interrupted
    findings: list[dict] = field(default_factory=list)  # preflight: errors and warnings, by host
    recreated: list[Recreation] = field(default_factory=list)  # --recreate: the slices made again after it
    hang: Hang | None = None  # a stall's triage: the culprits, where they are, where the others wait
    replaced: list[dict] = field(default_factory=list)  # --replace-hung / spares: the slices swapped out after it
    slices: list[str] = field(default_factory=list)  # the slices it ran on (fewer than the run's after a shrink)
    reason: str = "first"  # why it ran: first, restart, preemption, shrink, grow

    @property
    def who(self) -> str | None:
        """What ended it in a few words, the first host to fail or the attempt's note."""
        return self.blamed if self.first_failure is not None else self.note

    @property
    def blamed(self) -> str:
        """Whom a progress line about the next attempt names: the first host to fail, else the attempt."""
        f = self.first_failure
        return f"host {f.process_index} {f.reason}" if f is not None else "the attempt"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recreated"] = [r.to_dict() for r in self.recreated]
        d.pop("hang")
        if self.hang is not None:
            d["hang"] = self.hang.to_dict()
        if not self.replaced:
            d.pop("replaced")
        return d

    @staticmethod
    def from_dict(d: dict) -> Attempt:
        hosts = [HostResult.from_dict(h) for h in d.get("hosts") or ()]
        first = d.get("first_failure")
        return Attempt(
            index=d["index"], outcome=Outcome(d["outcome"]), exit_code=d["exit_code"], hosts=hosts,
            log_dir=d.get("log_dir", ""), first_failure=HostResult.from_dict(first) if first else None,
            note=d.get("note"), wall_s=d.get("wall_s", 0.0), timings=dict(d.get("timings") or {}),
            signal=d.get("signal"), findings=list(d.get("findings") or ()),
            recreated=[Recreation.from_dict(r) for r in d.get("recreated") or ()],
            hang=Hang.from_dict(d["hang"]) if d.get("hang") else None, replaced=list(d.get("replaced") or ()),
            slices=list(d.get("slices") or ()), reason=d.get("reason", "first"))


@dataclass
class RunSummary:
    run_id: str
    exit_code: int
    emulated: bool
    slices: list[dict]
    mesh: dict
    hosts: list[HostResult]  # the last attempt's
    first_failure: HostResult | None  # the last attempt's (what decided the exit code)
    log_dir: str
    wall_s: float
    timings: dict = field(default_factory=dict)
    interrupted: str | None = None
    outcome: Outcome = Outcome.OK
    attempts: list[Attempt] = field(default_factory=list)
    restarts: int = 0
    preemptions: int = 0
    note: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["attempts"] = [a.to_dict() for a in self.attempts]
        d["schema"] = SUMMARY_SCHEMA
        return d

    @staticmethod
    def from_dict(d: dict) -> RunSummary:
        """A `summary.json` (`tpulaunch.summary/v2`) read back: what a run on a cluster's head ended with."""
        if d.get("schema") != SUMMARY_SCHEMA:
            raise ValueError(f"not a {SUMMARY_SCHEMA} document: {str(d.get('schema'))[:80]!r}")
        first = d.get("first_failure")
        return RunSummary(
            run_id=d["run_id"], exit_code=d["exit_code"], emulated=d["emulated"], slices=list(d.get("slices") or ()),
            mesh=dict(d.get("mesh") or {}), hosts=[HostResult.from_dict(h) for h in d.get("hosts") or ()],
            first_failure=HostResult.from_dict(first) if first else None, log_dir=d.get("log_dir", ""),
            wall_s=d.get("wall_s", 0.0), timings=dict(d.get("timings") or {}), interrupted=d.get("interrupted"),
            outcome=Outcome(d.get("outcome", "ok")), attempts=[Attempt.from_dict(a) for a in d.get("attempts") or ()],
            restarts=d.get("restarts", 0), preemptions=d.get("preemptions", 0), note=d.get("note"))


def first_failure(hosts: list[HostResult]) -> HostResult | None:
    """The host that failed first: lost by when it was last heard from, others by when they ended."""
    def when(h: HostResult) -> float:
        return (h.last_seen if h.lost else h.ended_at) or float("inf")

    failed = [h for h in hosts if h.failed]
    return (min(failed, key=lambda h: (h.went_with is not None, when(h), not h.lost, h.process_index)) if failed
            else None)


def outcome_of(h: HostResult | None) -> Outcome:
    if h is None:
        return Outcome.OK
    if h.preempted:
        return Outcome.PREEMPTED
    return Outcome.LOST if h.lost else Outcome.FAILED


def exit_code_for(outcome: Outcome, first: HostResult | None, signum: int | None = None) -> int:
    """The exit code a run ends with (the README's table): a failure ends with its host's code."""
    if outcome is Outcome.FAILED:
        return first.exit_code if first and first.exit_code else 1
    if outcome is Outcome.INTERRUPTED:
        return ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.TERMINATED
    return {
        Outcome.OK: ExitCode.OK,
        Outcome.LOST: ExitCode.HOST_LOST,
        Outcome.PREEMPTED: ExitCode.HOST_LOST,
        Outcome.TIMEOUT: ExitCode.TIMEOUT,
        Outcome.STALLED: ExitCode.TIMEOUT,
        Outcome.PREFLIGHT: ExitCode.PREFLIGHT,
        Outcome.GROWN: ExitCode.OK,
    }[outcome]


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
