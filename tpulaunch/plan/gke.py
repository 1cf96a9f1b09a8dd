"""What GKE calls a TPU slice, per generation: node labels, machine types, chips per VM. Pure data.

GKE puts one multi-host slice in one node pool; its nodes carry the generation
(`cloud.google.com/gke-tpu-accelerator`) and the chip grid (`cloud.google.com/gke-tpu-topology`)
as labels, and each node's `google.com/tpu` allocatable is its chips. The facts below come from
Google's own code (xpk's `system_characteristics.py`, the TPU device plugin's `util.go`, the
tpu-provisioner) and KubeRay's TPU samples; `../shared/notes/gke.md` cites each one.

A shape alone does not always say how many hosts a slice has: a v5e/v6e `2x4` is one 8-chip VM
(`-8t`) or two 4-chip VMs (`-4t`). Discovery settles it from the nodes' chips, never from the
topology (`hosts_of`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpulaunch.errors import TopologyError
from tpulaunch.plan import catalog
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.topology import Topology

# Node labels and resources GKE and its TPU device plugin use.
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
CHIPS_LABEL = "cloud.google.com/gke-accelerator-count"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
SPOT_LABEL = "cloud.google.com/gke-spot"
MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"  # Unix epoch of the next host maintenance
ACTIVE_MAINTENANCE_LABEL = "cloud.google.com/active-node-maintenance"  # ONGOING while workloads are stopped
PLACEMENT_POLICY_LABEL = "cloud.google.com/placement-policy-name"  # tpu7x multi-host: the workload policy
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
ZONE_LABEL = "topology.kubernetes.io/zone"
TPU_RESOURCE = "google.com/tpu"


@dataclass(frozen=True)
class GkeGeneration:
    """How GKE names one TPU generation."""

    generation: str  # the catalog's name: v4, v5e, v5p, v6e, v7x
    label: str  # cloud.google.com/gke-tpu-accelerator
    old_labels: tuple[str, ...]  # labels older GKE versions used, still read
    machine_prefix: str  # machine type = f"{prefix}-{chips}t"
    chips_per_vm: tuple[int, ...]  # the machine types there are (chips on one VM)
    workload_policy: bool = False  # a multi-host node pool comes from a workload policy, not --tpu-topology

    def machine_type(self, chips: int) -> str:
        return f"{self.machine_prefix}-{chips}t"


GKE_GENERATIONS: tuple[GkeGeneration, ...] = (
    GkeGeneration("v4", "tpu-v4-podslice", (), "ct4p-hightpu", (4,)),
    GkeGeneration("v5e", "tpu-v5-lite-podslice", ("tpu-v5-lite-device",), "ct5lp-hightpu", (1, 4, 8)),
    GkeGeneration("v5p", "tpu-v5p-slice", (), "ct5p-hightpu", (4,)),
    GkeGeneration("v6e", "tpu-v6e-slice", (), "ct6e-standard", (1, 4, 8)),
    GkeGeneration("v7x", "tpu7x", (), "tpu7x-standard", (4,), workload_policy=True),
)
_BY_LABEL = {lab: g for g in GKE_GENERATIONS for lab in (g.label, *g.old_labels)}
_BY_GEN = {g.generation: g for g in GKE_GENERATIONS}


def gke_generation(name: str) -> GkeGeneration:
    """The GKE names of a catalog generation (any of its names); TopologyError for one GKE lacks."""
    gen = catalog.generation(name)
    if gen.name not in _BY_GEN:
        raise TopologyError(f"TPU {gen.name} is not offered on GKE",
                            f"GKE has {', '.join(g.generation for g in GKE_GENERATIONS)}")
    return _BY_GEN[gen.name]


def generation_of_label(label: str) -> GkeGeneration | None:
    """The generation a node's accelerator label names (None: not one GKE has used for a TPU)."""
    return _BY_LABEL.get(label)


def default_chips_per_vm(generation: str, topology: str) -> int:
    """Chips on one VM of a slice of this shape when nothing else says: every chip on one VM for the
    single-host shapes (as GKE's `-8t`/`-1t` machine types and Ray's default have it), else 4."""
    gen = catalog.generation(generation)
    chips = math.prod(int(d) for d in topology.split("x"))
    if topology in gen.single_host_shapes:
        return chips
    return gen.chips_per_host


def slice_topology(generation: str, topology: str, chips_per_vm: int | None = None) -> Topology:
    """The catalog topology of a GKE slice: its shape with `chips_per_vm` chips on each VM."""
    gen = catalog.generation(generation)
    per_vm = chips_per_vm or default_chips_per_vm(gen.name, topology)
    chips = math.prod(int(d) for d in topology.split("x"))
    if per_vm not in gke_generation(gen.name).chips_per_vm:
        raise TopologyError(f"no GKE machine type of {gen.name} has {per_vm} chips",
                            f"GKE's {gen.name} VMs have {', '.join(map(str, gke_generation(gen.name).chips_per_vm))}")
    if chips < per_vm or chips % per_vm:
        raise TopologyError(f"a {gen.name} {topology} slice ({chips} chips) cannot be made of {per_vm}-chip VMs",
                            "give a topology whose chips fill whole VMs")
    return topo_mod.resolve(topology=topology, accelerator=gen.name, chips_per_host=per_vm if per_vm < chips else None)


@dataclass(frozen=True)
class SliceShape:
    """One GKE slice's shape as the manifests and node pools need it."""

    topology: Topology
    gke: GkeGeneration

    @property
    def chips_per_vm(self) -> int:
        return self.topology.chips_per_host

    @property
    def hosts(self) -> int:
        return self.topology.num_hosts

    @property
    def machine_type(self) -> str:
        return self.gke.machine_type(self.chips_per_vm)

    @property
    def needs_workload_policy(self) -> bool:
        return self.gke.workload_policy and self.hosts > 1


def shape(generation: str, topology: str, chips_per_vm: int | None = None) -> SliceShape:
    """The GKE shape of a slice (checked: a shape of that generation that fills whole VMs)."""
    topo = slice_topology(generation, topology, chips_per_vm)
    return SliceShape(topo, gke_generation(topo.generation.name))


def hosts_of(topology: str, chips_per_node: int) -> int:
    """Hosts of a slice from its nodes' chips (`google.com/tpu` allocatable): what settles a v5e/v6e
    2x4. Pure; at least 1."""
    chips = math.prod(int(d) for d in topology.split("x"))
    return max(chips // max(chips_per_node, 1), 1)
