"""One launch from start to end: plan it, get a Ray cluster, execute, clean up.

Shared by `tpulaunch run` and `tpulaunch exec`. The CLI builds a `LaunchRequest` from flags,
calls `prepare()` for the pure plan (that is all `--dry-run` needs), then `launch()`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tpulaunch import frameworks, ray_cluster
from tpulaunch.errors import LaunchError
from tpulaunch.launch import LaunchPlan, build_plan, new_run_id, parse_env
from tpulaunch.mesh import plan_mesh
from tpulaunch.resolve import ResolvedSlices, resolve_slices
from tpulaunch.runner import RunSummary, Sink, execute, workdir_runtime_env
from tpulaunch.slicespec import SliceSpec


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


@dataclass
class Prepared:
    plan: LaunchPlan
    resolved: ResolvedSlices
    cluster: ray_cluster.ClusterInfo | None  # an existing cluster to join (None: start one)
    framework_reason: str
    request: LaunchRequest
    runtime_env: dict | None  # the working directory Ray ships to every host (checked for size)
    notes: tuple[str, ...] = ()


def _framework(req: LaunchRequest, workdir: Path) -> tuple[str, str]:
    if req.command:
        return "torch_xla", "exec runs a command, no framework boot"
    if req.framework != "auto":
        frameworks.get(req.framework)
        return req.framework, "--framework"
    return frameworks.detect((workdir / req.script).read_text(errors="replace"))


def prepare(req: LaunchRequest) -> Prepared:
    """Everything up to the LaunchPlan. No processes, no Ray; discovery only if asked."""
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
    cluster = ray_cluster.resolve_address(req.address)
    if cluster is not None and not cluster.emulated and not req.queued_resource:
        resolved = _slices_from_ray(req, cluster)
    else:
        resolved = resolve_slices(
            topology=req.topology, accelerator=req.accelerator, chips_per_host=req.chips_per_host,
            tpu=req.tpu, queued_resource=req.queued_resource, zone=req.zone, project=req.project,
            num_slices=req.num_slices, dcn=req.dcn, force=req.force,
            use_metadata=cluster is None or not cluster.emulated,
        )
    notes: list[str] = []
    if cluster is not None and cluster.emulated and cluster.slices:
        resolved = _use_cluster_slices(resolved, cluster)
    if resolved.source == "tpu-api" and cluster is None:
        # Found through the API but nothing to run on from here: rehearse it on this machine.
        t = resolved.topology
        notes.append(
            f"no Ray cluster given (--address): emulating the discovered slice {resolved.slices[0].name}"
            f" ({t.accelerator_type}, {t.topology}) on this machine"
        )
        resolved = ResolvedSlices(
            t, tuple(SliceSpec.emulated_from(t, s.name, i) for i, s in enumerate(resolved.slices)), True, "tpu-api"
        )
    emulated = resolved.emulated or (cluster is not None and cluster.emulated)
    # Checked here so an oversized directory is refused before anything starts.
    runtime_env = workdir_runtime_env(str(workdir), req.max_upload_mb) if req.ship_workdir else None
    fw, reason = _framework(req, workdir)
    if not req.command:
        frameworks.require_installed(fw)
    mesh = plan_mesh(resolved.topology, req.mesh, req.dcn, resolved.num_slices)
    run_id = req.run_id or new_run_id()
    port = req.coordinator_port or (ray_cluster.free_port() if emulated else 8476)
    jax_port = (ray_cluster.free_port() if emulated else 8477) if fw == "jax" else None
    plan = build_plan(
        slices=list(resolved.slices), mesh=mesh, script=script, args=req.args, framework=fw,
        user_env=parse_env(req.env), run_id=run_id, coordinator_port=port, jax_coordinator_port=jax_port,
        emulated=emulated, metadata_server=(resolved.source in ("metadata", "ray")), distributed=req.distributed and not req.command,
        log_dir=str((Path(req.log_dir) / run_id).resolve()), workdir=str(workdir), command=tuple(req.command),
    )
    return Prepared(plan, resolved, cluster, reason, req, runtime_env, tuple(notes))


def _slices_from_ray(req: LaunchRequest, cluster: ray_cluster.ClusterInfo) -> ResolvedSlices:
    """On a real Ray cluster: the slices Ray's TPU labels describe; pick free ones that fit."""
    from tpulaunch import ray_slices, topology

    want = None
    if req.topology or req.accelerator:
        want = topology.resolve(topology=req.topology, accelerator=req.accelerator, chips_per_host=req.chips_per_host)
    ray_cluster.connect(cluster)
    try:
        found = ray_slices.discover()
    finally:
        ray_cluster.disconnect()
    chosen = ray_slices.choose(found, want=want, tpu=req.tpu, num_slices=req.num_slices or 1)
    specs = tuple(s.to_spec(i) for i, s in enumerate(chosen))
    return ResolvedSlices(specs[0].to_topology(req.chips_per_host), specs, False, "ray")


def _use_cluster_slices(resolved: ResolvedSlices, cluster: ray_cluster.ClusterInfo) -> ResolvedSlices:
    """On a warm emulated cluster, run on its slices (their names are what its nodes carry)."""
    from tpulaunch.slicespec import WorkerEndpoint

    specs = []
    for d in cluster.slices:
        workers = tuple(WorkerEndpoint(**w) for w in d.get("workers", ()))
        fields = {k: v for k, v in d.items() if k in SliceSpec.__dataclass_fields__ and k != "workers"}
        specs.append(SliceSpec(**fields, workers=workers))
    if len(specs) != resolved.num_slices or specs[0].to_topology() != resolved.topology:
        have = f"{len(specs)} x {specs[0].accelerator_type} ({specs[0].topology})" if specs else "no slices"
        raise LaunchError(
            f"the running emulated cluster holds {have}, not {resolved.num_slices} x {resolved.topology.accelerator_type}"
            f" ({resolved.topology.topology})",
            "run with the cluster's topology, or `tpulaunch cluster down` and bring up the one you need",
        )
    return ResolvedSlices(resolved.topology, tuple(specs), True, "flags")


class _Terminated(BaseException):
    pass


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise _Terminated()


def launch(prep: Prepared, sink: Sink, *, dashboard: bool = False) -> RunSummary:
    """Get a cluster (start an emulated one if none was given), execute, and clean up after."""
    plan = prep.plan
    owned: ray_cluster.ClusterInfo | None = None
    old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        cluster = prep.cluster
        if cluster is None:
            if not plan.emulated:
                raise LaunchError(
                    "this slice is real but no Ray cluster was given",
                    "bring Ray up on it with `tpulaunch cluster up --tpu NAME` and pass --address auto",
                )
            sink.progress(
                f"starting an emulated Ray cluster: {len(plan.hosts)} host node(s) for "
                f"{plan.mesh.num_slices} x {plan.topology.accelerator_type} ({plan.topology.topology})"
            )
            owned = cluster = ray_cluster.start_emulated(list(plan.slices), plan.topology, dashboard=dashboard,
                                                         progress=sink.progress)
        ray_cluster.connect(cluster, prep.runtime_env)
        signal.signal(signal.SIGTERM, old_term)
        return execute(plan, sink, schedule_timeout_s=prep.request.schedule_timeout, kill_stale=prep.request.kill_stale)
    except _Terminated:
        from tpulaunch.errors import ClusterError, ExitCode

        err = ClusterError("terminated while starting", "nothing was left running")
        err.exit_code = ExitCode.TERMINATED
        raise err from None
    finally:
        signal.signal(signal.SIGTERM, old_term)
        ray_cluster.disconnect()
        if owned is not None:
            sink.progress("stopping the emulated Ray cluster")
            ray_cluster.stop_cluster(owned)


def iter_env_lines(plan: LaunchPlan) -> Iterator[str]:
    for h in plan.hosts:
        yield f"host {h.process_index} (slice {h.slice_index} worker {h.worker_id}, {h.ip}):"
        for k, v in sorted(h.env.items()):
            yield f"  {k}={v}"

