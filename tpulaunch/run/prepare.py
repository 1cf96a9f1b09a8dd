"""Prepare a launch: from the request (flags) to the `LaunchPlan`, starting nothing.

Shared by `tpulaunch run` and `tpulaunch exec`. The CLI builds a `LaunchRequest` from flags,
calls `prepare()` for the plan (that is all `--dry-run` needs), then `tpulaunch.run.launch()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tpulaunch import discover
from tpulaunch.cluster.connect import connect, disconnect, ray_output_to, resolve_address
from tpulaunch.cluster.ports import free_port
from tpulaunch.cluster.record import ClusterInfo, load_record, state_dir
from tpulaunch.errors import LaunchError, TpulaunchError
from tpulaunch.host import frameworks
from tpulaunch.plan.launch import LaunchPlan, build_plan, default_compile_cache, new_run_id, parse_env
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec


WORKDIR_EXCLUDES = [".git", ".venv", "venv", "runs", "__pycache__", "*.pyc", ".pytest_cache", "node_modules"]


@dataclass
class LaunchRequest:
    script: str = ""
    args: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # exec: a command instead of a script
    topology: str | None = None
    accelerator: str | None = None
    chips_per_host: int | None = None
    tpu: str | None = None
    queued_resource: str | None = None
    zone: str | None = None
    project: str | None = None
    force: bool = False
    num_slices: int | None = None
    mesh: str | None = None
    dcn: str | None = None
    framework: str = "auto"
    env: list[str] = field(default_factory=list)
    address: str | None = None
    distributed: bool = True
    log_dir: str = "runs"
    workdir: str = "."
    coordinator_port: int | None = None
    schedule_timeout: float = 120.0
    max_upload_mb: float = 100.0
    ship_workdir: bool = True
    kill_stale: bool = False
    run_id: str | None = None
    # faults (see tpulaunch.run.launch)
    timeout: float | None = None  # wall clock for the whole run
    stall_timeout: float | None = None  # no output or heartbeat from any host for this long
    max_restarts: int = 0  # relaunches after a host failed
    max_preemptions: int = 0  # relaunches after a host was lost or preempted
    preemption_wait: float = 600.0  # how long to wait for the slice to be whole again
    preemption_grace: float = 30.0  # a preempted script's time between SIGTERM and SIGKILL
    compile_cache: str | None = None  # persistent compilation cache dir; None: the default one
    no_compile_cache: bool = False
    keep_cluster: bool = False  # leave an emulated cluster this run starts up for the next runs
    idle_timeout: float = 1800.0  # ... and stop it after this long unused

    def slice_request(self) -> discover.SliceRequest:
        return discover.SliceRequest(
            topology=self.topology, accelerator=self.accelerator, chips_per_host=self.chips_per_host, tpu=self.tpu,
            queued_resource=self.queued_resource, zone=self.zone, project=self.project,
            num_slices=self.num_slices, dcn=self.dcn, force=self.force,
        )


@dataclass
class Prepared:
    plan: LaunchPlan
    resolved: discover.ResolvedSlices
    cluster: ClusterInfo | None  # an existing cluster to join (None: start one)
    framework_reason: str
    request: LaunchRequest
    runtime_env: dict | None  # the working directory Ray ships to every real host (checked for size)
    notes: tuple[str, ...] = ()


def _framework(req: LaunchRequest, workdir: Path) -> tuple[str, str]:
    if req.command:
        return "torch_xla", "exec runs a command, no framework boot"
    if req.framework != "auto":
        frameworks.get(req.framework)
        return req.framework, "--framework"
    return frameworks.detect((workdir / req.script).read_text(errors="replace"))


def prepare(req: LaunchRequest) -> Prepared:
    """Everything up to the LaunchPlan. No host processes; discovery and a Ray query only if asked."""
    _check_numbers(req)
    workdir = Path(req.workdir).resolve()
    if not workdir.is_dir():
        raise LaunchError(f"working directory {req.workdir} does not exist", "pass an existing --workdir")
    script = req.script
    if not req.command:
        path = Path(script)
        full = path if path.is_absolute() else (Path.cwd() / path)
        if not full.is_file():
            raise LaunchError(f"script {script} not found", "give the path of a Python file to run on every host")
        try:
            script = str(full.resolve().relative_to(workdir))
        except ValueError:
            raise LaunchError(f"script {script} is outside the working directory {workdir}",
                              "run from the directory that holds it, or pass --workdir") from None
    cluster = resolve_address(req.address)
    notes: list[str] = []
    if cluster is None and req.address is None:
        cluster = _warm_cluster_for(req)
        if cluster is not None:
            notes.append(f"running on the emulated cluster already up at {cluster.address}"
                         " (`tpulaunch cluster down` stops it)")
    resolved = discover.resolve(req.slice_request(), cluster_slices(cluster, req))
    emulated = resolved.emulated or (cluster is not None and cluster.emulated)
    # Checked here so an oversized directory is refused before anything starts, emulated too (the
    # rehearsal refuses what the slice would). Emulated hosts share this filesystem: the script runs
    # in place, nothing is uploaded (and Ray's package cache cannot remove a directory in use).
    runtime_env = workdir_runtime_env(str(workdir), req.max_upload_mb) if req.ship_workdir else None
    if emulated:
        runtime_env = None
    fw, reason = _framework(req, workdir)
    if not req.command:
        frameworks.require_installed(fw)
    mesh = plan_mesh(resolved.topology, req.mesh, req.dcn, resolved.num_slices)
    run_id = req.run_id or new_run_id()
    port = req.coordinator_port or (free_port() if emulated else 8476)
    jax_port = (free_port() if emulated else 8477) if fw == "jax" else None
    group_port = free_port() if emulated else port + 2  # tpulaunch's own gloo group, apart from MASTER_PORT
    plan = build_plan(
        slices=list(resolved.slices), mesh=mesh, script=script, args=req.args, framework=fw,
        user_env=parse_env(req.env), run_id=run_id, coordinator_port=port, group_port=group_port, jax_coordinator_port=jax_port,
        emulated=emulated, emulation_env=frameworks.get(fw).emulation_env(resolved.topology, resolved.num_slices),
        emulation_port=free_port() if emulated else None,
        metadata_server=(resolved.source in ("metadata", "ray")), distributed=req.distributed and not req.command,
        log_dir=str((Path(req.log_dir) / run_id).resolve()), workdir=str(workdir), command=tuple(req.command),
        compile_cache=None if (req.no_compile_cache or req.command) else (
            req.compile_cache or default_compile_cache(fw, resolved.topology, resolved.num_slices, emulated)),
    )
    return Prepared(plan, resolved, cluster, reason, req, runtime_env, (*resolved.notes, *notes))


def _warm_cluster_for(req: LaunchRequest) -> ClusterInfo | None:
    """An emulated cluster tpulaunch left running here (`cluster up`, `run --keep-cluster`) that
    holds exactly the slices asked for: a run with no --address takes it instead of starting one."""
    if req.tpu or req.queued_resource:
        return None
    rec = load_record()
    if rec is None or not rec.emulated or not rec.running_here:
        return None
    try:
        discover.resolve(req.slice_request(), cluster_slices(rec, req))
    except TpulaunchError:
        return None  # another slice: start a cluster of its own
    return rec


def _check_numbers(req: LaunchRequest) -> None:
    """Numeric flags that Typer parses but cannot judge."""
    positive = [("--schedule-timeout", req.schedule_timeout, "seconds"), ("--max-upload-mb", req.max_upload_mb, "MiB"),
                ("--idle-timeout", req.idle_timeout, "seconds"),
                ("--timeout", req.timeout, "seconds"), ("--stall-timeout", req.stall_timeout, "seconds")]
    for flag, value, unit in positive:
        if value is not None and not value > 0:
            raise LaunchError(f"{flag} {value:g} is not positive", f"give it in {unit}, above 0")
    for flag, value in (("--max-restarts", req.max_restarts), ("--max-preemptions", req.max_preemptions),
                        ("--preemption-wait", req.preemption_wait), ("--preemption-grace", req.preemption_grace)):
        if value < 0:
            raise LaunchError(f"{flag} {value:g} is negative", "use 0 or more")
    if req.coordinator_port is not None and not 0 < req.coordinator_port < 65536:
        raise LaunchError(f"coordinator port {req.coordinator_port} is not a TCP port", "use 1-65535")


def cluster_slices(cluster: ClusterInfo | None, req: LaunchRequest) -> discover.ClusterSlices | None:
    """What `discover.resolve` needs to know of the cluster: its recorded slices, or Ray's labels."""
    if cluster is None:
        return None
    if cluster.emulated:
        return discover.ClusterSlices(True, tuple(SliceSpec.from_dict(d) for d in cluster.slices))
    if req.queued_resource:
        return discover.ClusterSlices(False)
    from tpulaunch.discover import ray_labels

    with ray_output_to(state_dir() / "ray-driver.log", True):
        connect(cluster)
        try:
            found = ray_labels.read_slices()
        finally:
            disconnect()
    return discover.ClusterSlices(False, ray_slices=tuple(found))


def workdir_runtime_env(workdir: str, max_mb: float) -> dict:
    """Ray `runtime_env` shipping the user's directory to every host, after a size check."""
    root = Path(workdir)
    total = 0
    skip = {e for e in WORKDIR_EXCLUDES if "*" not in e}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".pyc"):
                continue
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    if total > max_mb * 1024 * 1024:
        raise LaunchError(
            f"the working directory {workdir} is {total / 2**20:.1f} MiB, over the {max_mb:g} MiB limit for shipping to hosts",
            "run from a smaller directory, move data out of it, or raise --max-upload-mb",
        )
    return {"working_dir": str(root), "excludes": WORKDIR_EXCLUDES}
