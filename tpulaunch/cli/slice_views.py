"""How a slice is shown: `slice describe`'s document and its lines (a pipe) or rich view (a
terminal). Shared by the Cloud TPU API's and the metadata server's slices (`cmd_slice`) and GKE's
node pools (`gke_views`)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tpulaunch import discover
from tpulaunch.cli.output import Output
from tpulaunch.errors import TpulaunchError
from tpulaunch.plan.slicespec import SliceSpec


def slice_doc(spec: SliceSpec, *, this_worker: int | None = None) -> dict:
    """`SliceSpec.to_dict()` plus what the catalog derives from it (generation, hosts, ...)."""
    doc = spec.to_dict()
    doc["generation"] = discover.generation_of(spec)
    problems = discover.readiness_problems(spec)
    doc["ready"] = not problems
    doc["problems"] = problems
    notes: list[str] = []
    try:
        topo = spec.to_topology()
    except TpulaunchError as e:
        doc["topology_error"] = e.line()
    else:
        doc.update(
            generation=topo.generation.name, chips=topo.chips, devices=topo.devices, hosts=topo.num_hosts,
            chips_per_host=topo.chips_per_host, devices_per_host=topo.devices_per_host,
            host_bounds=topo.bounds_str(topo.host_bounds),
            chips_per_host_bounds=topo.bounds_str(topo.chips_per_host_bounds),
        )
        if spec.workers and len(spec.workers) != topo.num_hosts:
            notes.append(f"{len(spec.workers)} worker endpoints reported, but a {topo.topology} slice has"
                         f" {topo.num_hosts} hosts")
    if this_worker is not None:
        doc["this_worker"] = this_worker
    doc["notes"] = notes
    return doc


def mesh_doc(specs: list[SliceSpec]) -> dict | None:
    """The default mesh `tpulaunch run` would build, if the mesh planner is available."""
    try:
        from tpulaunch.plan.mesh import plan_mesh
    except ImportError:
        return None
    try:
        topo = specs[0].to_topology()
    except TpulaunchError:
        return None  # already said as topology_error
    try:
        plan = plan_mesh(topo, num_slices=len(specs))
        doc = plan.to_dict(devices=False)
    except TpulaunchError as e:
        return {"error": e.line()}
    except (TypeError, AttributeError):  # planner API still moving: leave the mesh out
        return None
    doc.pop("grid", None)  # the device grid is `tpulaunch mesh inspect`'s job
    return doc


def _yes(v: bool) -> str:
    return "yes" if v else "no"


def _prov(doc: dict, key: str) -> str:
    where = doc.get("provenance", {}).get(key)
    return f"{doc.get(key)} (from {where})" if where else str(doc.get(key))


def _worker_text(w: dict, this_worker: int | None) -> str:
    parts = [w["ip"]]
    if w.get("external_ip"):
        parts.append(f"external {w['external_ip']}")
    if w.get("hostname") and w["hostname"] != w["ip"]:
        parts.append(f"hostname {w['hostname']}")
    if this_worker == w["worker_id"]:
        parts.append("(this host)")
    return " ".join(parts)


def _fields(d: dict) -> list[tuple[str, str]]:
    rows = [("name", d["name"]), ("source", d["source"])]
    if d.get("project"):
        rows.append(("project", _prov(d, "project")))
    if d.get("zone"):
        rows.append(("zone", _prov(d, "zone")))
    rows.append(("accelerator_type", _prov(d, "accelerator_type") if d["accelerator_type"] else "?"))
    rows.append(("generation", str(d.get("generation") or "?")))
    rows.append(("topology", _prov(d, "topology") if d["topology"] else "?"))
    for key in ("chips", "devices", "hosts", "chips_per_host", "host_bounds"):
        if key in d:
            rows.append((key, str(d[key])))
    if "topology_error" in d:
        rows.append(("topology_error", d["topology_error"]))
    rows.append(("state", d["state"] or "unknown (not reported by this source)"))
    rows.append(("health", d["health"] or "unknown (not reported by this source)"))
    if d.get("health_description"):
        rows.append(("health_description", d["health_description"]))
    rows += [("symptom", s) for s in d["symptoms"]]
    rows.append(("spot", _yes(d["spot"])))
    if d["preemptible"]:
        rows.append(("preemptible", "yes"))
    if d.get("runtime_version"):
        rows.append(("runtime_version", d["runtime_version"]))
    if d.get("queued_resource"):
        rows.append(("queued_resource", d["queued_resource"]))
    if d["multislice_node"] or d["slice_index"]:
        rows.append(("slice_index", str(d["slice_index"])))
    if "this_worker" in d:
        rows.append(("this_worker", str(d["this_worker"])))
    rows.append(("ready", _yes(d["ready"]) + ("" if d["ready"] else f" ({'; '.join(d['problems'])})")))
    rows += [("note", n) for n in d["notes"]]
    return rows


def describe_lines(d: dict) -> list[str]:
    lines = [f"{k}: {v}" for k, v in _fields(d)]
    lines += [f"worker {w['worker_id']}: {_worker_text(w, d.get('this_worker'))}" for w in d["workers"]]
    if not d["workers"]:
        lines.append("workers: none reported")
    return lines


def _mesh_summary(mesh: dict) -> str:
    axes = ", ".join(f"{a}={n}" for a, n in zip(mesh.get("axis_names", []), mesh.get("shape", []), strict=True))
    extra = f", DCN {'x'.join(map(str, mesh['dcn_shape']))}" if mesh.get("num_slices", 1) > 1 else ""
    return f"{axes} ({mesh.get('num_devices')} devices, {mesh.get('num_processes')} processes{extra})"


def mesh_lines(mesh: dict | None) -> list[str]:
    if mesh is None:
        return []
    if "error" in mesh:
        return [f"mesh: unavailable ({mesh['error']})"]
    return [f"mesh: {_mesh_summary(mesh)}"]


def describe_rich(d: dict) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for k, v in _fields(d):
        style = ""
        if k in ("state", "health", "ready"):
            style = "green" if (v.startswith("READY") or v.startswith("HEALTHY") or v == "yes") else "red"
        head.add_row(k, Text(v, style=style))
    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "internal IP", "external IP", "hostname"):
        workers.add_column(col)
    for w in d["workers"]:
        label = f"{w['worker_id']}" + (" *" if d.get("this_worker") == w["worker_id"] else "")
        workers.add_row(label, w["ip"], w.get("external_ip") or "", w.get("hostname") or "")
    return Group(head, workers)


def mesh_rich(mesh: dict | None) -> list[Any]:
    return [Text(line, style="bold") for line in mesh_lines(mesh)]


def print_table(out: Output, title: str, header: list[str], table: list[list[str]], bad: list[bool]) -> None:
    """Rows of slices (or node pools): a rich table on a terminal, the `bad` ones red; aligned plain
    columns in a pipe."""
    if out.rich:
        t = Table(title=title, title_justify="left")
        for h in header:
            t.add_column(h, no_wrap=True)
        for is_bad, r in zip(bad, table, strict=True):
            t.add_row(*r, style="red" if is_bad else "")
        out.result(t)
        return
    widths = [max(len(x) for x in col) for col in zip(header, *table, strict=True)]
    for r in [header, *table]:
        out.line("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
