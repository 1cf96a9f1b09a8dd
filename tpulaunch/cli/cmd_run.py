"""`tpulaunch run SCRIPT [ARGS]...`: gang-launch a script on every host of a slice."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import typer
from rich.text import Text

from tpulaunch import discover, run
from tpulaunch.cli import app, debug_enabled
from tpulaunch.cli import options as opt
from tpulaunch.cli.hostlines import MANY_HOSTS, STATUS_EVERY_S, HostLineFilter, grouped_results, many_status
from tpulaunch.cli.noise import NoiseFold
from tpulaunch.cli.output import Output, host_color
from tpulaunch.errors import LaunchError
from tpulaunch.run import Outcome, RunSummary
from tpulaunch.run.status import RunView

if TYPE_CHECKING:
    from tpulaunch.kube import KubeTarget
    from tpulaunch.run.record.goodput import Goodput
    from tpulaunch.run.runner import OnTheHead


class TerminalSink(run.Sink):
    """Host lines as `[host 2] ...`: colored on a terminal, plain in a pipe, on stderr with --json;
    above 16 hosts, host 0, errors and a status line (`cli.hostlines`)."""

    def __init__(self, out: Output, show: set[int] | None, hosts: int = 0, every: bool = False) -> None:
        self.out = out
        self.lines = HostLineFilter(hosts, show, every)
        self.console = out.err if out.json_mode else out.out
        self.noise = NoiseFold()
        self._next_status = time.monotonic() + STATUS_EVERY_S
        if self.lines.many:
            self.progress(f"{hosts} hosts: showing host 0, every host's errors, and a status line every"
                          f" {STATUS_EVERY_S:.0f} s (--hosts all shows every line; each host's log has all of its own)")

    def host_line(self, process: int, stream: str, text: str) -> None:
        if not self.lines.wants(process, text):
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

    def status(self, view: RunView) -> None:
        if self.lines.many and view.hosts and time.monotonic() >= self._next_status:
            self._next_status = time.monotonic() + STATUS_EVERY_S
            self.progress(many_status(view.hosts, time.time()))


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


def _goodput(summary: RunSummary) -> Goodput | None:
    """The run's goodput from its timeline (None if it has none)."""
    from tpulaunch.run.paths import RunPaths
    from tpulaunch.run.record import goodput, timeline

    try:
        events = timeline.read(RunPaths.of(summary.log_dir).events)
    except OSError:
        return None
    return goodput.analyze(events) if events else None


def report(out: Output, summary: RunSummary, sink: TerminalSink | None = None) -> None:
    """The end-of-run summary: JSON document, or one line per host plus the verdict."""
    folded = sink.noise.summary() if sink is not None else None
    if folded:
        out.info(f"note: {folded}")
    good = _goodput(summary)
    if out.json_mode:
        doc = summary.to_dict()
        if good is not None:
            doc["goodput"] = good.to_dict()
        out.json(doc)
        return
    for a in summary.attempts[:-1]:
        out.info(f"attempt {a.index}: {a.outcome}: {a.who or 'no host failed'}; logs in {a.log_dir}")
    ends = [(h, (h.reason or "did not start")
             + (" (stopped by tpulaunch)" if h.stopped_by_tpulaunch and not h.lost else ""))
            for h in summary.hosts]
    if len(ends) > MANY_HOSTS:  # one line per way of ending, not 2,304 lines
        for line in grouped_results([(h.process_index, how, h.wall_s) for h, how in ends]):
            out.info(line)
    else:
        for h, how in ends:
            out.info(f"host {h.process_index} (slice {h.slice_index} worker {h.worker_id}): {how} in {h.wall_s:.1f} s")
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
    elif summary.exit_code != 0:
        out.error(f"run {summary.run_id}: {summary.attempts[-1].who or summary.note or summary.outcome}; {where};"
                  f" exit {summary.exit_code}")
    else:
        again = f" after {len(summary.attempts) - 1} relaunch(es)" if len(summary.attempts) > 1 else ""
        out.info(f"run {summary.run_id}: all {len(summary.hosts)} host(s) exited 0{again}; {where}")
    if good is not None:
        out.info(f"{good.line()} (`tpulaunch goodput {summary.log_dir}` says more)")


def print_plan(out: Output, prep: run.Prepared, show_env: bool = False) -> None:
    from tpulaunch.cli import render

    plan = prep.plan
    if out.json_mode:
        doc = plan.to_dict()
        if not show_env:
            for h in doc["hosts"]:
                h["env"] = render.hide_user_env(plan, h["env"])
        out.json(doc)
        return

    kind = (("EMULATED on this machine" if plan.local else "CPU devices standing in for the chips") if plan.emulated
            else "TPU")
    out.line(f"run {plan.run_id}: {plan.job.script or ' '.join(plan.job.command)} on {len(plan.hosts)} host(s), {kind}")
    out.line(f"framework: {plan.framework} ({prep.framework_reason})")
    out.line(f"coordinator: {plan.coordinator_address}")
    for line in render.mesh_lines(plan.mesh):
        out.line(line)
    for line in render.env_lines(plan, show_env):
        out.line(line)


@app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
)
def run_cmd(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Python script to run on every host (inside the working directory)."),
    script_args: list[str] | None = typer.Argument(None, help="Arguments for the script (put them after --)."),
    topology: str | None = opt.TOPOLOGY,
    accelerator: str | None = opt.ACCELERATOR,
    chips_per_host: int | None = opt.CHIPS_PER_HOST,
    tpu: str | None = opt.TPU,
    queued_resource: str | None = opt.QUEUED_RESOURCE,
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    force: bool = opt.FORCE,
    num_slices: int | None = opt.NUM_SLICES,
    mesh: str | None = opt.MESH,
    dcn: str | None = opt.DCN,
    placement: str = opt.PLACEMENT,
    framework: str = typer.Option("auto", "--framework", "-f",
                                  help="torch_xla, jax, torch_tpu (one process per device), none (boot no framework),"
                                       " or auto (from the script's imports)."),
    env: list[str] | None = opt.ENV,
    env_file: list[str] | None = opt.ENV_FILE,
    show_env: bool = opt.SHOW_ENV,
    address: str | None = typer.Option(
        None, "--address", help="Join a Ray cluster: auto, HOST:PORT or ray://... (default: RAY_ADDRESS, else emulate)."
    ),
    no_dist: bool = typer.Option(False, "--no-dist", help="Do not start the torch.distributed (gloo) process group."),
    hosts: str | None = opt.HOSTS,
    log_dir: str = typer.Option("runs", "--log-dir",
                                help="Where <run-id>/attempt-<k>/host-<i>.log, ray.log and summary.json go."),
    workdir: str = typer.Option(".", "--workdir", help="Directory shipped to every host; the script runs there."),
    schedule_timeout: float = typer.Option(120.0, "--schedule-timeout",
                                           help="Seconds to wait for Ray to give us the whole slice."),
    max_upload_mb: float = typer.Option(100.0, "--max-upload-mb",
                                        help="Refuse to ship a working directory larger than this."),
    kill_stale: bool = opt.KILL_STALE,
    keep_children: bool = opt.KEEP_CHILDREN,
    no_preflight: bool = opt.NO_PREFLIGHT,
    straggler_ratio: float = opt.STRAGGLER_RATIO,
    coordinator_port: int | None = opt.COORDINATOR_PORT,
    timeout: float | None = opt.TIMEOUT,
    stall_timeout: float | None = opt.STALL_TIMEOUT,
    max_restarts: int = opt.MAX_RESTARTS,
    max_preemptions: int = opt.MAX_PREEMPTIONS,
    recreate: bool = typer.Option(False, "--recreate",
                                  help="With --max-preemptions on a `cluster up --tpu NAME --head local` cluster: a"
                                       " preempted slice is deleted, created again from its queued resource, set up"
                                       " and joined, then the run goes on (within --preemption-wait)."),
    replace_hung: bool = typer.Option(False, "--replace-hung",
                                      help="When a run stalls (--stall-timeout), replace the slices of the hosts that"
                                           " caused the hang (a spare slice, or re-created, or dropped under"
                                           " --min-slices) and restart from the checkpoint (counts against"
                                           " --max-restarts)."),
    preemption_wait: float = opt.PREEMPTION_WAIT,
    preemption_grace: float = opt.PREEMPTION_GRACE,
    compile_cache: str | None = typer.Option(
        None, "--compile-cache", metavar="DIR",
        help="Persistent XLA compilation cache on every host (JAX default: ~/.cache/tpulaunch/xla-cache/jax/<slice>;"
             " torch_xla 2.9 cannot load its cache, so it has none unless given)."),
    no_compile_cache: bool = typer.Option(False, "--no-compile-cache", help="Compile from scratch every run."),
    min_slices: int | None = typer.Option(
        None, "--min-slices", metavar="K",
        help="Elastic multislice: when a slice is lost, go on at once on the slices left (at least K), bring the lost"
             " one back in the background, and grow back to all at the next checkpoint. Needs --max-preemptions and"
             " the slices on one --dcn axis."),
    grow_after: float | None = typer.Option(
        None, "--grow-after", metavar="SECONDS",
        help="With --min-slices: grow back this long after the lost slices are back, instead of at the next"
             " checkpoint (`tpulaunch.heartbeat(step=N, checkpoint=True)`)."),
    python: str | None = typer.Option(
        None, "--python", metavar="PATH",
        help="The interpreter each host runs the script with: the environment of the training stack (torch_tpu needs"
             " torch >= 2.11, which cannot share a venv with torch_xla 2.9). It needs no tpulaunch of its own."),
    cpu_devices: bool = typer.Option(False, "--cpu-devices",
                                     help="On a real cluster (--address) whose TPU hosts have no chips (a CI KubeRay"
                                          " cluster on CPU nodes): CPU devices stand in for them, as on an emulated"
                                          " slice."),
    keep_cluster: bool = typer.Option(False, "--keep-cluster",
                                      help="Leave the emulated cluster this run starts up; the next runs use it"
                                           " (warm)."),
    idle_timeout: float = typer.Option(1800.0, "--idle-timeout", metavar="SECONDS",
                                       help="With --keep-cluster: stop the cluster after this long unused."),
    detach: bool = typer.Option(False, "--detach",
                                help="Run the supervision on the cluster's head as a Ray job; print the run id and"
                                     " return (follow with `tpulaunch logs/status/wait RUN`)."),
    attach_stop: bool = typer.Option(False, "--attach-stop",
                                     help="On a remote cluster: Ctrl-C stops the run (default: it detaches)."),
    gke: bool = typer.Option(False, "--gke", help="Bring a KubeRay cluster up on GKE for this run (--topology,"
                                                  " --accelerator, --image), run there, delete it after"
                                                  " (--keep-cluster keeps it)."),
    image: str | None = typer.Option(None, "--image", help="--gke: the image every pod runs."),
    spot: bool = typer.Option(False, "--spot", help="--gke: on spot node pools."),
    autoscaler: bool = opt.AUTOSCALER,
    kubeconfig: str | None = opt.KUBECONFIG,
    context: str | None = opt.CONTEXT,
    namespace: str | None = opt.NAMESPACE,
    rehearse: bool = typer.Option(False, "--rehearse",
                                  help="Instead of launching: run the script once here, in one process holding the"
                                       " slice's devices, compiling every XLA program for the target TPU (libtpu)"
                                       " before the CPU runs it; a table of each program's HBM and collectives; exit"
                                       " 88 when one would not fit. Needs tpulaunch[rehearse]. JAX only."),
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
        mesh=mesh, placement=placement, framework=framework, env=run.client_env(env, env_file), kill_stale=kill_stale,
        keep_children=keep_children, preflight=not no_preflight, straggler_ratio=straggler_ratio, address=address,
        coordinator_port=coordinator_port,
        distributed=not no_dist, log_dir=log_dir, workdir=workdir, schedule_timeout=schedule_timeout,
        max_upload_mb=max_upload_mb, timeout=timeout, stall_timeout=stall_timeout, max_restarts=max_restarts,
        max_preemptions=max_preemptions, preemption_wait=preemption_wait, preemption_grace=preemption_grace,
        recreate=recreate, cpu_devices=cpu_devices, replace_hung=replace_hung,
        keep_cluster=keep_cluster, idle_timeout=idle_timeout, compile_cache=compile_cache,
        no_compile_cache=no_compile_cache, python=python, min_slices=min_slices, grow_after=grow_after,
        rehearse=rehearse,
    )
    if gke:
        from tpulaunch.kube import KubeTarget

        raise typer.Exit(_on_a_gke_cluster_of_its_own(
            out, req, KubeTarget(kubeconfig, context, namespace), image=image, spot=spot, autoscaler=autoscaler,
            hosts=hosts, dry_run=dry_run, detach=detach))
    if image or spot or autoscaler:
        raise LaunchError("--image, --spot and --autoscaler go with --gke",
                          "add --gke (a cluster of the run's own on GKE)")
    raise typer.Exit(run_request(out, req, hosts=hosts, dry_run=dry_run, detach=detach, attach_stop=attach_stop,
                                 show_env=show_env))


def _on_a_gke_cluster_of_its_own(out: Output, req: run.LaunchRequest, target: KubeTarget, *, image: str | None,
                                 spot: bool, autoscaler: bool, hosts: str | None, dry_run: bool, detach: bool) -> int:
    """`run --gke`: bring a RayCluster up for this run, run there (followed here), delete it after
    (unless --keep-cluster). Ctrl-C stops the run and deletes the cluster."""
    import dataclasses
    import secrets

    from tpulaunch import providers
    from tpulaunch.cli.cmd_cluster_remote import HostProgress
    from tpulaunch.cluster.record import load_record
    from tpulaunch.providers import gke as gke_provider

    sl = req.slices
    if req.address is not None or detach or dry_run:
        raise LaunchError("--gke brings a cluster up for the run: it goes without --address, --detach and --dry-run",
                          "for a cluster that stays, `tpulaunch cluster up --gke ...` then `run --address auto`")
    if not sl.topology or not sl.accelerator:
        raise LaunchError("--gke needs --topology and --accelerator", "e.g. --topology 2x2x2 --accelerator v5p")
    if load_record() is not None:
        raise LaunchError("a cluster is recorded as up already", "run on it with --address auto, or `cluster down` it")
    up = gke_provider.UpRequest(target, f"tpl-run-{secrets.token_hex(3)}", sl.topology, sl.accelerator,
                                sl.num_slices or 1, sl.chips_per_host, spot, image, autoscaler=autoscaler)
    checked = gke_provider.check_up(up)  # the flags, the API, the pools: before anything is made
    with out.status(f"bringing up RayCluster {up.name} on GKE for this run ...") as st:
        def say(msg: str) -> None:
            if st is not None:
                st.update(msg)
            if st is None or not out.interactive:
                out.info(msg)

        info = gke_provider.up(checked, say)
    try:
        plain = dataclasses.replace(req, address="auto", keep_cluster=False)
        return run_request(out, plain, hosts=hosts, dry_run=False, attach_stop=True)
    finally:
        if req.keep_cluster:
            out.info(f"kept RayCluster {up.name} (--keep-cluster): `tpulaunch cluster down` deletes it")
        else:
            with out.status(f"deleting RayCluster {up.name} ...") as st:
                providers.of(info).down(HostProgress(out, st, {}))
            out.info(f"deleted RayCluster {up.name}")


def run_request(out: Output, req: run.LaunchRequest, *, hosts: str | None, dry_run: bool, detach: bool = False,
                attach_stop: bool = False, show_env: bool = False) -> int:
    """Shared by `run` and `exec`: plan, maybe print, launch (here, or on the cluster's head), report."""
    from tpulaunch.run import runner

    if req.rehearse:
        return _rehearse(out, req, dry_run=dry_run, detach=detach)
    show = parse_hosts(hosts)
    where = runner.choose(req, detach=detach, dry_run=dry_run)
    cluster = where.target.cluster
    remote = cluster.remote if cluster is not None else None
    if remote is not None and not remote.head_here and req.max_preemptions:  # the head on the slice
        out.warn(f"the Ray head runs on worker 0 of TPU '{remote.tpu}': a preemption of that worker"
                 " ends the run whatever --max-preemptions allows; `tpulaunch cluster up --tpu NAME --head local`"
                 " puts the head off the slice")
    if isinstance(where, runner.OnTheHead):
        return _on_the_head(out, req, where, show, follow=not detach, attach_stop=attach_stop)
    prep, conn = where.prepare(req)
    try:
        check_hosts(show, len(prep.plan.hosts))
    except BaseException:
        conn.close()
        raise
    _notes(out, prep)
    if dry_run:
        conn.close()
        print_plan(out, prep, show_env)
        return 0
    sink = TerminalSink(out, show, len(prep.plan.hosts), every=(hosts or "").strip() == "all")
    summary = where.run(prep, conn, sink, debug=debug_enabled())
    report(out, summary, sink)
    return summary.exit_code


def _rehearse(out: Output, req: run.LaunchRequest, *, dry_run: bool, detach: bool) -> int:
    """`run --rehearse`: the plan (no cluster), then the script once in the rehearsal process, every
    program compiled for the target TPU first (`tpulaunch.rehearse`); its table, or `--json`."""
    from tpulaunch import rehearse
    from tpulaunch.run.prepare import Target, prepare

    if dry_run or detach:
        raise LaunchError("--rehearse runs the script once, here: it goes without --dry-run and --detach",
                          "drop --rehearse, or the other flag")
    prep = prepare(req, Target(None), None, None)
    plan = prep.plan
    rehearse.check(plan, rehearse.libtpu_version())
    for note in (*prep.resolved.topology.notes, *prep.notes):
        out.info(f"note: {note}")
    out.info(f"rehearsal: {plan.job.script} for {plan.mesh.num_slices} x {plan.topology.accelerator_type}"
             f" ({plan.topology.topology}): one process holds its {plan.mesh.num_devices} devices as CPU devices and"
             f" every program is compiled for the TPU before the CPU runs it")
    console = out.err if out.json_mode else out.out
    report = rehearse.rehearse(plan, lambda text: console.print(Text("[rehearsal] ", style="dim") + Text(text),
                                                                 overflow="ignore", crop=False, soft_wrap=True))
    if out.json_mode:
        out.json(report.to_dict())
    else:
        out.info(Text(report.header()))
        for row in report.table():
            out.line(Text(row))  # program names as JAX gives them, never read as markup
    end = f"{report.verdict_line()}; saved in {plan.job.log_dir}/rehearsal.json"
    if report.exit_code:
        out.error(end)
    else:
        out.info(Text(end))
    return report.exit_code


def _notes(out: Output, prep: run.Prepared) -> None:
    plan = prep.plan
    for note in (*prep.resolved.topology.notes, *prep.notes):
        out.info(f"note: {note}")
    if plan.emulated and plan.local:
        out.warn(
            f"EMULATED slice: {plan.mesh.num_slices} x {plan.topology.accelerator_type} ({plan.topology.topology}),"
            f" {len(plan.hosts)} host process(es) on this machine with CPU devices; this is not a TPU run"
        )
    elif plan.emulated:
        out.warn(
            f"CPU devices stand in for the chips (--cpu-devices): {plan.mesh.num_slices} x"
            f" {plan.topology.accelerator_type} ({plan.topology.topology}) on the cluster's {len(plan.hosts)} hosts;"
            " this is not a TPU run"
        )
    if not prep.plan.job.command:
        out.info(f"framework: {plan.framework} ({prep.framework_reason})")


def _on_the_head(out: Output, req: run.LaunchRequest, where: OnTheHead, show: set[int] | None, *, follow: bool,
                 attach_stop: bool) -> int:
    """Submit the run to the cluster's head (checked here first as far as this machine can), then
    return at once (--detach), or follow its output until it ends and exit with its code."""
    from tpulaunch.run import detached

    checked, prep = where.check(req)
    if prep is not None:
        check_hosts(show, len(prep.plan.hosts))
    api = where.api()
    t0 = time.monotonic()
    run_id = where.submit(checked, api)
    took = time.monotonic() - t0
    address = where.cluster.address
    if not follow:
        if out.json_mode:
            out.json({"schema": "tpulaunch.submitted/v1", "run_id": run_id, "address": address})
        else:
            out.line(run_id)
            out.info(f"submitted run {run_id} to {address} in {took:.1f} s; follow it with"
                     f" `tpulaunch logs {run_id} --follow`, `tpulaunch status {run_id}`, `tpulaunch wait {run_id}`")
        return 0
    out.info(f"run {run_id} runs on the cluster's head ({address}); Ctrl-C "
             + ("stops it" if attach_stop else "leaves it running (`tpulaunch stop` ends it)"))
    try:
        for chunk in detached.follow_driver_log(api, run_id):
            out.raw(chunk)
    except KeyboardInterrupt:
        if attach_stop:
            out.info(f"stopping run {run_id}")
            api.stop(run_id)
            rec = detached.wait(api, run_id, 120)
            return rec.exit_code if rec.exit_code is not None else 143
        out.info(f"detached: run {run_id} goes on. `tpulaunch logs {run_id} --follow` follows it again,"
                 f" `tpulaunch stop {run_id}` ends it")
        return 130
    rec = detached.wait(api, run_id, 60)
    return rec.exit_code if rec.exit_code is not None else 1


@app.command("supervise", hidden=True)
def supervise_cmd(request: str = typer.Option(..., "--request",
                                              help="Where the run's request is stored (gcs://...).")) -> None:
    """The supervisor of a detached run (what `run --detach` submits as a Ray job on the head)."""
    from tpulaunch.run import detached, runner
    from tpulaunch.run.paths import RunPaths

    out = Output()
    req = detached.take_request(request)
    made: list[tuple[TerminalSink, detached.StatusFile]] = []

    def sink_for(prep: run.Prepared) -> detached.StatusFile:
        _notes(out, prep)
        terminal = TerminalSink(out, None, len(prep.plan.hosts))
        made.append((terminal, detached.StatusFile(terminal, RunPaths.of(prep.plan.job.log_dir).status,
                                                   req.script or " ".join(req.command))))
        return made[0][1]

    summary = runner.supervise(req, sink_for)
    report(out, summary, made[0][0] if made else None)
    raise typer.Exit(summary.exit_code)
