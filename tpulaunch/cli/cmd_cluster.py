"""`tpulaunch cluster up|status|env|down`: keep a Ray cluster warm between runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import typer
from rich.status import Status
from rich.table import Table

from tpulaunch import discover
from tpulaunch.cli import app
from tpulaunch.cli import cmd_cluster_remote as remote
from tpulaunch.cli import options as opt
from tpulaunch.cli.output import Output
from tpulaunch.cluster import emulated, worker_commands
from tpulaunch.cluster.connect import resolve_address
from tpulaunch.cluster.record import (
    ClusterInfo,
    clear_record,
    driver_log_path,
    load_record,
    record_path,
    save_record,
    state_dir,
    writable_state_dir,
)
from tpulaunch.errors import ClusterError, LaunchError, TpulaunchError
from tpulaunch.host import frameworks
from tpulaunch.plan import mesh as mesh_mod
from tpulaunch.plan import topology as topo_mod

cluster_app = typer.Typer(help="Start, inspect and stop the Ray cluster runs use.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
remote.register(cluster_app)  # `cluster join`, `cluster doctor`


@cluster_app.command("up")
def up(
    topology: str | None = opt.TOPOLOGY,
    accelerator: str | None = opt.ACCELERATOR,
    chips_per_host: int | None = opt.CHIPS_PER_HOST,
    num_slices: int | None = opt.NUM_SLICES,
    name: str = typer.Option("emulated", "--name", help="Slice name the emulated hosts carry (ray.io/tpu-slice-name)."),
    dashboard: bool = typer.Option(True, "--dashboard/--no-dashboard",
                                   help="Ray's dashboard on the head: the job API detached runs need (emulated: bound"
                                        " to 127.0.0.1; token auth on)."),
    prewarm: str = typer.Option("torch_xla", "--prewarm",
                                help="Leave a spare process with this framework imported on every host: torch_xla,"
                                     " jax, none."),
    tpu: list[str] | None = typer.Option(None, "--tpu",
                                         help="A real TPU VM slice (node name): bring Ray up on its workers over gcloud"
                                              " ssh. Repeat it for a multislice cluster (with --head local)."),
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    port: int = typer.Option(worker_commands.DEFAULT_PORT, "--port", min=1, max=65535,
                             help="--tpu: the Ray head's GCS port on worker 0."),
    remote_python: str = typer.Option(worker_commands.DEFAULT_PYTHON, "--remote-python",
                                      help="--tpu: the Python on the TPU VMs that has Ray installed."),
    ray_temp_dir: str | None = typer.Option(None, "--ray-temp-dir",
                                            help="--tpu: Ray's temp dir on the VMs (default /tmp/tpl-<hash>)."),
    head: str = typer.Option("worker-0", "--head",
                             help="--tpu: where the Ray head runs: worker-0, or local (this machine, off the slice:"
                                  " a preemption of the slice then spares the head and detached runs)."),
    head_ip: str | None = typer.Option(None, "--head-ip",
                                       help="--head local: the address the TPU workers reach this machine at"
                                            " (default: this machine's address on the route to worker 0)."),
    setup: str | None = typer.Option(None, "--setup", metavar="CMD",
                                     help="--tpu: a shell command every worker runs before it joins (e.g. 'pip install"
                                          " -r requirements.txt'); again on re-created VMs."),
    setup_script: Path | None = typer.Option(None, "--setup-script", metavar="FILE",
                                             help="--tpu: like --setup, a script file read here."),
    spare_slices: int = typer.Option(0, "--spare-slices", metavar="K", min=0, max=64,
                                     help="K more slices of the same shape, joined and warm, held in reserve: one takes"
                                          " a lost (or hung) slice's place in a run at once, and the lost one comes"
                                          " back as the spare."),
    gke: bool = typer.Option(False, "--gke", help="A KubeRay RayCluster on GKE's TPU node pools (with --topology,"
                                                  " --accelerator, --image; or --join NAME)."),
    image: str | None = typer.Option(None, "--image", help="--gke: the image every pod runs (with this tpulaunch and"
                                                           " its Ray)."),
    spot: bool = typer.Option(False, "--spot", help="--gke: the slices on spot node pools."),
    autoscaler: bool = opt.AUTOSCALER,
    join_name: str | None = typer.Option(None, "--join", metavar="NAME",
                                         help="--gke: adopt the KubeRay cluster NAME (`cluster down` leaves it"
                                              " standing)."),
    placement_policy: str | None = typer.Option(None, "--placement-policy",
                                                help="--gke, tpu7x multi-host: the workload policy of the node pools."),
    head_cpu: str = typer.Option("2", "--head-cpu", help="--gke: the head pod's CPU (a CPU node, never a TPU one)."),
    head_memory: str = typer.Option("8Gi", "--head-memory", help="--gke: the head pod's memory."),
    timeout: float = typer.Option(900.0, "--timeout", metavar="SECONDS",
                                  help="--gke: wait this long for every host of every slice to be in Ray."),
    kubeconfig: str | None = opt.KUBECONFIG,
    context: str | None = opt.CONTEXT,
    namespace: str | None = opt.NAMESPACE,
    dry_run: bool = typer.Option(False, "--dry-run", help="--gke: print the RayCluster it would apply; touch nothing."),
    json_out: bool = opt.JSON,
) -> None:
    """Start a Ray cluster and leave it running: emulated on this machine, on real slices (--tpu), or on GKE (--gke).

    Then `tpulaunch run SCRIPT --address auto` reuses it; `tpulaunch cluster down` stops it.
    With --tpu, hosts already in the cluster are left alone, so running it again is safe.
    """
    out = Output(json_mode=json_out)
    if num_slices is not None and not gke:  # (GKE's request checks its own, the same bound)
        mesh_mod.check_slice_count(num_slices)  # before anything is built per slice
    script = remote.setup_text(setup, setup_script)
    if not dry_run:  # the record, tokens and Ray's messages go there: known usable before anything starts
        writable_state_dir()
        driver_log_path()
    if gke:
        from tpulaunch.cli import gke_views
        from tpulaunch.kube import KubeTarget
        from tpulaunch.providers import gke as gke_provider

        if tpu or script:
            raise LaunchError("--gke with --tpu/--setup: a cluster is on GKE or on TPU VMs", "give one of them")
        target = KubeTarget(kubeconfig, context, namespace)
        _refuse_if_up(gke=True, name=join_name or ("tpulaunch" if name == "emulated" else name))
        if join_name:
            if spare_slices:
                raise LaunchError(f"--spare-slices with --join {join_name}: a joined cluster is not tpulaunch's to add"
                                  " slices to", "drop --spare-slices, or bring up a cluster of tpulaunch's own")
            info = gke_provider.join(target, join_name, lambda msg: out.info(msg))
        else:
            if not topology or not accelerator:
                raise LaunchError("--gke needs --topology and --accelerator", "e.g. --topology 2x2x2 --accelerator v5p")
            if not math.isfinite(timeout) or timeout <= 0:
                raise LaunchError(f"--timeout {timeout:g} is not a positive number of seconds", "e.g. --timeout 900")
            up_req = gke_provider.UpRequest(target, "tpulaunch" if name == "emulated" else name, topology,
                                            accelerator, num_slices or 1, chips_per_host, spot, image, placement_policy,
                                            head_cpu, head_memory, timeout, spare_slices, autoscaler)
            if dry_run:
                doc = gke_provider.dry_run(up_req)
                if json_out:
                    out.json(doc)
                else:
                    import json as _json

                    out.line(_json.dumps(doc, indent=2))
                return
            checked = gke_provider.check_up(up_req)  # before any progress line: a bad request is one line
            with out.status(f"bringing up RayCluster {up_req.name} on GKE ...") as st:
                info = gke_provider.up(checked, _say(out, st))
        gke_spec = info.gke
        assert gke_spec is not None  # a GKE cluster's record says where it is (`up` and `join` set it)
        if json_out:
            out.json({"schema": "tpulaunch.cluster/v1", "address": info.address, "emulated": False,
                      "slices": [s.to_dict() for s in info.slices], "token_path": info.token_path,
                      "gke": gke_spec.to_dict(), "spares": list(info.spares)})
        else:
            what = ", ".join(f"{s.name} ({s.accelerator_type}, {len(s.workers)} hosts)" for s in info.slices)
            out.line(f"cluster up: RayCluster {gke_spec.name} in namespace {gke_spec.namespace}: {what}")
            for line in gke_views.reach_lines(info):
                out.info(line)
        return
    if image or spot or join_name or placement_policy or dry_run or autoscaler:
        raise LaunchError("--image, --spot, --join, --placement-policy, --autoscaler and --dry-run go with --gke",
                          "add --gke")
    if tpu:
        remote.up_remote(out, tpu, zone, project, port=port, python=remote_python, temp_dir=ray_temp_dir,
                         dashboard=dashboard, topology=topology, accelerator=accelerator, json_out=json_out,
                         head=head, head_ip=head_ip, setup=script, spare_slices=spare_slices)
        return
    if script:
        raise LaunchError("--setup and --setup-script are for TPU VMs (--tpu)", "emulated hosts share this machine")
    _refuse_if_up(gke=False)
    if prewarm not in frameworks.names():
        raise LaunchError(f"--prewarm {prewarm} is not a framework", f"choose one of {', '.join(frameworks.names())}")
    rec = load_record()
    if rec is not None and rec.remote:
        raise ClusterError(f"a cluster on TPU '{rec.remote.tpu}' is recorded as up",
                           "stop it first with `tpulaunch cluster down`")
    if rec is not None and rec.running_here:
        raise ClusterError(f"a cluster is already up at {rec.address}", "stop it first with `tpulaunch cluster down`")
    req = discover.SliceRequest(topology=topology, accelerator=accelerator, chips_per_host=chips_per_host,
                                num_slices=num_slices, name=name)
    topo = topo_mod.resolve(topology=topology, accelerator=accelerator, chips_per_host=chips_per_host)
    wanted = discover.request_num_slices(req)
    resolved = discover.emulated_slices(topo, wanted + spare_slices, name)
    t = resolved.topology
    with out.status(f"starting {len(resolved.slices) * t.num_hosts} emulated host node(s) ...") as st:
        def progress(msg: str) -> None:
            if st is not None:
                st.update(msg)
            else:
                out.info(msg)

        # Other drivers (Ray Train) may use this cluster: their workers' output must reach them.
        info = emulated.start_emulated(list(resolved.slices), t, dashboard=dashboard, log_monitor=True,
                                       progress=progress)
        try:
            info.spares = [s.name for s in resolved.slices[wanted:]]  # the last K: in reserve
            save_record(info)
            if prewarm != "none":
                from tpulaunch.run.warm import prewarm_cluster

                progress(f"starting a spare {prewarm} process on every host")
                try:
                    prewarm_cluster(info, prewarm)
                except TpulaunchError as e:  # the cluster is up; runs start fresh processes instead
                    out.warn(f"no spare processes: {e.line()}")
        except TpulaunchError as e:
            _abandon(info)
            e.hint = (f"{e.hint}; " if e.hint else "") + f"the cluster it started ({info.temp_dir}) was stopped"
            raise
        except BaseException:
            _abandon(info)
            raise
    if json_out:
        out.json({"schema": "tpulaunch.cluster/v1", "address": info.address, "emulated": True,
                  "slices": [s.to_dict() for s in info.slices], "token_path": info.token_path,
                  "dashboard": info.dashboard, "spares": list(info.spares)})
    else:
        out.warn(f"EMULATED cluster: {len(resolved.slices)} x {t.accelerator_type} ({t.topology}) on this machine"
                 + (f", {spare_slices} of them spare ({', '.join(info.spares)})" if spare_slices else ""))
        out.line(f"cluster up at {info.address} (token auth on; token in {info.token_path})")


def _abandon(info: ClusterInfo) -> None:
    """A `cluster up` that failed (or was interrupted) after its nodes started leaves nothing: its
    processes and temp dir go, and so does its record if it was written."""
    try:
        emulated.stop_cluster(info)
    except Exception as e:  # the error that ended `cluster up` is the one to report
        Output().warn(f"the cluster {info.address or info.temp_dir} could not be stopped ({e});"
                      " `tpulaunch cluster down --force` finds it")
    try:
        rec = load_record()
    except TpulaunchError:
        rec = None
    if rec is not None and rec.cluster_id == info.cluster_id:
        clear_record()


def _say(out: Output, st: Status | None) -> Callable[[str], None]:  # st: a rich status, None in a pipe
    def say(msg: str) -> None:
        if st is not None:
            st.update(msg)
        out.info(msg) if st is None or not out.interactive else None

    return say


def _refuse_if_up(gke: bool, name: str | None = None) -> None:
    """One cluster is recorded at a time: a second `cluster up` of another kind (or another RayCluster)
    is refused; the same one again is not (hosts already up are left alone)."""
    rec = load_record()
    if rec is None:
        return
    if rec.gke is not None and (not gke or (name is not None and name != rec.gke.name)):
        raise ClusterError(f"a cluster on GKE (RayCluster {rec.gke.name}) is recorded as up",
                           "stop it first with `tpulaunch cluster down`")
    if gke and (rec.remote or (rec.emulated and rec.running_here)):
        raise ClusterError(f"a cluster is recorded as up at {rec.address}",
                           "stop it first with `tpulaunch cluster down`")


def _status_doc(info: ClusterInfo) -> dict:
    from tpulaunch import providers

    provider = providers.of(info)
    doc = provider.status()
    spares = set(provider.spares())
    doc["spares"] = sorted(spares)
    for s in doc["slices"]:
        s["spare"] = s["name"] in spares
    doc["not_whole"] = provider.not_whole(doc)
    return doc


@cluster_app.command("status")
def status(
    address: str | None = typer.Option("auto", "--address", help="auto (the cluster `cluster up` started), HOST:PORT."),
    json_out: bool = opt.JSON,
) -> None:
    """Each slice the cluster knows, its hosts, which are alive and which are busy with a run."""
    out = Output(json_mode=json_out)
    info = resolve_address(address)
    assert info is not None
    doc = _status_doc(info)
    if json_out:
        out.json(doc)
        return
    out.line(f"cluster {doc['address']}" + (" (EMULATED)" if doc["emulated"] else "")
             + (f"; spare slice(s): {', '.join(doc['spares'])}" if doc["spares"] else ""))
    for name, why in doc.get("not_whole", {}).items():
        out.warn(f"slice {name}: {why}: `tpulaunch cluster repair` brings it back")
    table = Table()
    cols = ("slice", "type", "topology", "worker", "alive", "busy", "node")
    for col in cols:
        table.add_column(col)
    spare_names = set(doc["spares"])
    for s in doc["slices"]:
        if s.get("maintenance_at"):
            out.warn(f"slice {s['name']}: host maintenance scheduled at {s['maintenance_at']}"
                     f" (node pool {s.get('node_pool')})")
        for h in s["hosts"]:
            row = [s["name"] + (" (spare)" if s["name"] in spare_names else ""), s["pod_type"] or "",
                   s["topology"] or "", str(h["worker_id"]),
                   "yes" if h["alive"] else "NO", "?" if h["busy"] is None else "yes" if h["busy"] else "no",
                   h["node_ip"] or ""]
            if out.rich:
                table.add_row(*row)
            else:
                out.line(" ".join(f"{k}={v}" for k, v in zip(cols, row, strict=True)))
    if out.rich:
        out.result(table)


@cluster_app.command("env")
def env(
    address: str | None = typer.Option("auto", "--address", help="auto (the cluster `cluster up` started), HOST:PORT."),
    json_out: bool = opt.JSON,
) -> None:
    """Shell exports a Ray driver needs for this cluster: `eval "$(tpulaunch cluster env)"`.

    RAY_ADDRESS, the token-auth variables (Ray reads them before `import ray` returns) and, on
    an emulated cluster, the settings that keep Ray's background work low.
    """
    import shlex

    out = Output(json_mode=json_out)
    info = resolve_address(address)
    assert info is not None
    values = {"RAY_ADDRESS": info.address, **info.ray_env()}
    if json_out:
        out.json({"schema": "tpulaunch.cluster-env/v1", "env": values})
        return
    # Plain text, never rich markup: this is shell code.
    typer.echo("".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items()), nl=False)


@cluster_app.command("repair")
def repair(
    timeout: float = typer.Option(1800.0, "--timeout", metavar="SECONDS",
                                  help="Wait this long for the slices to be made again and joined."),
    json_out: bool = opt.JSON,
) -> None:
    """Bring back every slice of the recorded cluster that is not whole in Ray.

    A re-creation belongs to the cluster, not to the run that started it: a slice a stopped run was
    making again (its queued resource still waiting for capacity), a preempted spot slice no run
    was there to bring back, an emulated host whose node went. Hosts already in Ray are left alone.
    """
    from tpulaunch import providers

    out = Output(json_mode=json_out)
    if not math.isfinite(timeout) or timeout <= 0:
        raise LaunchError(f"--timeout {timeout:g} is not a positive number of seconds", "e.g. --timeout 1800")
    rec = load_record()
    if rec is None:
        raise ClusterError("no cluster is recorded as up", "`tpulaunch cluster up` starts one")
    with out.status(f"checking the slices of the cluster at {rec.address} ...") as st:
        repaired = providers.of(rec).repair(timeout, _say(out, st))
    if json_out:
        out.json({"schema": "tpulaunch.cluster-repair/v1", "address": rec.address, "repaired": repaired})
    else:
        out.line(f"repaired {', '.join(repaired)}" if repaired else "every slice is whole: nothing to repair")


@cluster_app.command("down")
def down(
    force: bool = typer.Option(False, "--force",
                               help="Stop the clusters this TPULAUNCH_HOME started on this machine, found by their"
                                    " markers (when the record is gone or unreadable)."),
    every_home: bool = typer.Option(False, "--all",
                                    help="With --force: every tpulaunch cluster on this machine, whatever state"
                                         " directory (TPULAUNCH_HOME) started it."),
    json_out: bool = opt.JSON,
) -> None:
    """Stop the cluster `tpulaunch cluster up` started (only its processes).

    Only what tpulaunch can prove it started is stopped or deleted: the processes carrying the
    cluster's id, and its temp dir if the dir is marked for it. A record naming anything else is
    refused (exit 6). `--force` needs no record: it finds tpulaunch's clusters here by their markers,
    those another TPULAUNCH_HOME started (a parallel CI job's) excepted unless `--all`.
    """
    out = Output(json_mode=json_out)
    if every_home and not force:
        raise LaunchError("--all goes with --force", "`tpulaunch cluster down --force --all` stops every cluster here")
    writable_state_dir()  # the record goes once the cluster has: a home that cannot lose it stops nothing
    if force:
        _down_force(out, json_out, every_home)
        return
    rec = load_record()
    if rec is None:
        raise ClusterError("no cluster is recorded as up", "nothing to stop (`tpulaunch cluster up` starts one;"
                                                           " `cluster down --force` finds unrecorded ones)")
    from tpulaunch import providers

    provider = providers.of(rec)
    names = {s.name: len(s.workers) for s in rec.slices} if rec.remote else {}
    # a cluster on this machine stops in a moment: no progress line for it
    quiet = Output(json_mode=json_out, quiet=True) if provider.kind == "emulated" else out
    with quiet.status(f"stopping the cluster at {rec.address} ...") as st:
        done = provider.down(remote.HostProgress(out, st, names))
    if json_out:
        out.json({"schema": "tpulaunch.cluster-down/v1", "address": rec.address, **done})
    elif "left_standing" in done:
        out.line(f"cluster {rec.address}: forgotten here; RayCluster {done['left_standing']} was joined, not made, and"
                 " is left standing")
    elif "deleted" in done:
        out.line(f"cluster {rec.address} deleted ({', '.join(done['deleted']) or 'nothing was left'})")
    else:
        hosts = f" on {sum(names.values())} hosts" if names else ""
        out.line(f"cluster {rec.address} stopped ({done['processes_stopped']} processes{hosts})")


def _down_force(out: Output, json_out: bool, every_home: bool) -> None:
    """This home's clusters on this machine (every home's with `every_home`), by marker; the record
    goes too (readable or not)."""
    from tpulaunch.cluster import ownership

    try:
        rec = load_record()
    except TpulaunchError as e:
        out.warn(f"{e.message}: removing it")
        rec = None
    if rec is not None and (rec.remote or rec.gke):
        raise ClusterError(f"the recorded cluster runs at {rec.address}, not here",
                           "`tpulaunch cluster down` (without --force) stops it")
    stopped = []
    for orphan in ownership.find_orphans(None if every_home else state_dir()):
        n = emulated.stop_owned(orphan.cluster_id, orphan.temp_dir)
        stopped.append({"cluster_id": orphan.cluster_id, "temp_dir": orphan.temp_dir, "processes_stopped": n})
    path = record_path()
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path)
    clear_record()
    if json_out:
        out.json({"schema": "tpulaunch.cluster-down/v1", "force": True, "clusters": stopped})
    elif not stopped:
        out.line("no cluster of tpulaunch's runs on this machine")
    else:
        for c in stopped:
            out.line(f"cluster {c['cluster_id']} ({c['temp_dir'] or 'temp dir gone'}) stopped"
                     f" ({c['processes_stopped']} processes)")
