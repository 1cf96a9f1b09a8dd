"""The decisions of one attempt while it runs, as a pure state machine (no Ray, no processes, no clock).

The supervision loop (`run.execute`) gathers facts (agents' replies, hosts gone, the Ray head's
probes, signals, the time) and hands each to `AttemptWatch`, which answers with what to do:

* `StopOthers`: a host failed, was lost or is being preempted: stop every other host (fail fast);
* `StopAll`: the attempt ends for everyone: a signal, `--timeout`, `--stall-timeout` (with a stack
  dump first), or the Ray head gone;
* nothing: carry on.

When the attempt is over, `result()` decides its outcome, first failure and exit code.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

from tpulaunch.host.protocol import PollReply
from tpulaunch.host.ranks import FAILED_RE as RANK_FAILED_RE
from tpulaunch.procfs import exit_reason
from tpulaunch.run.hang import LIBTPU_HANG, Hang
from tpulaunch.run.status import HostPhase, HostView
from tpulaunch.run.steps import StepRates
from tpulaunch.run.summary import Attempt, Cause, HostResult, Outcome, exit_code_for, first_failure, outcome_of

HEAD_LOST_AFTER = 3  # consecutive refused probes of the Ray head (GCS)


@dataclass(frozen=True)
class StopOthers:
    """Fail fast: stop `hosts` (every one still running); `grace_s` None is the run's usual grace."""

    why: str
    hosts: tuple[int, ...]
    grace_s: float | None = None


@dataclass(frozen=True)
class StopAll:
    """End the attempt: stop `hosts` (every one still running). `dump_stacks`: py-spy them first."""

    outcome: Outcome
    why: str
    hosts: tuple[int, ...]
    dump_stacks: bool = False
    head_lost: bool = False  # no Ray call can reach the hosts any more


Action = StopOthers | StopAll | None


@dataclass(frozen=True)
class StopRules:
    """The stop conditions the watch checks (times are the loop's monotonic clock)."""

    deadline: float | None = None  # --timeout
    stall_timeout_s: float | None = None  # --stall-timeout
    preemption_grace_s: float = 30.0
    straggler_ratio: float = 0.7  # --straggler-ratio (0: never name a straggler)


class AttemptWatch:
    """Facts in, decisions out, for the hosts of one attempt (see the module docstring)."""

    def __init__(self, attempt: int, hosts: list[HostResult], rules: StopRules, now: float) -> None:
        self.attempt = attempt
        self.hosts = hosts
        self.rules = rules
        # facts for the run's timeline (steps, checkpoints), recorded as they come; decides nothing
        self.on_step: Callable[[int, PollReply, float], None] | None = None  # (host, reply, when it came)
        # elastic: asked each check whether to end the attempt and grow back (a reason, or None)
        self.grow: Callable[[AttemptWatch, float], str | None] | None = None
        self.saved: dict[int, tuple[int, float]] = {}  # host -> (step, when: the loop's clock) of its last checkpoint
        self.pending: set[int] = set(range(len(hosts)))
        self.activity = {i: now for i in self.pending}  # when the loop last saw a sign of life
        self.beat = {i: 0.0 for i in self.pending}  # the host's own last-activity stamp
        self.outcome: Outcome | None = None  # set when a stop condition ended the attempt
        self.note: str | None = None
        self.signal: int | None = None
        self.failed_fast = False
        self.head_refusals = 0
        self.last_line: dict[int, str] = {}
        self.findings: list[dict] = []  # preflight's, errors and warnings
        self.last_activity: dict[int, float] = {}  # the host's own clock: its last line or heartbeat
        self.steps = StepRates(len(hosts))
        self.hang: Hang | None = None  # a stall's triage, set when the stacks were taken

    # -- facts ---------------------------------------------------------------------------------

    def started(self, wall_now: float) -> None:
        for r in self.hosts:
            r.last_seen = wall_now

    def on_reply(self, i: int, reply: PollReply, now: float, wall_now: float) -> Action:
        """Host `i` answered a poll (its lines are written by the loop)."""
        r = self.hosts[i]
        r.last_seen = wall_now
        if reply.lines or reply.activity > self.beat[i]:
            self.activity[i] = now
        self.beat[i] = reply.activity
        self.last_activity[i] = reply.activity
        libtpu_hang: str | None = None
        if reply.lines:
            self.last_line[i] = reply.lines[-1][1]
            libtpu_hang = next((text for _stream, text in reply.lines if LIBTPU_HANG.search(text)), None)
            if r.rank is None:
                for _stream, text in reply.lines:
                    m = RANK_FAILED_RE.match(text)
                    if m:  # the host's process names the process of its that failed first
                        r.rank, r.reason = int(m.group(1)), f"rank {m.group(1)} (local rank {m.group(3)}) {m.group(4)}"
                        break
        if reply.checkpoint is not None:
            self.saved[i] = (reply.checkpoint[0], now - reply.checkpoint[2])
        if reply.step is not None:
            self.steps.record(i, reply.step, now)
            r.step, r.step_rate = reply.step, self.steps.overall(i)
        if self.on_step is not None and reply.step is not None:
            self.on_step(i, reply, wall_now)
        r.wall_s = reply.wall_s
        action: Action = None
        if reply.preempted and not r.preempted:
            r.preempted = reply.preempted
            self._slice_goes(i, f"host {r.process_index} preempted: {reply.preempted}")
            action = self._fail_fast(f"host {r.process_index} is preempted ({reply.preempted})",
                                     grace_s=self.rules.preemption_grace_s, source=i)
        # libtpu's own hang report, unless the attempt is ending already
        hang = libtpu_hang if self.pending and self.outcome is None else None
        if hang is not None:
            self.outcome = Outcome.STALLED
            self.failed_fast = True  # the hang ends the attempt, not this host's abort after its report
        if reply.code is not None:  # (with a hang report: libtpu aborted it as it reported; its end is kept)
            r.phases = dict(reply.phases)
            action = self._ended(i, reply.code, reply.ended or wall_now) or action
        if hang is not None:
            return StopAll(Outcome.STALLED, f"libtpu reported a hang on host {r.process_index}: {hang[:160]}",
                           self._stop(self.pending), dump_stacks=True)
        return action

    def on_gone(self, i: int, cause: Cause, why: str) -> Action:
        """Host `i`'s agent or node is gone (`cause`), or stopped answering."""
        if i not in self.pending:
            return None
        r = self.hosts[i]
        r.lost, r.reason, r.cause = True, why, cause
        self.pending.discard(i)
        self._slice_goes(i, f"host {r.process_index} lost: {why}")
        return self._fail_fast(f"host {r.process_index} lost ({why})")

    def on_head_probe(self, reachable: bool, head_host: int) -> Action:
        """One probe of the Ray head: `HEAD_LOST_AFTER` refusals in a row and the head is gone."""
        self.head_refusals = 0 if reachable else self.head_refusals + 1
        if self.head_refusals < HEAD_LOST_AFTER or not self.pending:
            return None
        self.outcome = Outcome.LOST
        head = head_host if head_host in self.pending else min(self.pending)
        r = self.hosts[head]
        r.lost, r.reason, r.cause = True, "head node lost (the Ray head stopped answering)", Cause.HEAD_LOST
        others = self._stop(self.pending - {head})
        for i in others:
            self.hosts[i].reason = "stopped by tpulaunch (the Ray head was lost)"
            self.hosts[i].cause = Cause.STOPPED
        self.pending.clear()
        return StopAll(Outcome.LOST, "the Ray head stopped answering: head node lost", others, head_lost=True)

    def check(self, now: float, received_signal: int | None) -> Action:
        """Signals, --timeout and --stall-timeout, at time `now`."""
        if not self.pending:
            return None
        if received_signal is not None:
            self.outcome, self.signal = Outcome.INTERRUPTED, received_signal
            return StopAll(Outcome.INTERRUPTED, f"received {signal.Signals(received_signal).name}: stopping every host",
                           self._stop(self.pending))
        if self.rules.deadline is not None and now >= self.rules.deadline:
            self.outcome = Outcome.TIMEOUT
            return StopAll(Outcome.TIMEOUT, "the run reached its --timeout", self._stop(self.pending), dump_stacks=True)
        why = self.grow(self, now) if self.grow is not None and not self.failed_fast else None
        if why:
            self.outcome = Outcome.GROWN
            return StopAll(Outcome.GROWN, why, self._stop(self.pending))
        stall = self.rules.stall_timeout_s
        if stall and all(now - self.activity[i] >= stall for i in self.pending):
            self.outcome = Outcome.STALLED
            return StopAll(Outcome.STALLED, f"no output or heartbeat from any host for {stall:g} s",
                           self._stop(self.pending), dump_stacks=True)
        return None

    def saved_since(self, t: float) -> int | None:
        """The step of the newest checkpoint a host reported saved after `t` (the loop's clock), if any."""
        steps = [step for step, when in self.saved.values() if when >= t]
        return max(steps) if steps else None

    def stragglers(self, now: float) -> list[str]:
        """One line per host that fell behind the others' step rate since the last call (or is back
        to their pace)."""
        new, back = self.steps.stragglers(self.rules.straggler_ratio, now, self.pending)
        lines = []
        for s in new:
            p = self.hosts[s.process].process_index
            last = self.last_line.get(s.process, "")
            lines.append(f"host {p} is a straggler: {s.rate:.3g} steps/s, {s.rate / s.median:.2f}x the median host's"
                         f" {s.median:.3g} (at step {self.steps.last(s.process)})"
                         + (f"; its last line: {last[:120]}" if last else ""))
        for i in back:
            lines.append(f"host {self.hosts[i].process_index} is back to the others' pace")
        return lines

    def _stop(self, hosts: set[int]) -> tuple[int, ...]:
        """These hosts are being stopped by tpulaunch (their exit is not their failure)."""
        chosen = tuple(sorted(hosts))
        for i in chosen:
            self.hosts[i].stopped_by_tpulaunch = True
        return chosen

    # -- decisions -----------------------------------------------------------------------------

    def _ended(self, i: int, code: int, ended: float) -> Action:
        r = self.hosts[i]
        r.exit_code, r.ended_at = code, ended
        if r.reason is None:
            r.reason = exit_reason(code) if not r.preempted else f"preempted: {r.preempted}, then {exit_reason(code)}"
        if r.cause is None:
            r.cause = Cause.PREEMPTED if r.preempted else (Cause.STOPPED if r.stopped_by_tpulaunch else Cause.EXITED)
        self.pending.discard(i)
        if code != 0 and not r.stopped_by_tpulaunch:
            return self._fail_fast(f"host {r.process_index} {r.reason if r.rank is not None else exit_reason(code)}")
        return None

    def _slice_goes(self, i: int, why: str) -> None:
        """A slice is lost or preempted as one: every other host of host `i`'s slice goes with it (its
        end is the slice's preemption, not a failure of its own)."""
        s = self.hosts[i].slice_index
        for j, r in enumerate(self.hosts):
            if j != i and r.slice_index == s and not (r.lost or r.preempted):
                r.preempted, r.went_with = f"its slice went ({why})", self.hosts[i].process_index

    def _fail_fast(self, what: str, grace_s: float | None = None, source: int | None = None) -> Action:
        """Stop every host but `source` (a preempted host is ending by itself, in its grace period)."""
        if self.failed_fast:
            return None
        self.failed_fast = True
        others = self.pending - {source}
        if not others:
            return None
        return StopOthers(f"{what}: stopping the other hosts", self._stop(others), grace_s)

    def preflight_failed(self, findings: list[dict]) -> None:
        """The checks before the scripts found errors: no host starts."""
        self.outcome, self.findings = Outcome.PREFLIGHT, findings
        errors = [f for f in findings if f["severity"] == "error"]
        if errors:
            fix = f" {errors[0]['fix']}" if errors[0]["fix"] else ""
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            self.note = f"preflight: {errors[0]['what']}.{fix}{more}"
        for r in self.hosts:
            r.reason, r.cause = "not started (preflight)", Cause.NOT_STARTED
        self.pending.clear()

    def view(self, now: float) -> tuple[HostView, ...]:
        """Each host as `tpulaunch status` shows it, at `now` (the loop's clock)."""
        out = []
        for i, r in enumerate(self.hosts):
            if i in self.pending:
                phase = HostPhase.RUNNING if i in self.last_activity else HostPhase.STARTING
            elif r.lost:
                phase = HostPhase.LOST
            elif r.stopped_by_tpulaunch and r.exit_code not in (None, 0):
                phase = HostPhase.STOPPED
            else:
                phase = HostPhase.EXITED
            out.append(HostView(r.process_index, r.slice_index, r.worker_id, phase, r.exit_code,
                                self.last_activity.get(i), self.last_line.get(i, ""), r.reason, r.step,
                                self.steps.rate(i, now)))
        return tuple(out)

    def result(self, log_dir: str, wall_s: float, timings: dict) -> Attempt:
        first = first_failure(self.hosts)
        outcome = self.outcome or outcome_of(first)
        if outcome is Outcome.LOST and first is not None and not first.lost:
            first = next((h for h in self.hosts if h.lost), first)
        signum = self.signal
        return Attempt(
            index=self.attempt, outcome=outcome, exit_code=exit_code_for(outcome, first, signum), hosts=self.hosts,
            log_dir=log_dir, first_failure=first, note=self.note, wall_s=wall_s, timings=timings,
            signal=signal.Signals(signum).name if outcome is Outcome.INTERRUPTED and signum else None,
            findings=list(self.findings), hang=self.hang,
        )


_FRAME = re.compile(r"^\s+(\S.*\(.*:\d+\))\s*$")


def innermost_frame(dump: str) -> str:
    """The innermost frame of the main thread in a `py-spy dump` ("wait_forever (hang.py:5)")."""
    lines = dump.splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith("Thread") and "MainThread" in line), None)
    for line in lines[(start + 1) if start is not None else 0:]:
        m = _FRAME.match(line)
        if m:
            return re.sub(r"\(([^()]*/)?([^/()]+:\d+)\)$", r"(\2)", m.group(1))
    return "an unknown place (no Python stack)"


def where_hosts_are(dumps: dict[int, str]) -> str:
    """One line grouping hosts by the frame they are in: `host 2: in f (a.py:6); hosts 0,1,3: in g (b.py:9)`."""
    where: dict[str, list[int]] = {}
    for process, text in sorted(dumps.items()):
        where.setdefault(innermost_frame(text), []).append(process)
    return "; ".join(f"host{'s' if len(ps) > 1 else ''} {','.join(map(str, ps))}: in {frame}"
                     for frame, ps in where.items())
