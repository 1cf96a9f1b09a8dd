"""`tpulaunch slice describe|list`: what a real slice is, as the Cloud TPU API or metadata server see it.

Thin: the library (`tpulaunch.discover`) finds the slice; this module only picks the source
from the arguments and renders (rich on a terminal, `key: value` lines in a pipe, `--json`).
"""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Group

from tpulaunch import discover
from tpulaunch.cli import app
from tpulaunch.cli import options as opt
from tpulaunch.cli.output import Output
from tpulaunch.cli.slice_views import (
    describe_lines,
    describe_rich,
    mesh_doc,
    mesh_lines,
    mesh_rich,
    print_table,
    slice_doc,
)
from tpulaunch.errors import LaunchError, TpulaunchError

slice_app = typer.Typer(
    name="slice",
    help="Find and describe real Cloud TPU slices (Cloud TPU API, or the metadata server on a TPU VM).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(slice_app, name="slice")

TIMEOUT_OPT = typer.Option(
    None, "--timeout", metavar="S",
    help="Seconds to wait for the Cloud TPU API (default 10, TPULAUNCH_API_TIMEOUT) or for each metadata request"
         " (default 2).",
)


# -- describe ------------------------------------------------------------------------------------


@slice_app.command("describe")
def describe_cmd(
    name: str | None = typer.Argument(
        None, metavar="[NAME]",
        help="TPU node name (or projects/P/locations/Z/nodes/N). Omit on a TPU VM: describe the slice it is part of.",
    ),
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    queued_resource: str | None = typer.Option(
        None, "--queued-resource", metavar="QR", help="Describe every slice (node) of this queued resource."
    ),
    json_out: bool = opt.JSON,
    timeout: float | None = TIMEOUT_OPT,
    force: bool = typer.Option(False, "--force",
                               help="Exit 0 even if the slice is not READY/HEALTHY (warn instead of exit 4)."),
    gke: bool = opt.GKE,
    kubeconfig: str | None = opt.KUBECONFIG,
    context: str | None = opt.CONTEXT,
    namespace: str | None = opt.NAMESPACE,
) -> None:
    """Show a slice: type, topology, state, health, each worker's IPs, and the mesh tpulaunch would build.

    Exits 4 when the slice is not READY, not HEALTHY, or reports symptoms (after printing it).
    Examples: `tpulaunch slice describe my-v4 --zone us-central2-b`, `tpulaunch slice describe` on a TPU VM,
    `tpulaunch slice describe POOL --gke` (a GKE TPU node pool).
    """
    out = Output(json_mode=json_out)
    if gke:
        from tpulaunch import kube
        from tpulaunch.cli import gke_views

        if not name:
            raise TpulaunchError("--gke needs the node pool's NAME", "`tpulaunch slice list --gke` lists them")
        gke_views.describe_pool(out, kube.KubeTarget(kubeconfig, context, namespace), name, json_out, force)
        return
    this_worker: int | None = None
    if queued_resource:
        if name:
            raise TpulaunchError("give a node NAME or --queued-resource, not both")
        with out.status(f"asking the Cloud TPU API about queued resource {queued_resource} ..."):
            specs = discover.describe_queued_resource(queued_resource, zone=zone, project=project, timeout=timeout)
    elif name:
        with out.status(f"asking the Cloud TPU API about {name} ..."):
            specs = [discover.describe_node(name, zone=zone, project=project, timeout=timeout)]
    else:
        if zone or project:
            raise TpulaunchError("--zone/--project need a node NAME or --queued-resource",
                                 "tpulaunch slice describe NAME --zone ZONE")
        local = discover.local_host(timeout)
        if local is None:
            raise TpulaunchError(
                "no slice named, and this machine is not a TPU VM (no /dev/accel*, no TPULAUNCH_METADATA_HOST)",
                "name one: tpulaunch slice describe NAME --zone ZONE [--project PROJECT], or --queued-resource QR",
            )
        specs, this_worker = [local.spec], local.worker_id

    docs = [slice_doc(s, this_worker=this_worker) for s in specs]
    mesh = mesh_doc(specs)
    if queued_resource:
        doc: dict[str, Any] = {
            "schema": "tpulaunch.slices/v1",
            "queued_resource": specs[0].queued_resource,
            "queued_resource_state": specs[0].provenance.get("queued_resource_state"),
            "slices": docs,
        }
        if mesh is not None:
            doc["mesh"] = mesh
    else:
        doc = docs[0]
        if mesh is not None:
            doc["mesh"] = mesh

    if json_out:
        out.json(doc)
    elif out.rich:
        out.result(Group(*[describe_rich(d) for d in docs], *mesh_rich(mesh)))
    else:
        lines: list[str] = []
        if queued_resource:
            lines += [f"queued_resource: {doc['queued_resource']}",
                      f"queued_resource_state: {doc['queued_resource_state']}"]
        for d in docs:
            if queued_resource:
                lines.append("")
            lines += describe_lines(d)
        lines += mesh_lines(mesh)
        for line in lines:
            out.line(line)

    for s in specs:
        for problem in discover.check_ready(s, force):
            out.warn(f"slice '{s.name}': {problem} (ignored because of --force)")


# -- list ----------------------------------------------------------------------------------------


@slice_app.command("list")
def list_cmd(
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    json_out: bool = opt.JSON,
    timeout: float | None = TIMEOUT_OPT,
    gke: bool = opt.GKE,
    kubeconfig: str | None = opt.KUBECONFIG,
    context: str | None = opt.CONTEXT,
    namespace: str | None = opt.NAMESPACE,
) -> None:
    """List the TPU nodes of a zone (`--zone -` for every zone): type, topology, state, health.

    With --gke: every TPU node pool of the GKE cluster as a slice (generation, topology, hosts ready
    of expected, chips a node, machine type, spot, zone, upcoming maintenance).
    """
    out = Output(json_mode=json_out)
    if gke:
        from tpulaunch import kube
        from tpulaunch.cli import gke_views

        if zone or project:
            raise TpulaunchError("--zone/--project are the Cloud TPU API's; --gke lists the kubeconfig's cluster",
                                 "drop them, or pass --context")
        gke_views.list_pools(out, kube.KubeTarget(kubeconfig, context, namespace), json_out)
        return
    p, z, prov = discover.resolve_project_zone(project, zone)
    where = ", ".join(f"{k} {v} (from {prov[k]})" for k, v in (("project", p), ("zone", z)) if v)
    with out.status(f"listing TPU nodes: {where or 'no project/zone'} ..."):
        specs = discover.list_nodes(zone=z, project=p, timeout=timeout)
    rows = []
    for s in specs:
        d = s.to_dict()
        d["provenance"] = {**d["provenance"], **prov}
        d["generation"] = discover.generation_of(s)
        d["ready"] = not discover.readiness_problems(s)
        rows.append(d)
    qrs: list[dict] = []
    if p and z and z != "-":  # (list_nodes has refused a missing project)
        from tpulaunch.provision import capacity

        try:
            qrs = [{"name": q.name.rsplit("/", 1)[-1], "state": q.state, "initiator": q.initiator, "error": q.error}
                   for q in capacity.list_states(p, z, timeout=timeout)]
        except TpulaunchError as e:  # nodes listed; the queued resources could not be: say so, go on
            out.warn(f"queued resources not listed: {e.message}")
    if json_out:
        out.json({"schema": "tpulaunch.slice-list/v1", "project": p, "zone": z, "provenance": prov, "nodes": rows,
                  "queued_resources": qrs})
        return
    for q in qrs:
        why = f" ({q['initiator'].lower()})" if q["initiator"] and q["state"].startswith("SUSPEND") else ""
        out.info(f"queued resource {q['name']}: {q['state']}{why}" + (f": {q['error']}" if q["error"] else ""))
    if not rows:
        out.info(f"no TPU nodes in zone {z} of project {p}")
        return
    cols = ["name", "zone", "accelerator_type", "topology", "state", "health", "workers", "spot"]
    if z != "-":
        cols.remove("zone")  # one zone: it is in the header line already
    print_table(out, where, [_HEADERS.get(c, c.upper()) for c in cols], [[_cell(d, c) for c in cols] for d in rows],
                [not d["ready"] for d in rows])


_HEADERS = {"accelerator_type": "TYPE"}


def _cell(d: dict, col: str) -> str:
    if col == "workers":
        return str(len(d["workers"]))
    if col == "spot":
        return "spot" if d["spot"] else ("preemptible" if d["preemptible"] else "-")
    value = d.get(col)
    return str(value) if value not in (None, "") else "-"


# -- create / delete -------------------------------------------------------------------------------


@slice_app.command("create")
def create_cmd(
    name: str = typer.Argument(..., help="The slice's name: its queued resource and node (nodes NAME-0.. with"
                                         " --num-slices)."),
    accelerator: str | None = typer.Option(None, "--accelerator",
                                           help="v5p-64, or a generation with --topology (v5p)."),
    topology: str | None = typer.Option(None, "--topology", help="Chip shape, e.g. 4x4x4 (with --accelerator GEN)."),
    num_slices: int = typer.Option(1, "--num-slices",
                                   help="Slices of a multislice (one queued resource, nodes NAME-i)."),
    spot: bool = typer.Option(False, "--spot", help="Spot capacity: cheaper, preemptible at any time."),
    reserved: bool = typer.Option(False, "--reserved", help="From the project's reservation."),
    guaranteed: bool = typer.Option(False, "--guaranteed", help="Guaranteed (on-demand) capacity through the queue."),
    flex_start: bool = typer.Option(False, "--flex-start", help="Flex-start (Preview; see --max-run-duration)."),
    max_run_duration: str | None = typer.Option(None, "--max-run-duration", help="With --flex-start, e.g. 24h."),
    runtime_version: str | None = typer.Option(None, "--runtime-version",
                                               help="TPU VM software version (default: the one Google documents for"
                                                    " the generation)."),
    network: str | None = typer.Option(None, "--network"),
    subnetwork: str | None = typer.Option(None, "--subnetwork"),
    internal_ips: bool = typer.Option(False, "--internal-ips",
                                      help="No external IPs on the workers (the network needs Private Google Access or"
                                           " Cloud NAT; reach them from inside the VPC)."),
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    wait: bool = typer.Option(False, "--wait", help="Follow its state until ACTIVE (bounded by --wait-timeout)."),
    wait_timeout: float = typer.Option(3600.0, "--wait-timeout", metavar="S", help="How long --wait waits (s)."),
    json_out: bool = opt.JSON,
    timeout: float | None = TIMEOUT_OPT,
) -> None:
    """Create a slice as a queued resource (Cloud TPU API v2); `--wait` until it is ACTIVE.

    Examples: `tpulaunch slice create my-v5p --accelerator v5p-64 --spot --wait`,
    `tpulaunch slice create ms --topology 2x2x2 --accelerator v4 --num-slices 2 --zone us-central2-b`.
    """
    import math

    from tpulaunch.provision import capacity

    if not math.isfinite(wait_timeout) or wait_timeout <= 0:
        raise LaunchError(f"--wait-timeout {wait_timeout:g} is not a positive number of seconds",
                          "e.g. --wait-timeout 3600")
    out = Output(json_mode=json_out)
    tiers = [t for t, on in (("spot", spot), ("reserved", reserved), ("guaranteed", guaranteed),
                             ("flex-start", flex_start)) if on]
    if len(tiers) > 1:
        raise TpulaunchError(f"--{' and --'.join(tiers)}: a slice has one tier", "choose one")
    if flex_start or max_run_duration:
        raise TpulaunchError(
            "--flex-start cannot be requested through the Cloud TPU API v2 that tpulaunch uses: flex-start"
            " (provisioningModel, maxRunDuration) exists only in the v2alpha1 API, which google-cloud-tpu does not"
            " expose", "create it with `gcloud alpha compute tpus queued-resources create ... --provisioning-model"
            "=flex-start --max-run-duration D`, then use it with `tpulaunch cluster up --tpu NAME`")
    if not accelerator:
        raise TpulaunchError("no accelerator given", "--accelerator v5p-64, or --accelerator v5p --topology 4x4x4")
    p, z, _prov = discover.require_project_zone(project, zone, f"slice {name}")
    order = capacity.check_order(capacity.SliceOrder(
        name=name, project=p, zone=z, accelerator_type=accelerator, topology=topology, num_slices=num_slices,
        tier=tiers[0] if tiers else "on-demand", runtime_version=runtime_version, network=network,
        subnetwork=subnetwork, internal_ips=internal_ips))
    with out.status(f"asking the Cloud TPU API for {order.accelerator_type} x {order.num_slices} ({order.tier}) ..."):
        st = capacity.create(order, timeout=timeout)
    out.info(f"queued resource {name} accepted ({st.state}) in {z}: node(s) {', '.join(order.node_names())}")
    if wait:
        with out.status(f"waiting for {name} to be ACTIVE ...") as status:
            def say(msg: str) -> None:
                status.update(msg) if status is not None else out.info(msg)

            st = capacity.wait_active(p, z, name, wait_timeout, say)
    doc = {"schema": "tpulaunch.slice-created/v1", "name": name, "project": p, "zone": z, "state": st.state,
           "nodes": order.node_names(), "order": order.to_dict(), "request": capacity.queued_resource_body(order)}
    if json_out:
        out.json(doc)
    else:
        out.line(f"{name}: {st.state}" + ("" if st.state == "ACTIVE" else
                                          f" (follow it: tpulaunch slice list --zone {z}; or create with --wait)"))


@slice_app.command("delete")
def delete_cmd(
    name: str = typer.Argument(..., help="The queued resource (what `slice create` made)."),
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    json_out: bool = opt.JSON,
    timeout: float | None = TIMEOUT_OPT,
) -> None:
    """Delete a queued resource and its nodes (waits for the deletion to finish)."""
    from tpulaunch.provision import capacity

    out = Output(json_mode=json_out)
    p, z, _prov = discover.require_project_zone(project, zone, f"queued resource {name}")
    with out.status(f"deleting queued resource {name} and its nodes ..."):
        found = capacity.delete(p, z, name, timeout=timeout if timeout is not None else 120.0)
    if not found:
        from tpulaunch.errors import NodeNotFoundError

        raise NodeNotFoundError(f"queued resource '{name}' not found in zone {z} of project {p}",
                                "`tpulaunch slice list` shows the queued resources there")
    if json_out:
        out.json({"schema": "tpulaunch.slice-deleted/v1", "name": name, "project": p, "zone": z})
    else:
        out.line(f"{name}: deleted")
