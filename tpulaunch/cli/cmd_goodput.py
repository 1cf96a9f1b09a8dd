"""`tpulaunch goodput RUN` and `tpulaunch trace RUN -o FILE`: where a run's wall time went.

RUN: a run's log directory, a run id (a foreground run's under `--log-dir`, else a detached run's
on the cluster), or `last`: the newest run started from this machine, foreground or detached.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from tpulaunch.cli import app
from tpulaunch.cli import options as opt
from tpulaunch.cli.output import Output, host_color
from tpulaunch.errors import TpulaunchError
from tpulaunch.run.paths import RunPaths
from tpulaunch.run.record import goodput, timeline

RUN = typer.Argument("last", metavar="RUN", help="A run's directory, a run id, or `last`.")
LOG_DIR = typer.Option("runs", "--log-dir", help="Where this machine's foreground runs write their directories.")
ADDRESS = typer.Option("auto", "--address", help="The cluster of a detached run (auto: the one recorded here).")


def _local_newest(log_dir: str) -> tuple[float, Path] | None:
    found = [(p.stat().st_mtime, p) for p in Path(log_dir).glob("*/" + RunPaths.of(".").events.name) if p.is_file()]
    return max(found) if found else None


def _detached(run: str, address: str) -> tuple[str, list[dict]] | None:
    """A detached run's id and timeline, through the cluster's log API (None: no cluster known)."""
    from tpulaunch.client import _cluster
    from tpulaunch.run import detached

    try:
        api = detached.job_api(_cluster(address))
    except TpulaunchError:
        if run == "last":
            return None
        raise
    if run == "last":
        here = socket.gethostname()
        mine = [j for j in detached.runs(api) if j.metadata.get("submitted_from") in (here, os.uname().nodename)]
        if not mine:
            return None
        job = mine[-1]
    else:
        job = detached.find(api, run)
    if not job.driver_node_id:
        raise TpulaunchError(f"run {job.submission_id} has not started on the head yet", "try again in a moment")
    text = api.read_file(job.driver_node_id, str(detached.run_paths(job.submission_id).events)) or ""
    return job.submission_id, timeline.parse(text)


def load_events(run: str, log_dir: str, address: str) -> list[dict]:
    """The timeline of RUN (see the module docstring)."""
    as_dir = Path(run)
    if run != "last" and as_dir.is_dir():
        events = RunPaths.of(as_dir).events
        if not events.is_file():
            raise TpulaunchError(f"{run} holds no run timeline ({events.name})",
                                 "give a run's directory, e.g. runs/<run id> (runs before this version have none)")
        return timeline.read(events)
    if run != "last":
        local = RunPaths.of(Path(log_dir) / run).events
        if local.is_file():
            return timeline.read(local)
        got = _detached(run, address)
        return got[1] if got else []
    newest = _local_newest(log_dir)
    remote = None
    try:
        remote = _detached("last", address)
    except TpulaunchError:
        remote = None
    if remote and remote[1] and (newest is None or remote[1][0]["t"] > newest[0]):
        return remote[1]
    if newest is None:
        raise TpulaunchError(f"no run with a timeline under {log_dir} and none detached from here",
                             "give a run's directory or id")
    return timeline.read(newest[1])


def _bars(events: list[dict], g: goodput.Goodput, width: int = 60) -> list[tuple[str, Text]]:
    """Per host, the run's wall time as a bar: start-up `s`, steps `=`, redone steps `x`, gaps `.`
    (`g`: the run's goodput, for where each attempt's redone steps began)."""
    if not events:
        return []
    t0 = min(e["t"] for e in events)
    t1 = max(e["t"] for e in events)
    span = max(t1 - t0, 1e-6)
    resume = {r["attempt"]: r.get("resume_step") for r in g.attempts}
    hosts = sorted({e["host"] for e in events if isinstance(e.get("host"), int)})
    out = []

    def paint(cells: list[str], a: float, b: float, ch: str) -> None:
        for i in range(int((a - t0) / span * (width - 1)), int((b - t0) / span * (width - 1)) + 1):
            cells[min(max(i, 0), width - 1)] = ch

    for h in hosts:
        cells = ["."] * width

        for a in sorted({e["attempt"] for e in events if e.get("host") == h and "attempt" in e}):
            mine = [e for e in events if e.get("host") == h and e.get("attempt") == a]
            start = next((e["t"] for e in mine if e["kind"] == "host_start"), None)
            steps = [(e["t"], e["step"]) for e in mine if e["kind"] == "step"]
            end = next((e["t"] for e in mine if e["kind"] == "host_end"), steps[-1][0] if steps else None)
            if start is not None and steps:
                paint(cells, start, steps[0][0], "s")
            if steps and end is not None:
                r = resume.get(a)
                cut = next((t for t, s in steps if r is not None and s > r), end)
                paint(cells, steps[0][0], cut, "=")
                if cut < end:
                    paint(cells, cut, end, "x")
            elif start is not None and end is not None:
                paint(cells, start, end, "~")
        out.append((f"host {h}", Text("".join(cells), style=host_color(h))))
    return out


@app.command("goodput")
def goodput_cmd(run: str = RUN, log_dir: str = LOG_DIR, address: str = ADDRESS, json_out: bool = opt.JSON) -> None:
    """How much of a run's wall time went into steps that counted, and where the rest went.

    Buckets that add up to the wall time (provisioning, cluster start, preflight, host start,
    start-up to the first step, productive, checkpoint, wasted progress, recovery, idle), from
    the launcher's own clock and the script's `tpulaunch.heartbeat(step=N[, checkpoint=True])`.
    """
    out = Output(json_mode=json_out)
    events = load_events(run, log_dir, address)
    if not events:
        raise TpulaunchError(f"run {run} has no timeline yet", "try again once it started")
    g = goodput.analyze(events)
    if json_out:
        out.json(g.to_dict())
        return
    rows = [(k, v) for k, v in g.buckets.items() if v > 0 or k == "productive"]
    if out.rich:
        table = Table(title=f"run {g.run_id}: {g.line()}", title_justify="left")
        table.add_column("bucket")
        table.add_column("seconds", justify="right")
        table.add_column("of wall", justify="right")
        for k, v in rows:
            table.add_row(k, f"{v:.1f}", f"{100 * v / g.wall_s:.0f}%" if g.wall_s else "-")
        out.result(table)
        bars = Table.grid(padding=(0, 1))
        for name, bar in _bars(events, g):
            bars.add_row(name, bar)
        out.result(bars)
        out.line("bars: s start-up, = steps that counted, x steps redone, ~ a script's time without steps")
    else:
        out.line(f"run {g.run_id} wall {g.wall_s:.1f} s {g.line()}")
        for k, v in rows:
            out.line(f"{k}: {v:.1f} s")
    for k, why in sorted(g.unseen.items()):
        out.info(f"not seen: {k}: {why}")
    for a in g.attempts:
        if a.get("resume_step") is not None:
            out.info(f"attempt {a['attempt']}: {a['outcome']} at step {a.get('last_step')}; the next resumed from step"
                     f" {a['resume_step']} ({a['wasted_s']:.1f} s redone)")


@app.command("trace")
def trace_cmd(run: str = RUN,
              output: Path = typer.Option(Path("trace.json"), "--output", "-o", help="Where to write it."),
              log_dir: str = LOG_DIR, address: str = ADDRESS) -> None:
    """The run's timeline as a Chrome trace (open it in ui.perfetto.dev or chrome://tracing): a track
    for the launcher and one per host, attempts and start-ups as spans, steps as a counter."""
    from tpulaunch.run.record.trace import chrome_trace

    out = Output()
    events = load_events(run, log_dir, address)
    doc = chrome_trace(events)
    tmp = output.with_name(output.name + f".tmp-{os.getpid()}-{int(time.time())}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, output)
    tracks = len({e.get("tid") for e in doc["traceEvents"]})
    out.info(f"wrote {output} ({len(doc['traceEvents'])} events, {tracks} tracks)")
