"""`tpulaunch run SCRIPT [ARGS]...`: gang-launch a script on every host of a slice."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.text import Text

from tpulaunch import discover, run
from tpulaunch.cli import app, debug_enabled
from tpulaunch.cli import options as opt
from tpulaunch.cli.noise import NoiseFold
from tpulaunch.cli.output import Output, host_color
from tpulaunch.errors import LaunchError
from tpulaunch.run import Outcome, RunSummary


class TerminalSink:
    """Host lines as `[host 2] ...`: colored on a terminal, plain in a pipe, on stderr with --json."""

    def __init__(self, out: Output, show: set[int] | None) -> None:
        self.out = out
        self.show = show
        self.console = out.err if out.json_mode else out.out
        self.noise = NoiseFold()

    def host_line(self, process: int, stream: str, text: str) -> None:
        if self.show is not None and process not in self.show:
            return
        kind = self.noise.classify(text)
        if kind == "fold":
            return
        prefix = Text(f"[host {process}] ", style=host_color(process))
        body = Text(text, style="red" if stream == "stderr" and self.console.is_terminal else "")
        if kind == "first":
            body.append(" (tpulaunch: shown once; repeats are folded, the host logs keep them)", style="dim")
        self.console.print(prefix + body, overflow="ignore", crop=False, soft_wrap=True)

    def progress(self, message: str) -> None:
        self.out.info(Text("tpulaunch: ", style="dim") + Text(message))


def parse_hosts(value: str | None) -> set[int] | None:
    """`--hosts`: None for all; otherwise host numbers (checked against the slice by `check_hosts`)."""
    if value is None or value.strip() == "all":
        return None
    hint = "write --hosts 0 or --hosts 0,2 or --hosts all"
    try:
        chosen = {int(v) for v in value.split(",") if v.strip()}
    except ValueError:
        raise LaunchError(f"--hosts '{value}' is not a list of host numbers", hint) from None
    if not chosen:
        raise LaunchError("--hosts is empty", hint)
    return chosen


def check_hosts(chosen: set[int] | None, hosts: int) -> None:
    """Every host `--hosts` names is one of the run's (else no host output would ever show)."""
    outside = sorted(h for h in chosen or () if not 0 <= h < hosts)
    if outside:
        raise LaunchError(f"--hosts {','.join(map(str, outside))}: the run has hosts 0-{hosts - 1}",
                          "name hosts of this slice, or --hosts all")


def report(out: Output, summary: RunSummary, sink: TerminalSink | None = None) -> None:
    """The end-of-run summary: JSON document, or one line per host plus the verdict."""
    folded = sink.noise.summary() if sink is not None else None
    if folded:
        out.info(f"note: {folded}")
    if out.json_mode:
        out.json(summary.to_dict())
        return
    for a in summary.attempts[:-1]:
        f = a.first_failure
        who = f"host {f.process_index} {f.reason}" if f else "no host failed"
        out.info(f"attempt {a.index}: {a.outcome}: {who}; logs in {a.log_dir}")
    for h in summary.hosts:
        note = " (stopped by tpulaunch)" if h.stopped_by_tpulaunch and not h.lost else ""
        out.info(f"host {h.process_index} (slice {h.slice_index} worker {h.worker_id}): {h.reason or 'did not start'}"
                 f" in {h.wall_s:.1f} s{note}")
    where = f"logs in {summary.log_dir}"
    f = summary.first_failure
    if summary.outcome is Outcome.INTERRUPTED:
        out.error(f"run {summary.run_id} interrupted ({summary.interrupted}); {where}")
    elif summary.outcome in (Outcome.TIMEOUT, Outcome.STALLED):
        out.error(f"{summary.note}; exit {summary.exit_code}")
    elif f is not None:
        tail = f"; {summary.note}" if summary.note else ""
        out.error(f"host {f.process_index} (slice {f.slice_index} worker {f.worker_id}) {f.reason}"
                  f"; its log: {f.log}{tail}; exit {summary.exit_code}")
    elif not summary.attempts:
        out.error(f"run {summary.run_id} ended before any host started; {where}")
    else:
        again = f" after {len(summary.attempts) - 1} relaunch(es)" if len(summary.attempts) > 1 else ""
        out.info(f"run {summary.run_id}: all {len(summary.hosts)} host(s) exited 0{again}; {where}")


def print_plan(out: Output, prep: run.Prepared) -> None:
    plan = prep.plan
    if out.json_mode:
        out.json(plan.to_dict())
        return
    from tpulaunch.cli import render

    kind = "EMULATED on this machine" if plan.emulated else "TPU"
    out.line(f"run {plan.run_id}: {plan.job.script or ' '.join(plan.job.command)} on {len(plan.hosts)} host(s), {kind}")
    out.line(f"framework: {plan.framework} ({prep.framework_reason})")
    out.line(f"coordinator: {plan.coordinator_address}")
    for line in render.mesh_lines(plan.mesh):
        out.line(line)
    for line in render.env_lines(plan):
        out.line(line)


@app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
)
def run_cmd(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Python script to run on every host (inside the working directory)."),
    script_args: Optional[List[str]] = typer.Argument(None, help="Arguments for the script (put them after --)."),
    topology: Optional[str] = opt.TOPOLOGY,
    accelerator: Optional[str] = opt.ACCELERATOR,
    chips_per_host: Optional[int] = opt.CHIPS_PER_HOST,
    tpu: Optional[str] = opt.TPU,
    queued_resource: Optional[str] = opt.QUEUED_RESOURCE,
    zone: Optional[str] = opt.ZONE,
    project: Optional[str] = opt.PROJECT,
    force: bool = opt.FORCE,
    num_slices: Optional[int] = opt.NUM_SLICES,
    mesh: Optional[str] = opt.MESH,
    dcn: Optional[str] = opt.DCN,
    framework: str = typer.Option("auto", "--framework", "-f", help="torch_xla, jax, none (boot no framework), or auto (from the script's imports)."),
    env: Optional[List[str]] = opt.ENV,
    address: Optional[str] = typer.Option(
        None, "--address", help="Join a Ray cluster: auto, HOST:PORT or ray://... (default: RAY_ADDRESS, else emulate)."
    ),
    no_dist: bool = typer.Option(False, "--no-dist", help="Do not start the torch.distributed (gloo) process group."),
    hosts: Optional[str] = opt.HOSTS,
    log_dir: str = typer.Option("runs", "--log-dir", help="Where <run-id>/attempt-<k>/host-<i>.log, ray.log and summary.json go."),
    workdir: str = typer.Option(".", "--workdir", help="Directory shipped to every host; the script runs there."),
    schedule_timeout: float = typer.Option(120.0, "--schedule-timeout", help="Seconds to wait for Ray to give us the whole slice."),
    max_upload_mb: float = typer.Option(100.0, "--max-upload-mb", help="Refuse to ship a working directory larger than this."),
    kill_stale: bool = opt.KILL_STALE,
    keep_children: bool = opt.KEEP_CHILDREN,
    timeout: Optional[float] = opt.TIMEOUT,
    stall_timeout: Optional[float] = opt.STALL_TIMEOUT,
    max_restarts: int = opt.MAX_RESTARTS,
    max_preemptions: int = opt.MAX_PREEMPTIONS,
    preemption_wait: float = opt.PREEMPTION_WAIT,
    preemption_grace: float = opt.PREEMPTION_GRACE,
    compile_cache: Optional[str] = typer.Option(
        None, "--compile-cache", metavar="DIR",
        help="Persistent XLA compilation cache on every host (JAX default: ~/.cache/tpulaunch/xla-cache/jax/<slice>;"
             " torch_xla 2.9 cannot load its cache, so it has none unless given)."),
    no_compile_cache: bool = typer.Option(False, "--no-compile-cache", help="Compile from scratch every run."),
    keep_cluster: bool = typer.Option(False, "--keep-cluster",
                                      help="Leave the emulated cluster this run starts up; the next runs use it (warm)."),
    idle_timeout: float = typer.Option(1800.0, "--idle-timeout", metavar="SECONDS",
                                       help="With --keep-cluster: stop the cluster after this long unused."),
    dry_run: bool = opt.DRY_RUN,
    json_out: bool = opt.JSON,
) -> None:
    """Run SCRIPT under SPMD on every host of a slice; emulate the slice here when no TPU is in sight.

    Example: `tpulaunch run train.py --topology 2x8 -- --steps 100`. Exit code: 0 when every host
    exits 0, else the first failing host's code; 75 a host lost or preempted, 124 a timeout,
    130/143 interrupted (README: exit codes).
    """
    out = Output(json_mode=json_out)
    req = run.LaunchRequest(
        script=script, args=(*(script_args or []), *ctx.args),
        slices=discover.SliceRequest(topology=topology, accelerator=accelerator, chips_per_host=chips_per_host, tpu=tpu,
                                     queued_resource=queued_resource, zone=zone, project=project, num_slices=num_slices,
                                     dcn=dcn, force=force),
        mesh=mesh, framework=framework, env=tuple(env or ()), kill_stale=kill_stale, keep_children=keep_children, address=address,
        distributed=not no_dist, log_dir=log_dir, workdir=workdir, schedule_timeout=schedule_timeout,
        max_upload_mb=max_upload_mb, timeout=timeout, stall_timeout=stall_timeout, max_restarts=max_restarts,
        max_preemptions=max_preemptions, preemption_wait=preemption_wait, preemption_grace=preemption_grace,
        keep_cluster=keep_cluster, idle_timeout=idle_timeout, compile_cache=compile_cache,
        no_compile_cache=no_compile_cache,
    )
    raise typer.Exit(run_request(out, req, hosts=hosts, dry_run=dry_run))


def run_request(out: Output, req: run.LaunchRequest, *, hosts: str | None, dry_run: bool) -> int:
    """Shared by `run` and `exec`: plan, maybe print, launch, report. Returns the exit code."""
    show = parse_hosts(hosts)
    target = run.find_cluster(req)
    conn = run.Connection(target, run.shipped_workdir(req))
    try:
        prep = run.prepare(req, target, conn.cluster_slices(req), conn.runtime_env)
        check_hosts(show, len(prep.plan.hosts))
    except BaseException:
        conn.close()
        raise
    for note in (*prep.resolved.topology.notes, *prep.notes):
        out.info(f"note: {note}")
    if dry_run:
        conn.close()
        print_plan(out, prep)
        return 0
    plan = prep.plan
    if plan.emulated:
        out.warn(
            f"EMULATED slice: {plan.mesh.num_slices} x {plan.topology.accelerator_type} ({plan.topology.topology}),"
            f" {len(plan.hosts)} host process(es) on this machine with CPU devices; this is not a TPU run"
        )
    if not req.command:
        out.info(f"framework: {plan.framework} ({prep.framework_reason})")
    sink = TerminalSink(out, show)
    summary = run.launch(prep, sink, conn, quiet_ray=True, debug=debug_enabled())
    report(out, summary, sink)
    return summary.exit_code
