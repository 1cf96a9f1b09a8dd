"""`tpulaunch runs | status RUN | logs RUN | stop RUN | wait RUN`: detached runs, from any machine.

Each asks the cluster's head (its job and log APIs, with the cluster's token): `--address`,
`RAY_ADDRESS`, or `auto` (the cluster `cluster up` recorded here). `RUN` is a run id or `last`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import typer
from rich.live import Live
from rich.table import Table

from tpulaunch.cli import app
from tpulaunch.cli import options as opt
from tpulaunch.cli.output import Output
from tpulaunch.errors import ClusterError, ExitCode, TpulaunchError

if TYPE_CHECKING:
    from tpulaunch.cluster.jobs import JobApi, JobInfo
    from tpulaunch.cluster.record import ClusterInfo
    from tpulaunch.run.detached import RunRecord

ADDRESS = typer.Option("auto", "--address", help="The cluster: auto (recorded here), HOST:PORT, or http://DASHBOARD.")
def _run_id(value: str) -> str:
    """RUN is checked before any cluster is asked: an empty or malformed id is a bad value (exit 2)."""
    from tpulaunch.run.detached import check_run_id

    return check_run_id(value)


RUN = typer.Argument(..., metavar="RUN", help="A run id, or `last`.", callback=_run_id)


def _api(address: str) -> tuple[JobApi, ClusterInfo]:
    from tpulaunch.client import _cluster
    from tpulaunch.run import detached

    info = _cluster(address)
    return detached.job_api(info), info


def _duration(rec: RunRecord) -> str:
    j = rec.job
    if not j.start_time:
        return "-"
    return f"{(j.end_time or time.time()) - j.start_time:.0f}s"


ROW_KEYS = ("run_id", "script", "state", "attempt", "exit_code", "started", "ended", "duration_s", "message")


def _run_row(rec: RunRecord) -> dict:
    doc = _status_doc(rec)
    return {k: doc[k] for k in ROW_KEYS}


def _status_doc(rec: RunRecord) -> dict:
    from tpulaunch.client import RunStatus

    return RunStatus.of(rec).to_dict()


@app.command("runs")
def runs_cmd(address: str = ADDRESS, json_out: bool = opt.JSON) -> None:
    """Every run on the cluster: id, script, state, attempt, exit code, started, duration."""
    from tpulaunch.run import detached

    out = Output(json_mode=json_out)
    api, _info = _api(address)
    recs = [detached.record(api, j) for j in detached.runs(api)]
    if json_out:
        out.json({"schema": "tpulaunch.runs/v1", "runs": [_run_row(r) for r in recs]})
        return
    cols = ("RUN", "SCRIPT", "STATE", "ATTEMPT", "EXIT", "STARTED", "DURATION")
    rows = [(r.run_id, r.job.metadata.get("script", ""), str(r.state), str(r.view.attempt) if r.view else "-",
             "-" if r.exit_code is None else str(r.exit_code),
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.job.start_time)) if r.job.start_time else "-",
             _duration(r)) for r in recs]
    if out.rich:
        table = Table(*cols)
        for row in rows:
            table.add_row(*row)
        out.result(table)
    else:
        for row in [cols, *rows]:
            out.line("  ".join(row))


def _status_table(doc: dict) -> Table:
    t = Table(title=f"run {doc['run_id']}: {doc['state']}" + (f", attempt {doc['attempt']}" if doc["attempt"] else "")
              + (f", exit {doc['exit_code']}" if doc["exit_code"] is not None else ""), title_justify="left")
    steps = any(h["step"] is not None for h in doc["hosts"])  # the script calls tpulaunch.heartbeat(step=N)
    for col in ("host", "slice/worker", "state", *(("step", "steps/s") if steps else ()), "since", "last line"):
        t.add_column(col, justify="right" if col in ("step", "steps/s") else "left")
    for h in doc["hosts"]:
        step = (("-" if h["step"] is None else str(h["step"]),
                 "-" if h["step_rate"] is None else f"{h['step_rate']:.2f}") if steps else ())
        t.add_row(str(h["process_index"]), f"{h['slice_index']}/{h['worker_id']}",
                  h["state"] + (f" ({h['exit_code']})" if h["exit_code"] is not None else ""), *step,
                  "-" if h["since_last_s"] is None else f"{h['since_last_s']:.0f}s", (h["last_line"] or "")[:80])
    return t


def _status_lines(doc: dict) -> list[str]:
    def known(v: object) -> str:
        return "-" if v is None else str(v)

    lines = [f"run {doc['run_id']} {doc['state']} attempt={known(doc['attempt'])} exit={known(doc['exit_code'])}"]
    for a in doc["attempts"]:
        lines.append(f"attempt {a['index']}: {a['outcome']}: {a.get('who') or 'no host failed'}")
    for h in doc["hosts"]:
        since = "-" if h["since_last_s"] is None else f"{h['since_last_s']:.0f}s"
        step = "" if h["step"] is None else f" step={h['step']}" + (
            "" if h["step_rate"] is None else f" ({h['step_rate']:.2f}/s)")
        lines.append(f"host {h['process_index']} slice={h['slice_index']} worker={h['worker_id']} state={h['state']}"
                     f" exit={known(h['exit_code'])}{step} since={since} last={h['last_line']!r}")
    return lines


@app.command("status")
def status_cmd(run: str = RUN, address: str = ADDRESS,
               watch: bool = typer.Option(False, "--watch", help="Redraw until the run ends (plain lines in a pipe)."),
               json_out: bool = opt.JSON) -> None:
    """One row per host: slice/worker, state, seconds since its last line or heartbeat, its last line;
    and the attempt history."""
    from tpulaunch.run import detached

    out = Output(json_mode=json_out)
    api, _info = _api(address)
    job = detached.find(api, run)
    doc = _status_doc(detached.record(api, job))
    if json_out and not watch:
        out.json(doc)
        return
    if not watch:
        _print_status(out, doc)
        line = _goodput_line(api, job)
        if line:
            out.info(line)
        return
    if out.rich:
        def table() -> Table:
            t = _status_table(doc)
            t.caption = _goodput_line(api, job)
            return t

        with Live(table(), console=out.out, refresh_per_second=2) as live:
            while doc["state"] not in ("succeeded", "failed", "stopped", "lost", "unknown"):
                time.sleep(2.0)
                doc = _status_doc(detached.record(api, api.info(job.submission_id) or job))
                live.update(table())
        return
    last, last_good = None, None
    while True:
        lines = _status_lines(doc)
        if lines != last:
            for line in lines:
                out.line(line)
            last = lines
        good = _goodput_line(api, job)
        if good and good != last_good:
            out.line(good)
            last_good = good
        if doc["state"] in ("succeeded", "failed", "stopped", "lost", "unknown"):
            return
        time.sleep(2.0)
        doc = _status_doc(detached.record(api, api.info(job.submission_id) or job))


def _goodput_line(api: JobApi, job: JobInfo) -> str | None:
    """Goodput so far of a detached run, from its timeline on the head."""
    from tpulaunch.run import detached
    from tpulaunch.run.record import goodput, timeline

    if not job.driver_node_id:
        return None
    try:
        path = str(detached.run_paths(job.submission_id).events)
        events = timeline.parse(api.read_file(job.driver_node_id, path) or "")
    except TpulaunchError:
        return None
    return goodput.analyze(events).line() if events else None


def _print_status(out: Output, doc: dict) -> None:
    if out.rich:
        out.result(_status_table(doc))
        for a in doc["attempts"]:
            out.line(f"attempt {a['index']}: {a['outcome']}: {a.get('who') or 'no host failed'}")
    else:
        for line in _status_lines(doc):
            out.line(line)


@app.command("logs")
def logs_cmd(run: str = RUN, address: str = ADDRESS,
             host: int | None = typer.Option(None, "--host", help="One host's full log (else the prefixed stream)."),
             attempt: int | None = typer.Option(None, "--attempt", help="Which attempt (default: the latest)."),
             follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the run ends.")) -> None:
    """The run's prefixed stream (every host, as a foreground run prints it), or one host's full log."""
    from tpulaunch.run import detached

    out = Output()
    api, _info = _api(address)
    job = detached.find(api, run)
    if host is None:
        if follow:
            for chunk in detached.follow_driver_log(api, job.submission_id, require_log=True):
                out.raw(chunk)
        else:
            out.raw(detached.driver_output(api, job))
        return
    for chunk in detached.follow_host_log(api, job, host, attempt, follow):
        out.raw(chunk)


@app.command("stop")
def stop_cmd(run: str = RUN, address: str = ADDRESS, json_out: bool = opt.JSON) -> None:
    """Stop a run as SIGTERM stops a foreground one: every host stopped, logs kept, summary written (143)."""
    from tpulaunch.run import detached

    out = Output(json_mode=json_out)
    api, _info = _api(address)
    job = detached.find(api, run)
    if job.terminal:
        rec = detached.record(api, job)
        raise TpulaunchError(f"run {job.submission_id} has already ended ({rec.state}, exit {rec.exit_code})",
                             "nothing to stop")
    api.stop(job.submission_id)
    rec = detached.wait(api, job.submission_id, detached.STOP_WAIT_S + 30)
    if json_out:
        out.json(_status_doc(rec))
    else:
        out.line(f"run {rec.run_id} stopped ({rec.state}, exit {rec.exit_code})")


@app.command("wait")
def wait_cmd(run: str = RUN, address: str = ADDRESS,
             timeout: float | None = typer.Option(None, "--timeout", metavar="S",
                                                  help="Give up after S seconds (exit 124)."),
             json_out: bool = opt.JSON) -> None:
    """Block until the run ends, then exit with its exit code (the README's table)."""
    import math

    from tpulaunch.run import detached

    if timeout is not None and (not math.isfinite(timeout) or timeout <= 0):
        raise TpulaunchError(f"--timeout {timeout:g} is not a positive number of seconds", "e.g. --timeout 3600")
    out = Output(json_mode=json_out)
    api, _info = _api(address)
    job = detached.find(api, run)
    rec = detached.wait(api, job.submission_id, timeout)
    if json_out:
        out.json(_status_doc(rec))
    if not rec.job.terminal:
        out.error(f"run {rec.run_id} is still {rec.state} after {timeout:g} s")
        raise typer.Exit(ExitCode.TIMEOUT)
    if not json_out:
        out.info(f"run {rec.run_id} {rec.state}, exit {rec.exit_code}")
    raise typer.Exit(rec.exit_code if rec.exit_code is not None else 1)


@app.command("stacks")
def stacks_cmd(run: str = typer.Argument("last", metavar="RUN", help="A run id, or `last` (the run going on)."),
               address: str | None = typer.Option(
                   None, "--address",
                   help="The run's cluster (default: the one the run's directory names, else auto)."),
               log_dir: str = typer.Option("runs", "--log-dir",
                                           help="Where this machine's runs write their directories."),
               direct: bool = typer.Option(False, "--direct", hidden=True,
                                           help="Connect to Ray from here (what the head's copy of this command"
                                                " does)."),
               json_out: bool = opt.JSON) -> None:
    """Where every host of a running run is (py-spy dump), without stopping it; full dumps under
    the run's attempt directory."""
    import json

    from tpulaunch.cluster.connect import connect, disconnect
    from tpulaunch.run import detached, stacks
    from tpulaunch.run.prepare import head_python, is_local

    out = Output(json_mode=json_out)
    cluster = _cluster_of_run(run, address, log_dir)
    if direct or is_local(cluster):
        connect(cluster)
        try:
            doc = stacks.take(run, log_dir).to_dict()
        finally:
            disconnect()
    else:  # the run's files, and its Ray, are on the head: ask there
        # There, Ray's job manager gives the job the cluster's address (RAY_ADDRESS) and token.
        code, text = detached.run_tool(detached.job_api(cluster),
                                       ["stacks", run, "--json", "--direct", "--address", "auto"],
                                       python=head_python(cluster))
        start = 0 if text.startswith("{") else text.find("\n{") + 1
        if code != 0 or not start and not text.startswith("{"):
            said = text.strip().splitlines()[-1] if text.strip() else f"exit {code}"
            raise ClusterError(f"`tpulaunch stacks` on the head failed: {said.removeprefix('error: ')}", None)
        doc = json.loads(text[start:])
    if json_out:
        out.json(doc)
        return
    out.line(f"run {doc['run_id']} attempt {doc['attempt']}:")
    for group in doc["where"].split("; "):
        out.line(f"  {group}")
    if doc["missing"]:
        out.line(f"  host(s) {','.join(map(str, doc['missing']))}: no process running")
    out.info(f"full dumps in {doc['dir']}")


def _cluster_of_run(run: str, address: str | None, log_dir: str) -> ClusterInfo:
    """The cluster a run is on: --address; else the one its directory here names (a foreground
    run on a cluster of its own); else `auto` (the cluster recorded here)."""
    from pathlib import Path

    from tpulaunch.cluster.connect import resolve_address
    from tpulaunch.cluster.record import load_record
    from tpulaunch.run.paths import RunPaths

    if address is not None:
        from tpulaunch.client import _cluster

        return _cluster(address)
    root = Path(log_dir)
    names = [RunPaths.of(root / run).cluster] if run != "last" else sorted(
        root.glob("*/" + RunPaths.of(root).cluster.name), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in names:
        if p.is_file():
            info = load_record(p)
            if info is not None and (info.running_here or not info.emulated):
                return info
    auto = resolve_address("auto")
    assert auto is not None  # `auto` finds a cluster or raises
    return auto
