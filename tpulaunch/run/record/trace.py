"""A run's timeline in the Chrome trace event format (opens in Perfetto and chrome://tracing). Pure.

One process (the run); one track (thread) for the launcher and one per host. The launcher's
track holds the cluster's start, each attempt and each re-creation as spans; a host's track
holds, per attempt, its start-up (host start to first step), its steps (to its end) and
instants for its checkpoints and failure; its step number is a counter.
"""

from __future__ import annotations

from typing import Any

from tpulaunch.run.record.events import Event

LAUNCHER = 0


def _us(t: float, t0: float) -> int:
    return int(round((t - t0) * 1e6))


def chrome_trace(events: list[dict]) -> dict:
    ev = sorted(events, key=lambda e: e["t"])
    if not ev:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = ev[0]["t"]
    out: list[dict[str, Any]] = []
    hosts = sorted({e["host"] for e in ev if isinstance(e.get("host"), int)})
    out.append({"ph": "M", "name": "process_name", "pid": 1, "tid": LAUNCHER, "args": {"name": "tpulaunch run"}})
    out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": LAUNCHER, "args": {"name": "launcher"}})
    for h in hosts:
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": h + 1, "args": {"name": f"host {h}"}})

    def span(name: str, start: float, end: float, tid: int, **args: Any) -> None:
        out.append({"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": _us(start, t0),
                    "dur": max(0, _us(end, t0) - _us(start, t0)), "args": args})

    opened: dict[tuple[str, Any], dict] = {}
    for e in ev:
        k = e["kind"]
        if k in (Event.CLUSTER_START, Event.ATTEMPT_START, Event.RECREATE_START, Event.PREFLIGHT_START):
            opened[(Event(k).span, e.get("attempt"))] = e
        elif k in (Event.CLUSTER_READY, Event.ATTEMPT_END, Event.RECREATE_END, Event.PREFLIGHT_END):
            base = "cluster" if k == Event.CLUSTER_READY else Event(k).span
            start = opened.pop((base, e.get("attempt")), None)
            if start is not None:
                name = {"cluster": f"cluster ({e.get('how', '')})", "attempt": f"attempt {e.get('attempt')}",
                        "recreate": "re-create " + ",".join(e.get("slices") or []), "preflight": "preflight"}[base]
                span(name, start["t"], e["t"], LAUNCHER, **{x: y for x, y in e.items() if x not in ("t", "kind")})
        elif k == Event.STEP:
            out.append({"ph": "C", "name": f"step (host {e['host']})", "pid": 1, "tid": e["host"] + 1,
                        "ts": _us(e["t"], t0), "args": {"step": e["step"]}})
        elif k == Event.CHECKPOINT:
            out.append({"ph": "i", "s": "t", "name": f"checkpoint {e['step']}", "pid": 1, "tid": e["host"] + 1,
                        "ts": _us(e["t"], t0), "args": {"save_s": e.get("save_s")}})
        elif k == Event.RUN_END:
            out.append({"ph": "i", "s": "p", "name": f"end: {e.get('outcome')} (exit {e.get('exit_code')})",
                        "pid": 1, "tid": LAUNCHER, "ts": _us(e["t"], t0)})
    # each host's start-up and stepping, per attempt
    for a in sorted({e["attempt"] for e in ev if e["kind"] == Event.ATTEMPT_START}):
        for h in hosts:
            mine = [e for e in ev if e.get("attempt") == a and e.get("host") == h]
            start = next((e["t"] for e in mine if e["kind"] == Event.HOST_START), None)
            first = next((e["t"] for e in mine if e["kind"] == Event.STEP), None)
            end = next((e for e in mine if e["kind"] == Event.HOST_END), None)
            if start is not None and first is not None:
                span("start-up", start, first, h + 1, attempt=a)
            if end is not None:
                begin = first if first is not None else start
                if begin is not None:
                    span("steps" if first is not None else "script", begin, end["t"], h + 1, attempt=a,
                         exit_code=end.get("exit_code"), last_step=end.get("step"))
                if end.get("failed"):
                    out.append({"ph": "i", "s": "t", "name": f"failed (exit {end.get('exit_code')})", "pid": 1,
                                "tid": h + 1, "ts": _us(end["t"], t0)})
    return {"traceEvents": out, "displayTimeUnit": "ms"}
