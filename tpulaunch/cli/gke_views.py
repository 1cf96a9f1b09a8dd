"""What `slice list/describe --gke` and `cluster up --gke` print: node pools as slices, the RayCluster.

Thin: `tpulaunch.discover.gke` reads the pools, `tpulaunch.providers.gke` brings Ray up; this module
renders (a rich table on a terminal, aligned plain lines in a pipe, `--json`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpulaunch import kube
from tpulaunch.cli.output import Output
from tpulaunch.cli.slice_views import print_table
from tpulaunch.errors import DiscoveryError

if TYPE_CHECKING:
    from tpulaunch.cluster.record import ClusterInfo

POOL_COLS = ("pool", "generation", "topology", "hosts", "chips_per_node", "machine_type", "spot", "zone",
             "maintenance", "state")
_HEAD = {"chips_per_node": "CHIPS/NODE", "machine_type": "MACHINE"}


def _cell(d: dict, col: str) -> str:
    if col == "hosts":
        want = d["expected_hosts"]
        return f"{d['ready']}/{want if want is not None else '?'}" + ("" if d["hosts"] == (want or d["hosts"]) else
                                                                      f" ({d['hosts']} nodes)")
    if col == "spot":
        return "spot" if d["spot"] else "-"
    if col == "maintenance":
        return d["maintenance_at"] or "-"
    if col == "generation":
        return d["generation"] or d["accelerator_label"]
    if col == "state":
        return d["state"] + (f" ({'; '.join(d['problems'])})" if d["problems"] else "")
    v = d.get(col)
    return str(v) if v not in (None, "") else "-"


def pools_doc(target: kube.KubeTarget) -> dict:
    from tpulaunch.discover import gke as discover_gke

    k = kube.connect(target)
    pools = discover_gke.list_pools(k)
    return {"schema": "tpulaunch.slice-list/v1", "source": "gke", "api": k.where,
            "node_pools": [p.to_dict() for p in pools]}


def list_pools(out: Output, target: kube.KubeTarget, json_out: bool) -> None:
    with out.spinner("listing TPU node pools through the Kubernetes API ..."):
        doc = pools_doc(target)
    if json_out:
        out.json(doc)
        return
    rows = doc["node_pools"]
    if not rows:
        out.info(f"no TPU node pools in {doc['api']}")
        return
    print_table(out, doc["api"], [_HEAD.get(c, c.upper()) for c in POOL_COLS],
                [[_cell(d, c) for c in POOL_COLS] for d in rows], [not d["complete"] for d in rows])


def describe_pool(out: Output, target: kube.KubeTarget, pool: str, json_out: bool, force: bool) -> None:
    from tpulaunch.cli.slice_views import describe_lines, slice_doc
    from tpulaunch.discover import gke as discover_gke
    from tpulaunch.errors import ExitCode

    with out.spinner(f"reading node pool {pool} through the Kubernetes API ..."):
        k = kube.connect(target)
        pools = {p.pool: p for p in discover_gke.list_pools(k)}
    if pool not in pools:
        raise DiscoveryError(f"no TPU node pool named {pool} in {k.where}",
                             f"TPU node pools there: {', '.join(pools) or 'none'} (`tpulaunch slice list --gke`)")
    p = pools[pool]
    doc = {**slice_doc(p.to_spec()), "node_pool": p.to_dict()}
    if json_out:
        out.json(doc)
    else:
        for line in describe_lines(doc):
            out.line(line)
        for k_, v in (("node pool", p.pool), ("machine type", p.machine_type), ("chips per node", p.chips_per_node),
                      ("nodes", ", ".join(p.nodes)), ("ready hosts", f"{p.ready}/{p.expected_hosts or '?'}"),
                      ("placement policy", p.placement_policy or "-"),
                      ("maintenance", doc["node_pool"]["maintenance_at"] or "none scheduled")):
            out.line(f"{k_}: {v}")
    if p.problems() and not force:
        out.warn(f"node pool {pool}: {'; '.join(p.problems())}")
        import typer

        raise typer.Exit(ExitCode.NOT_READY)


def reach_lines(info: ClusterInfo) -> list[str]:
    g = info.gke
    assert g is not None  # a cluster on GKE
    svc = f"{g.head_service}.{g.namespace}.svc.cluster.local"
    return [f"reach it from here: `tpulaunch run SCRIPT --address auto` (the job API through a port-forward the"
            f" Kubernetes API opens); from inside the cluster: http://{svc}:8265",
            "token: " + (info.token_path or "none (the cluster runs without Ray token auth)")]
