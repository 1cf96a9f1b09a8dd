"""`tpulaunch cluster up|status|env|down`: keep a Ray cluster warm between runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from tpulaunch import discover
from tpulaunch.cluster import emulated
from tpulaunch.cluster.connect import connect, disconnect, resolve_address
from tpulaunch.cluster.record import ClusterInfo, clear_record, load_record, record_path, save_record, state_dir
from tpulaunch.cli import app
from tpulaunch.cli import cmd_cluster_remote as remote
from tpulaunch.cli import options as opt
from tpulaunch.cli.output import Output
from tpulaunch.errors import ClusterError, LaunchError, TpulaunchError
from tpulaunch.host import frameworks
from tpulaunch.plan import topology as topo_mod

cluster_app = typer.Typer(help="Start, inspect and stop the Ray cluster runs use.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
remote.register(cluster_app)  # `cluster join`, `cluster doctor`


@cluster_app.command("up")
def up(
    topology: Optional[str] = opt.TOPOLOGY,
    accelerator: Optional[str] = opt.ACCELERATOR,
    chips_per_host: Optional[int] = opt.CHIPS_PER_HOST,
    num_slices: Optional[int] = opt.NUM_SLICES,
    name: str = typer.Option("emulated", "--name", help="Slice name the emulated hosts carry (ray.io/tpu-slice-name)."),
    dashboard: bool = typer.Option(True, "--dashboard/--no-dashboard",
                                   help="Ray's dashboard on the head: the job API detached runs need (emulated: bound"
                                        " to 127.0.0.1; token auth on)."),
    prewarm: str = typer.Option("torch_xla", "--prewarm",
                                help="Leave a spare process with this framework imported on every host: torch_xla, jax, none."),
    tpu: Optional[list[str]] = typer.Option(None, "--tpu",
                                            help="A real TPU VM slice (node name): bring Ray up on its workers over gcloud"
                                                 " ssh. Repeat it for a multislice cluster (with --head local)."),
    zone: Optional[str] = opt.ZONE,
    project: Optional[str] = opt.PROJECT,
    port: int = typer.Option(remote.RAY_PORT_DEFAULT, "--port", min=1, max=65535,
                             help="--tpu: the Ray head's GCS port on worker 0."),
    remote_python: str = typer.Option(remote.REMOTE_PYTHON_DEFAULT, "--remote-python",
                                      help="--tpu: the Python on the TPU VMs that has Ray installed."),
    ray_temp_dir: Optional[str] = typer.Option(None, "--ray-temp-dir",
                                               help="--tpu: Ray's temp dir on the VMs (default /tmp/tpl-<hash>)."),
    head: str = typer.Option("worker-0", "--head",
                             help="--tpu: where the Ray head runs: worker-0, or local (this machine, off the slice:"
                                  " a preemption of the slice then spares the head and detached runs)."),
    head_ip: Optional[str] = typer.Option(None, "--head-ip",
                                          help="--head local: the address the TPU workers reach this machine at"
                                               " (default: this machine's address on the route to worker 0)."),
    setup: Optional[str] = typer.Option(None, "--setup", metavar="CMD",
                                        help="--tpu: a shell command every worker runs before it joins (e.g. 'pip install"
                                             " -r requirements.txt'); again on re-created VMs."),
    setup_script: Optional[Path] = typer.Option(None, "--setup-script", metavar="FILE",
                                                help="--tpu: like --setup, a script file read here."),
    json_out: bool = opt.JSON,
) -> None:
    """Start a Ray cluster and leave it running: emulated on this machine, or on a real slice (--tpu).

    Then `tpulaunch run SCRIPT --address auto` reuses it; `tpulaunch cluster down` stops it.
    With --tpu, hosts already in the cluster are left alone, so running it again is safe.
    """
    out = Output(json_mode=json_out)
    script = remote.setup_text(setup, setup_script)
    if tpu:
        remote.up_remote(out, tpu, zone, project, port=port, python=remote_python, temp_dir=ray_temp_dir,
                         dashboard=dashboard, topology=topology, accelerator=accelerator, json_out=json_out,
                         head=head, head_ip=head_ip, setup=script)
        return
    if script:
        raise LaunchError("--setup and --setup-script are for TPU VMs (--tpu)", "emulated hosts share this machine")
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
    resolved = discover.emulated_slices(topo, discover.request_num_slices(req), name)
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
        save_record(info)
        if prewarm != "none":
            from tpulaunch.run.warm import prewarm_cluster

            progress(f"starting a spare {prewarm} process on every host")
            try:
                prewarm_cluster(info, prewarm)
            except TpulaunchError as e:  # the cluster is up; runs start fresh processes instead
                out.warn(f"no spare processes: {e.line()}")
    if json_out:
        out.json({"schema": "tpulaunch.cluster/v1", "address": info.address, "emulated": True,
                  "slices": [s.to_dict() for s in info.slices], "token_path": info.token_path,
                  "dashboard": info.dashboard})
    else:
        out.warn(f"EMULATED cluster: {len(resolved.slices)} x {t.accelerator_type} ({t.topology}) on this machine")
        out.line(f"cluster up at {info.address} (token auth on; token in {info.token_path})")


def _status_doc(info: ClusterInfo) -> dict:
    if info.remote:
        return remote.status_doc_remote(info)
    from tpulaunch.discover import ray_labels

    connect(info)  # before Ray is imported: it reads its auth settings from the env
    try:
        found = ray_labels.read_slices()
    finally:
        disconnect()
    return {
        "schema": "tpulaunch.cluster-status/v1", "address": info.address, "emulated": info.emulated,
        "slices": [
            {"name": s.name, "pod_type": s.pod_type, "topology": s.topology,
             "hosts": [{"worker_id": w, "node_ip": ip, "alive": alive, "busy": busy} for w, ip, alive, busy in s.workers]}
            for s in found
        ],
    }


@cluster_app.command("status")
def status(
    address: Optional[str] = typer.Option("auto", "--address", help="auto (the cluster `cluster up` started), HOST:PORT."),
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
    out.line(f"cluster {doc['address']}" + (" (EMULATED)" if doc["emulated"] else ""))
    table = Table()
    for col in ("slice", "type", "topology", "worker", "alive", "busy", "node"):
        table.add_column(col)
    for s in doc["slices"]:
        for h in s["hosts"]:
            row = [s["name"], s["pod_type"] or "", s["topology"] or "", str(h["worker_id"]),
                   "yes" if h["alive"] else "NO", "yes" if h["busy"] else "no", h["node_ip"] or ""]
            if out.rich:
                table.add_row(*row)
            else:
                out.line(" ".join(f"{k}={v}" for k, v in zip(("slice", "type", "topology", "worker", "alive", "busy", "node"), row)))
    if out.rich:
        out.result(table)


@cluster_app.command("env")
def env(
    address: Optional[str] = typer.Option("auto", "--address", help="auto (the cluster `cluster up` started), HOST:PORT."),
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
    if force:
        _down_force(out, json_out, every_home)
        return
    rec = load_record()
    if rec is None:
        raise ClusterError("no cluster is recorded as up", "nothing to stop (`tpulaunch cluster up` starts one;"
                                                           " `cluster down --force` finds unrecorded ones)")
    if rec.remote:
        remote.down_remote(out, rec, json_out)
        return
    n = emulated.stop_cluster(rec, record=str(record_path()))
    clear_record()
    if json_out:
        out.json({"schema": "tpulaunch.cluster-down/v1", "address": rec.address, "processes_stopped": n})
    else:
        out.line(f"cluster {rec.address} stopped ({n} processes)")


def _down_force(out: Output, json_out: bool, every_home: bool) -> None:
    """This home's clusters on this machine (every home's with `every_home`), by marker; the record
    goes too (readable or not)."""
    from tpulaunch.cluster import ownership

    try:
        rec = load_record()
    except TpulaunchError as e:
        out.warn(f"{e.message}: removing it")
        rec = None
    if rec is not None and rec.remote:
        raise ClusterError(f"the recorded cluster runs on TPU '{rec.remote.tpu}', not here",
                           "`tpulaunch cluster down` (without --force) stops it over gcloud ssh")
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
            out.line(f"cluster {c['cluster_id']} ({c['temp_dir'] or 'temp dir gone'}) stopped ({c['processes_stopped']} processes)")
