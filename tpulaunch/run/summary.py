"""What a run produced: each host's result, each attempt, and which host failed first and why.

A run is a sequence of attempts of the whole slice. Each attempt has its own logs
(`runs/<id>/attempt-<k>/host-<i>.log`) and its first failure; `summary.json` lists them.

Which host failed first matters most when a host dies: its peers error out of the next collective
within milliseconds and exit too. So the first failure is decided when the attempt is over, from
when each failing host ended (its own clock) and, for a lost host (node or agent gone), the last
time the driver heard from it; a lost host is blamed before peers that ended after it went quiet.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass, field

from tpulaunch.errors import ExitCode

# Outcomes of an attempt, and the exit code each ends a run with (a failure: the host's own code).
OK, FAILED, LOST, PREEMPTED, TIMEOUT, STALLED, INTERRUPTED = (
    "ok", "failed", "lost", "preempted", "timeout", "stalled", "interrupted")
NEVER_RETRIED = (ExitCode.USAGE, ExitCode.BOOT_FAILED)  # and TPU_BUSY without --kill-stale


def exit_reason(code: int) -> str:
    """`exit 3`, or `killed by signal 9 (SIGKILL)` for the shell's 128+N."""
    if 128 < code < 128 + 65:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = "?"
        return f"killed by signal {code - 128} ({name})"
    return f"exit {code}"


@dataclass
class HostResult:
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


@dataclass
class Attempt:
    index: int
    outcome: str  # one of OK, FAILED, LOST, PREEMPTED, TIMEOUT, STALLED, INTERRUPTED
    exit_code: int
    hosts: list[HostResult]
    log_dir: str
    first_failure: dict | None = None
    note: str | None = None  # the one line that says what happened (timeouts: who was stuck where)
    wall_s: float = 0.0
    timings: dict = field(default_factory=dict)
    signal: str | None = None  # SIGINT / SIGTERM when interrupted

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunSummary:
    run_id: str
    exit_code: int
    emulated: bool
    slices: list[dict]
    mesh: dict
    hosts: list[HostResult]  # the last attempt's
    first_failure: dict | None  # the last attempt's (what decided the exit code)
    log_dir: str
    wall_s: float
    timings: dict = field(default_factory=dict)
    interrupted: str | None = None
    outcome: str = OK
    attempts: list[dict] = field(default_factory=list)
    restarts: int = 0
    preemptions: int = 0
    note: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema"] = "tpulaunch.summary/v2"
        return d


def first_failure(hosts: list[HostResult]) -> HostResult | None:
    """The host that failed first: lost by when it was last heard from, others by when they ended."""
    def when(h: HostResult) -> float:
        return (h.last_seen if h.lost else h.ended_at) or float("inf")

    failed = [h for h in hosts if h.lost or h.preempted or (
        h.exit_code not in (None, 0) and not h.stopped_by_tpulaunch)]
    return min(failed, key=lambda h: (when(h), not h.lost, h.process_index)) if failed else None


def outcome_of(h: HostResult | None) -> str:
    if h is None:
        return OK
    if h.preempted:
        return PREEMPTED
    return LOST if h.lost else FAILED


def exit_code_for(outcome: str, first: HostResult | None, signum: int | None = None) -> int:
    if outcome == OK:
        return 0
    if outcome in (LOST, PREEMPTED):
        return ExitCode.HOST_LOST
    if outcome in (TIMEOUT, STALLED):
        return ExitCode.TIMEOUT
    if outcome == INTERRUPTED:
        return ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.TERMINATED
    return (first.exit_code if first and first.exit_code else 1)
