"""`tpulaunch cluster up|status|down`: keep a Ray cluster warm between runs."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from tpulaunch import ray_cluster
from tpulaunch.cli import app
from tpulaunch.cli.cmd_mesh import NUM_SLICES_OPT
from tpulaunch.cli.cmd_topology import ACCEL_OPT, CHIPS_PER_HOST_OPT, JSON_OPT, TOPOLOGY_OPT
from tpulaunch.cli.output import Output
from tpulaunch.errors import ClusterError
from tpulaunch.resolve import resolve_slices

cluster_app = typer.Typer(help="Start, inspect and stop the Ray cluster runs use.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("up")
def up(
    topology: Optional[str] = TOPOLOGY_OPT,
    accelerator: Optional[str] = ACCEL_OPT,
    chips_per_host: Optional[int] = CHIPS_PER_HOST_OPT,
    num_slices: Optional[int] = NUM_SLICES_OPT,
    name: str = typer.Option("emulated", "--name", help="Slice name the emulated hosts carry (ray.io/tpu-slice-name)."),
    dashboard: bool = typer.Option(False, "--dashboard", help="Also start Ray's dashboard (bound to 127.0.0.1)."),
    json_out: bool = JSON_OPT,
) -> None:
    """Start an emulated slice cluster on this machine and leave it running.

    Then `tpulaunch run SCRIPT --address auto` reuses it; `tpulaunch cluster down` stops it.
    """
    out = Output(json_mode=json_out)
    rec = ray_cluster.load_record()
    if rec is not None and rec.temp_dir and ray_cluster.cluster_pids(rec.temp_dir):
        raise ClusterError(f"a cluster is already up at {rec.address}", "stop it first with `tpulaunch cluster down`")
    resolved = resolve_slices(topology=topology, accelerator=accelerator, chips_per_host=chips_per_host,
                              num_slices=num_slices, slice_name=name, use_metadata=False)
    t = resolved.topology
    with out.status(f"starting {len(resolved.slices) * t.num_hosts} emulated host node(s) ...") as st:
        def progress(msg: str) -> None:
            if st is not None:
                st.update(msg)
            else:
                out.info(msg)

        info = ray_cluster.start_emulated(list(resolved.slices), t, dashboard=dashboard, progress=progress)
    ray_cluster.save_record(info)
    if json_out:
        out.json({"schema": "tpulaunch.cluster/v1", "address": info.address, "emulated": True,
                  "slices": info.slices, "token_path": info.token_path})
    else:
        out.warn(f"EMULATED cluster: {len(resolved.slices)} x {t.accelerator_type} ({t.topology}) on this machine")
        out.line(f"cluster up at {info.address} (token auth on; token in {info.token_path})")


def _status_doc(info: ray_cluster.ClusterInfo) -> dict:
    from tpulaunch import ray_slices

    ray_cluster.connect(info)  # before Ray is imported: it reads its auth settings from the env
    try:
        found = ray_slices.discover()
    finally:
        ray_cluster.disconnect()
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
    json_out: bool = JSON_OPT,
) -> None:
    """Each slice the cluster knows, its hosts, which are alive and which are busy with a run."""
    out = Output(json_mode=json_out)
    info = ray_cluster.resolve_address(address)
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


@cluster_app.command("down")
def down(json_out: bool = JSON_OPT) -> None:
    """Stop the cluster `tpulaunch cluster up` started (only its processes)."""
    out = Output(json_mode=json_out)
    rec = ray_cluster.load_record()
    if rec is None:
        raise ClusterError("no cluster is recorded as up", "nothing to stop (`tpulaunch cluster up` starts one)")
    n = ray_cluster.stop_cluster(rec)
    ray_cluster.clear_record()
    if json_out:
        out.json({"schema": "tpulaunch.cluster-down/v1", "address": rec.address, "processes_stopped": n})
    else:
        out.line(f"cluster {rec.address} stopped ({n} processes)")
