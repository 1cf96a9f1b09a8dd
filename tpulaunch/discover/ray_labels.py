"""Find TPU slices in a Ray cluster from the labels Ray puts on TPU hosts, and pick free ones.

Ray labels every TPU host with `ray.io/tpu-slice-name`, `ray.io/tpu-worker-id`,
`ray.io/tpu-pod-type` and `ray.io/tpu-topology` (GKE env or GCE metadata; tpulaunch's emulated
hosts get the same). `slices_from_nodes` is pure over `ray.nodes()`-shaped dicts so the choice
logic is tested without a cluster; `read_slices()` is the thin Ray call.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpulaunch.errors import ClusterError, TopologyError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
from tpulaunch.plan.topology import Topology

SLICE, WORKER, POD_TYPE, TOPO = (
    "ray.io/tpu-slice-name", "ray.io/tpu-worker-id", "ray.io/tpu-pod-type", "ray.io/tpu-topology",
)


@dataclass(frozen=True)
class RaySlice:
    name: str
    pod_type: str
    topology: str
    workers: tuple[tuple[int, str, bool, bool], ...]  # (worker id, node ip, alive, busy)

    @property
    def busy(self) -> bool:
        return any(b for _, _, _, b in self.workers)

    def intact(self, expected_hosts: int) -> bool:
        ids = sorted(w for w, _, alive, _ in self.workers if alive)
        return ids == list(range(expected_hosts))

    def to_spec(self, slice_index: int = 0) -> SliceSpec:
        return SliceSpec(
            name=self.name, accelerator_type=self.pod_type, topology=self.topology, source="ray",
            state="READY", workers=tuple(WorkerEndpoint(w, ip) for w, ip, _, _ in sorted(self.workers)),
            slice_index=slice_index,
        )


def slices_from_nodes(nodes: list[dict], available: dict[str, dict[str, float]]) -> list[RaySlice]:
    """Group Ray nodes into slices by label; a host is busy when some of its TPUs are taken."""
    groups: dict[str, list] = {}
    meta: dict[str, tuple[str, str]] = {}
    for n in nodes:
        labels = n.get("Labels") or {}
        if SLICE not in labels or WORKER not in labels:
            continue
        total = float(n.get("Resources", {}).get("TPU", 0.0))
        alive = bool(n.get("Alive"))
        free = _free_tpus(available.get(n.get("NodeID", "")), total) if alive else 0.0
        groups.setdefault(labels[SLICE], []).append(
            (int(labels[WORKER]), n.get("NodeManagerAddress", ""), alive, alive and free < total)
        )
        meta[labels[SLICE]] = (labels.get(POD_TYPE, ""), labels.get(TOPO, ""))
    return [RaySlice(name, meta[name][0], meta[name][1], _replaced_dropped(ws)) for name, ws in sorted(groups.items())]


def _free_tpus(available: dict[str, float] | None, total: float) -> float:
    """A node's free chips. Ray leaves a resource out of a node's available resources once none of
    it is left (every chip taken): out means 0. A node Ray said nothing about counts as free."""
    if available is None:
        return total
    return float(available.get("TPU", 0.0))


def _replaced_dropped(workers: list) -> tuple:
    """A host whose node died and came back is listed twice by Ray (the dead node stays known):
    keep the dead entry only while no live node carries that worker id."""
    alive_ids = {w for w, _, alive, _ in workers if alive}
    return tuple(sorted(w for w in workers if w[2] or w[0] not in alive_ids))


def choose(
    slices: list[RaySlice], *, want: Topology | None, tpu: str | None, num_slices: int = 1,
) -> list[RaySlice]:
    """Pick `num_slices` free, intact slices matching the request, or explain why none fits."""
    if not slices:
        raise ClusterError("the Ray cluster has no TPU hosts (no node carries ray.io/tpu-slice-name)",
                           "bring Ray up on the slice first (`tpulaunch cluster up --tpu NAME`)")
    reasons = []
    fits = []
    for s in slices:
        if tpu and s.name != tpu:
            continue
        try:
            topo = topo_mod.resolve(topology=s.topology or None, accelerator=s.pod_type)
        except TopologyError:
            reasons.append(f"{s.name}: unknown type {s.pod_type} {s.topology}")
            continue
        if want is not None and (topo.generation.name, topo.chips) != (want.generation.name, want.chips):
            what = "wrong generation" if topo.generation.name != want.generation.name else "wrong size"
            reasons.append(f"{s.name}: {s.pod_type} ({s.topology}), {what}")
            continue
        if not s.intact(topo.num_hosts):
            reasons.append(f"{s.name}: only {sum(1 for w in s.workers if w[2])} of {topo.num_hosts} hosts alive")
            continue
        if s.busy:
            reasons.append(f"{s.name}: busy with another run")
            continue
        fits.append(s)
    if tpu and not any(s.name == tpu for s in slices):
        raise ClusterError(f"no slice named {tpu} in the Ray cluster",
                           f"slices there: {', '.join(s.name for s in slices)}")
    if len(fits) < num_slices:
        asked = f"{num_slices} x {want.accelerator_type}" if want else f"{num_slices} slice(s)"
        lost = any("hosts alive" in r for r in reasons)
        raise ClusterError(f"no free slice fits {asked}: " + "; ".join(reasons or ["none"]),
                           "`tpulaunch cluster repair` brings a slice's lost hosts back" if lost else
                           "wait for the busy run, or change --topology/--accelerator/--tpu")
    return fits[:num_slices]


def read_slices() -> list[RaySlice]:
    """Slices of the Ray cluster this process is connected to."""
    import ray

    return slices_from_nodes(ray.nodes(), available_per_node())


def available_per_node() -> dict[str, dict[str, float]]:
    """What Ray has free on each live node, by node id: `ray._private.state.available_resources_per_node`
    (a DeveloperAPI: Ray has no public per-node view), or {} in a Ray without it."""
    try:
        from ray._private.state import available_resources_per_node
    except ImportError:
        return {}
    return available_resources_per_node()
