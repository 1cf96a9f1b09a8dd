"""TPU slices on GKE: node pools read from the Kubernetes API, and a pod's own slice from its environment.

GKE puts one slice in one node pool. `pools_from_nodes` (pure, over the API's Node JSON) groups the
TPU nodes by `cloud.google.com/gke-nodepool` and reads each pool as a slice: its generation and
shape from the nodes' labels, its hosts from its nodes, its expected hosts from the shape and the
nodes' chips (`google.com/tpu` allocatable: what settles a v5e/v6e `2x4`), its ready hosts from the
nodes' `Ready` condition (a pool missing a host is incomplete), spot, machine type, zone, and the
earliest upcoming host maintenance. A tpu7x multi-host pool made from a workload policy may carry
no topology label (unverified without Ironwood): it is listed with its policy and its node count.

`local_slice` is the metadata server's counterpart inside a GKE pod: the variables GKE's device
plugin and the KubeRay TPU webhook set (`TPU_NAME`, `TPU_WORKER_ID`, `TPU_WORKER_HOSTNAMES`,
`TPU_ACCELERATOR_TYPE`, `TPU_TOPOLOGY`) describe the slice the pod is a host of.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tpulaunch.errors import TopologyError
from tpulaunch.plan import gke
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

if TYPE_CHECKING:
    from tpulaunch.kube import Kube


@dataclass(frozen=True)
class PoolSlice:
    """One TPU node pool, as a slice."""

    pool: str
    accelerator_label: str
    generation: str | None  # the catalog's name (v5p), None for a label tpulaunch does not know
    topology: str | None
    machine_type: str
    chips_per_node: int
    nodes: tuple[str, ...]
    ready: int
    spot: bool
    zone: str | None
    placement_policy: str | None = None
    maintenance: int | None = None  # the earliest cloud.google.com/scheduled-maintenance-time of its nodes
    maintenance_ongoing: bool = False
    node_ips: tuple[str, ...] = ()

    @property
    def expected_hosts(self) -> int | None:
        return gke.hosts_of(self.topology, self.chips_per_node) if self.topology else None

    @property
    def complete(self) -> bool:
        want = self.expected_hosts
        return want is not None and len(self.nodes) == want and self.ready == want

    @property
    def accelerator_type(self) -> str | None:
        if not self.generation or not self.topology:
            return None
        try:
            return gke.slice_topology(self.generation, self.topology, self.chips_per_node).accelerator_type
        except TopologyError:
            return None

    @property
    def state(self) -> str:
        if self.expected_hosts is None:
            return "UNKNOWN_TOPOLOGY"
        return "READY" if self.complete else "INCOMPLETE"

    def problems(self) -> list[str]:
        out = []
        want = self.expected_hosts
        if want is None:
            out.append("no topology label"
                       + (f" (workload policy {self.placement_policy})" if self.placement_policy else ""))
        elif len(self.nodes) != want:
            out.append(f"{len(self.nodes)} of {want} hosts")
        if self.ready < len(self.nodes):
            out.append(f"{len(self.nodes) - self.ready} host(s) not Ready")
        if self.maintenance_ongoing:
            out.append("host maintenance ongoing")
        return out

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc.update(nodes=list(self.nodes), node_ips=list(self.node_ips), hosts=len(self.nodes),
                   expected_hosts=self.expected_hosts, complete=self.complete, state=self.state,
                   accelerator_type=self.accelerator_type, problems=self.problems(),
                   maintenance_at=_iso(self.maintenance) if self.maintenance else None)
        return doc

    def to_spec(self) -> SliceSpec:
        """The pool as a discovered slice (source `gke`): its nodes' addresses as workers, in name order
        (the pods' worker ids are the webhook's; the pool's nodes carry none)."""
        return SliceSpec(name=self.pool, accelerator_type=self.accelerator_type or self.accelerator_label,
                         topology=self.topology or "", source="gke", zone=self.zone, state=self.state,
                         spot=self.spot, workers=tuple(WorkerEndpoint(i, ip) for i, ip in enumerate(self.node_ips)),
                         provenance={"node_pool": self.pool, "machine_type": self.machine_type})


def _iso(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _ready(node: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (node.get("status") or {}).get("conditions") or [])


def _ip(node: dict) -> str:
    for a in (node.get("status") or {}).get("addresses") or []:
        if a.get("type") == "InternalIP":
            return a.get("address", "")
    return ""


def node_chips(node: dict) -> int:
    """A TPU node's chips: what the device plugin reports (capacity, then allocatable) when it has
    registered them, else the node's label (GKE's machine type count). A plugin not yet registered,
    or every chip unhealthy, reports 0, which is not the machine's count. Pure."""
    status = node.get("status") or {}
    for reported in (status.get("capacity") or {}, status.get("allocatable") or {}):
        value = str(reported.get(gke.TPU_RESOURCE) or "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    label = str(((node.get("metadata") or {}).get("labels") or {}).get(gke.CHIPS_LABEL) or "")
    return int(label) if label.isdigit() else 0


def pools_from_nodes(nodes: list[dict]) -> list[PoolSlice]:
    """Every TPU node pool among `nodes` (the API's Node JSON), by name. Pure."""
    groups: dict[str, list[dict]] = {}
    for n in nodes:
        labels = (n.get("metadata") or {}).get("labels") or {}
        if gke.ACCELERATOR_LABEL in labels and gke.NODEPOOL_LABEL in labels:
            groups.setdefault(labels[gke.NODEPOOL_LABEL], []).append(n)
    out = []
    for pool, members in sorted(groups.items()):
        members.sort(key=lambda n: n["metadata"]["name"])
        labels = members[0]["metadata"]["labels"]
        gen = gke.generation_of_label(labels[gke.ACCELERATOR_LABEL])
        chips = max(node_chips(n) for n in members)
        epochs = []
        for n in members:
            raw = n["metadata"]["labels"].get(gke.MAINTENANCE_LABEL)
            if raw and raw.isdigit():
                epochs.append(int(raw))
        out.append(PoolSlice(
            pool=pool, accelerator_label=labels[gke.ACCELERATOR_LABEL], generation=gen.generation if gen else None,
            topology=labels.get(gke.TOPOLOGY_LABEL), machine_type=labels.get(gke.INSTANCE_TYPE_LABEL, ""),
            chips_per_node=chips, nodes=tuple(n["metadata"]["name"] for n in members),
            ready=sum(1 for n in members if _ready(n)), spot=labels.get(gke.SPOT_LABEL) == "true",
            zone=labels.get(gke.ZONE_LABEL), placement_policy=labels.get(gke.PLACEMENT_POLICY_LABEL),
            maintenance=min(epochs) if epochs else None,
            maintenance_ongoing=any(n["metadata"]["labels"].get(gke.ACTIVE_MAINTENANCE_LABEL) == "ONGOING"
                                    for n in members),
            node_ips=tuple(_ip(n) for n in members)))
    return out


def list_pools(kube: Kube) -> list[PoolSlice]:
    """The cluster's TPU node pools (nodes are cluster-scoped: `list nodes` is the permission)."""
    return pools_from_nodes(kube.list("Node", gke.ACCELERATOR_LABEL))


def fitting(pools: list[PoolSlice], shape: gke.SliceShape, spot: bool | None = None) -> list[PoolSlice]:
    """The pools a slice of `shape` can land on: same generation, topology and chips per node (and
    spot where asked), whole. Pure."""
    topo = shape.topology
    return [p for p in pools if p.generation == topo.generation.name and p.topology == topo.topology
            and p.chips_per_node == shape.chips_per_vm and (spot is None or p.spot == spot) and p.complete]


# -- inside a GKE pod -------------------------------------------------------------------------------

GKE_POD_ENVS = ("TPU_NAME", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY")


def local_slice(env: Mapping[str, str]) -> tuple[SliceSpec, int] | None:
    """(the slice this pod is a host of, its worker id), from the device plugin's and the webhook's
    variables; None when they are not all set (not a TPU pod of a KubeRay cluster)."""
    if not all(env.get(k, "").strip() for k in GKE_POD_ENVS):
        return None
    try:
        worker = int(env["TPU_WORKER_ID"])
    except ValueError:
        return None
    names = [h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if not names or names == ["localhost"]:
        names = [env.get("HOSTNAME", "localhost")]
    spec = SliceSpec(name=env["TPU_NAME"], accelerator_type=env["TPU_ACCELERATOR_TYPE"], topology=env["TPU_TOPOLOGY"],
                     source="gke", state="READY",
                     workers=tuple(WorkerEndpoint(i, h, hostname=h) for i, h in enumerate(names)),
                     provenance={"TPU_NAME": "env", "TPU_WORKER_ID": "env"})
    return spec, worker
