"""Goodput: how much of a run's wall time went into steps that counted, and where the rest went.

A pure function of the run's timeline (`run/timeline.py`), on the launcher's clock. The buckets
partition the wall time (they add up to it; `idle` is what none of the others explains):

    provisioning            capacity requested until ready (slices made for the run)
    cluster_start           starting (or connecting to) the Ray cluster
    preflight               the checks of every host before the first attempt's scripts
    host_start              placing the first attempt's agents and starting its host processes
    startup_to_first_step   imports, runtime init, first compile: host start to the first step
    productive              steps that count (not redone later), saves excluded
    checkpoint              time in saves marked with `heartbeat(step=N, checkpoint=True)`
    wasted_progress         steps redone after a failure or preemption (beyond the resume point)
    recovery                from a failure to the next attempt's first step (re-creation,
                            preflight, restart, the new attempt's start-up included)
    script                  a script's time that no step report splits (no `heartbeat(step=N)`)
    idle                    what none of these explains

A step is counted from the end of the one before it (`heartbeat(step=N)` comes when step N is
done); the save that made the resume point counts as checkpoint time, the steps after it as redone.
The resume point of an attempt is the last checkpoint the failed attempt marked below the steps
the next attempt reports (without marks: the next attempt's first reported step, less one).
Step times between the sampled reports are interpolated; the steps of one host (the lowest
process index that reports) stand for the run's, as SPMD hosts step in lockstep.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise

from tpulaunch.run.record.events import Event

SCHEMA = "tpulaunch.goodput/v1"
BUCKETS = ("provisioning", "cluster_start", "preflight", "host_start", "startup_to_first_step", "productive",
           "checkpoint", "wasted_progress", "recovery", "script", "idle")


@dataclass
class Goodput:
    run_id: str
    wall_s: float
    buckets: dict[str, float]
    attempts: list[dict]
    unseen: dict[str, str] = field(default_factory=dict)  # bucket -> why it could not be seen
    ongoing: bool = False

    @property
    def steps_seen(self) -> bool:
        """Whether any attempt reported a step: without one, the steps' time is not told from the
        rest of the script's, and a goodput of 0 would be a claim, not a measure."""
        return any("first_step" in a for a in self.attempts)

    @property
    def goodput(self) -> float | None:
        """productive / wall; None when no step was reported."""
        if not self.steps_seen:
            return None
        return self.buckets["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        good = self.goodput
        return {"schema": SCHEMA, "run_id": self.run_id, "wall_s": round(self.wall_s, 3),
                "goodput": None if good is None else round(good, 4), "ongoing": self.ongoing,
                "buckets": {k: round(v, 3) for k, v in self.buckets.items()}, "attempts": self.attempts,
                "unseen": self.unseen}

    def line(self) -> str:
        """One line for the end of a run and `status`."""
        top = sorted(((v, k) for k, v in self.buckets.items() if k not in ("productive",) and v >= 0.05), reverse=True)
        rest = ", ".join(f"{k} {v:.1f} s" for v, k in top[:3])
        so_far = " so far" if self.ongoing else ""
        good = self.goodput
        if good is None:
            said = "no step reported yet" if self.ongoing else "the script reported no step"
            return (f"goodput{so_far} unknown: {said} (`tpulaunch.heartbeat(step=N)` counts them);"
                    f" {self.wall_s:.1f} s in all" + (f" ({rest})" if rest else ""))
        return (f"goodput{so_far} {100 * good:.0f}%: productive {self.buckets['productive']:.1f} s of"
                f" {self.wall_s:.1f} s" + (f" ({rest})" if rest else ""))


def _interp(samples: list[tuple[float, int]], step: float) -> float | None:
    """The time a host reached `step`, from its (time, step) samples (extrapolated at the ends)."""
    if not samples:
        return None
    earliest: dict[int, float] = {}
    for t, s in samples:
        earliest[s] = min(t, earliest.get(s, t))
    pts = sorted(((t, s) for s, t in earliest.items()), key=lambda p: p[1])
    if len(pts) == 1:
        return pts[0][0]
    for (t0, s0), (t1, s1) in pairwise(pts):
        if s0 <= step <= s1 and s1 > s0:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    (t0, s0), (t1, s1) = (pts[0], pts[1]) if step < pts[0][1] else (pts[-2], pts[-1])
    if s1 == s0:
        return t0 if step < pts[0][1] else t1
    return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def analyze(events: list[dict], now: float | None = None) -> Goodput:
    """The buckets of a run (or of a run going on, up to `now`)."""
    ev = sorted(events, key=lambda e: e["t"])
    first = next((e for e in ev if e["kind"] == Event.RUN_START), ev[0] if ev else {"t": 0.0})
    end = next((e for e in reversed(ev) if e["kind"] == Event.RUN_END), None)
    t_start = float(first["t"])
    t_end = float(end["t"]) if end else (time.time() if now is None else now)
    b = {k: 0.0 for k in BUCKETS}
    unseen: dict[str, str] = {}

    def spans(start: str, stop: str, **match: object) -> float:
        out, opened = 0.0, None
        for e in ev:
            if any(e.get(k) != v for k, v in match.items()):
                continue
            if e["kind"] == start:
                opened = e["t"]
            elif e["kind"] == stop and opened is not None:
                out += e["t"] - opened
                opened = None
        return out

    b["provisioning"] = spans(Event.CAPACITY_REQUESTED, Event.CAPACITY_READY)
    if not any(e["kind"] == Event.CAPACITY_REQUESTED for e in ev):
        unseen["provisioning"] = "this run requested no capacity (its slices were there before it, or emulated)"
    b["cluster_start"] = spans(Event.CLUSTER_START, Event.CLUSTER_READY)

    attempts = sorted({e["attempt"] for e in ev if e["kind"] == Event.ATTEMPT_START})
    by = {a: [e for e in ev if e.get("attempt") == a] for a in attempts}
    out_attempts: list[dict] = []
    failed_at: float | None = None  # when the previous attempt's failure happened
    for n, a in enumerate(attempts):
        es = by[a]
        a_start = next(e["t"] for e in es if e["kind"] == Event.ATTEMPT_START)
        a_end_e = next((e for e in es if e["kind"] == Event.ATTEMPT_END), None)
        a_end = a_end_e["t"] if a_end_e else t_end
        pf_s = spans(Event.PREFLIGHT_START, Event.PREFLIGHT_END, attempt=a)
        starts = [e["t"] for e in es if e["kind"] == Event.HOST_START]
        hosts_up = max(starts) if starts else a_end
        steppers = sorted({e["host"] for e in es if e["kind"] == Event.STEP})
        ends = {e["host"]: e for e in es if e["kind"] == Event.HOST_END}
        failed_ends = [e["t"] for e in ends.values() if e.get("failed")]
        this_failed = bool(a_end_e and a_end_e.get("outcome") not in ("ok", "interrupted")) and n + 1 < len(attempts)
        row: dict = {"attempt": a, "start": round(a_start - t_start, 3), "end": round(a_end - t_start, 3),
                     "outcome": a_end_e.get("outcome") if a_end_e else "running"}
        if not steppers:
            # no step reports: start-up and the script's time, unsplit
            stop = (min(failed_ends) if (this_failed and failed_ends)
                    else max((e["t"] for e in ends.values()), default=a_end))
            stop = min(max(stop, hosts_up), a_end)
            if n == 0 or failed_at is None:
                b["preflight"] += pf_s
                b["host_start"] += max(0.0, hosts_up - a_start - pf_s)
            else:
                b["recovery"] += max(0.0, hosts_up - failed_at)
            b["script"] += max(0.0, stop - hosts_up)
            row.update(script_s=round(stop - hosts_up, 3))
            failed_at = stop if this_failed else None
            out_attempts.append(row)
            for k in ("productive", "wasted_progress", "checkpoint", "startup_to_first_step"):
                unseen[k] = "the script never called tpulaunch.heartbeat(step=N)"
            continue
        ref = steppers[0]
        samples = [(e["t"], int(e["step"])) for e in es if e["kind"] == Event.STEP and e["host"] == ref]
        end_e = ends.get(ref)
        if end_e and end_e.get("step") is not None:
            samples.append((end_e["t"], int(end_e["step"])))
        ckpts = [(int(e["step"]), float(e.get("save_s") or 0.0)) for e in es
                 if e["kind"] == Event.CHECKPOINT and e["host"] == ref]
        # where this attempt began stepping: its first reported step (as the host timed it)
        firsts = [(e["t"], int(e["step"])) for e in es
                  if e["kind"] == Event.STEP and e["host"] == ref and e.get("first")]
        s0, t_first = ((firsts[0][1], firsts[0][0]) if firsts
                       else (min(s for _, s in samples), min(t for t, _ in samples)))
        # a step is reported when it is done: the first one began a step's time earlier (at the
        # later steps' pace: a slow first step, its compile, is start-up)
        if firsts:
            samples.append((t_first, s0))
        t_first = max(hosts_up, min(t_first, _interp(samples, s0 - 1) or t_first))
        stop = min(failed_ends) if (this_failed and failed_ends) else (end_e["t"] if end_e else a_end)
        stop = min(max(stop, t_first), a_end)
        if n == 0 or failed_at is None:
            b["preflight"] += pf_s
            b["host_start"] += max(0.0, hosts_up - a_start - pf_s)
            b["startup_to_first_step"] += t_first - hosts_up
        else:
            b["recovery"] += max(0.0, t_first - failed_at)
            row["recovery_s"] = round(max(0.0, t_first - failed_at), 3)  # from the last failure to this first step
        resume = None
        if this_failed:
            nxt = [int(e["step"]) for e in by[attempts[n + 1]] if e["kind"] == Event.STEP]
            lowest_next = min(nxt) if nxt else None
            marked = [s for s, _ in ckpts if lowest_next is None or s < lowest_next]
            resume = max(marked) if marked else ((lowest_next - 1) if lowest_next is not None else None)
        saved_at = next((e["t"] for e in es
                         if e["kind"] == Event.CHECKPOINT and e["host"] == ref and e["step"] == resume), None)
        t_resume = stop if resume is None else min(max(saved_at or _interp(samples, resume) or stop, t_first), stop)
        saves = sum(sec for s, sec in ckpts if resume is None or s <= resume)
        kept = max(0.0, t_resume - t_first)
        b["productive"] += max(0.0, kept - saves)
        b["checkpoint"] += min(saves, kept)
        b["wasted_progress"] += max(0.0, stop - t_resume)
        row.update(first_step=s0, resume_step=resume, last_step=max(s for _, s in samples),
                   productive_s=round(max(0.0, kept - saves), 3), wasted_s=round(stop - t_resume, 3))
        failed_at = stop if this_failed else None
        out_attempts.append(row)
    wall = max(0.0, t_end - t_start)
    b["idle"] = max(0.0, wall - sum(v for k, v in b.items() if k != "idle"))
    return Goodput(str(first.get("run_id", "")), wall, b, out_attempts, unseen, ongoing=end is None)
