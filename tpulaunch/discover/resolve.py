"""The one decision of which slice(s) a run gets.

`resolve(request, cluster)` takes what the user asked for (`SliceRequest`: flags) and what cluster,
if any, the run goes to (`ClusterSlices`: pure data the caller read from the cluster), and returns
`ResolvedSlices` with the source recorded. In order:

1. A real Ray cluster (`--address` to a TPU cluster): the slices Ray's TPU labels show; a free,
   intact one that fits the flags is picked (source `ray`). A queued resource is the exception:
   its nodes come from the Cloud TPU API (source `tpu-api`).
2. `--tpu NAME` / `--queued-resource NAME`: the Cloud TPU API (source `tpu-api`). With no cluster
   to run on, the discovered slice is rehearsed here, emulated (the notes say so).
3. On a TPU VM with no shape flags and no emulated cluster: the GCE metadata server (`metadata`).
4. Otherwise `--topology` / `--accelerator`: an emulated slice on this machine (`flags`).

On a warm emulated cluster (`cluster up`), cases 2-4 end on that cluster's own slices (source
`emulated-cluster`), after checking they are the slices asked for (with no shape flags at all,
the cluster's slices are what is asked for). Flags given next to a
discovered slice are checked against it, never silently applied.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tpulaunch.errors import LaunchError, MeshError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.mesh import check_slice_count, parse_axes
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.plan.topology import Topology

SOURCES = ("flags", "tpu-api", "metadata", "ray", "emulated-cluster")


@dataclass(frozen=True)
class SliceRequest:
    """The slice flags of a command (`run`, `exec`, `mesh inspect`, `cluster up`)."""

    topology: str | None = None
    accelerator: str | None = None
    chips_per_host: int | None = None
    tpu: str | None = None
    queued_resource: str | None = None
    zone: str | None = None
    project: str | None = None
    num_slices: int | None = None
    dcn: str | None = None
    force: bool = False
    name: str = "emulated"  # what emulated slices are called (`cluster up --name`)


@dataclass(frozen=True)
class ClusterSlices:
    """What the cluster a run goes to holds, as data (the caller reads it; `resolve` does no I/O on Ray).

    `emulated`: a cluster tpulaunch started on this machine, with the slices it was started for.
    Otherwise a real cluster, with `ray_slices` from Ray's node labels (`ray_labels.read_slices`).
    """

    emulated: bool
    slices: tuple[SliceSpec, ...] = ()
    ray_slices: tuple = ()  # tuple[ray_labels.RaySlice, ...]
    spares: tuple[str, ...] = ()  # spare slices: held in reserve, never chosen for a run


@dataclass(frozen=True)
class ResolvedSlices:
    topology: Topology
    slices: tuple[SliceSpec, ...]
    emulated: bool
    source: str  # one of SOURCES
    notes: tuple[str, ...] = ()

    @property
    def num_slices(self) -> int:
        return len(self.slices)


def resolve(req: SliceRequest, cluster: ClusterSlices | None = None) -> ResolvedSlices:
    """Which slice(s) `req` gets on `cluster` (None: no cluster given). See the module docstring."""
    if cluster is not None and not cluster.emulated and not req.queued_resource:
        return _from_ray(req, cluster)
    wanted = _wanted_slices(req)
    if req.tpu or req.queued_resource:
        found = _from_api(req)
        if cluster is None:
            return _rehearse(found)
        return found if not cluster.emulated else _on_emulated_cluster(found.topology, len(found.slices), cluster)
    if cluster is None and not (req.topology or req.accelerator):
        from tpulaunch.discover import describe

        local = describe.local_slice()
        if local is not None:
            return _checked([local], req, "metadata")
    if cluster is not None and cluster.slices and not (req.topology or req.accelerator or req.num_slices or req.dcn):
        s0 = cluster.slices[0]
        return _on_emulated_cluster(s0.to_topology(req.chips_per_host), len(cluster.slices), cluster)
    topo = topo_mod.resolve(topology=req.topology, accelerator=req.accelerator, chips_per_host=req.chips_per_host)
    if cluster is not None:
        return _on_emulated_cluster(topo, wanted, cluster)
    return emulated_slices(topo, wanted, req.name)


# A slice name as Cloud TPU takes one (a node id): lower-case letters, digits and dashes, a letter first.
_SLICE_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def emulated_slices(topology: Topology, num_slices: int, name: str = "emulated") -> ResolvedSlices:
    """`num_slices` copies of `topology` emulated on this machine (source `flags`)."""
    if not _SLICE_NAME.fullmatch(name):
        raise LaunchError(f"--name {name[:40]!r}" + (f" ({len(name)} characters)" if len(name) > 40 else "")
                          + " is not a slice name", "use lower-case letters, digits and dashes, a letter first"
                          " (at most 63), as Cloud TPU names nodes")
    specs = tuple(
        SliceSpec.emulated_from(topology, name if num_slices == 1 else f"{name}-{i}", slice_index=i)
        for i in range(num_slices)
    )
    return ResolvedSlices(topology, specs, True, "flags")


def request_num_slices(req: SliceRequest) -> int:
    """How many slices the flags ask for (`--num-slices`, or the product of `--dcn`), checked."""
    return _wanted_slices(req)


# -- the cases ------------------------------------------------------------------------------------


def _wanted_slices(req: SliceRequest) -> int:
    """Bounded before anything is planned per slice (`plan.mesh.check_slice_count`): a typo of a
    billion slices is one line, not a minute of planning that ends in MemoryError."""
    if req.num_slices is not None:
        check_slice_count(req.num_slices)
    from_dcn = None
    if req.dcn:
        sizes = [n for _, n in parse_axes(req.dcn, "--dcn")]
        from_dcn = None if -1 in sizes else math.prod(sizes)
        if from_dcn is not None:
            check_slice_count(from_dcn, f"--dcn {req.dcn} ({from_dcn} slices)")
    if req.num_slices is not None and from_dcn is not None and req.num_slices != from_dcn:
        raise MeshError(f"--dcn spans {from_dcn} slices but --num-slices is {req.num_slices}", "make them agree")
    return req.num_slices or from_dcn or 1


def _from_api(req: SliceRequest) -> ResolvedSlices:
    from tpulaunch.discover import describe

    if req.queued_resource:
        specs = list(describe.describe_queued_resource(req.queued_resource, zone=req.zone, project=req.project))
    else:
        assert req.tpu  # called for a --tpu or a --queued-resource
        specs = [describe.describe_node(req.tpu, zone=req.zone, project=req.project)]
    return _checked(specs, req, "tpu-api")


def _checked(specs: list[SliceSpec], req: SliceRequest, source: str) -> ResolvedSlices:
    """Discovered slices, after checking them against the flags, for readiness, and for sameness."""
    from tpulaunch.discover import describe

    for s in specs:
        describe.check_matches(s, req.topology, req.accelerator)
        describe.check_ready(s, req.force)
    if req.num_slices is not None and req.num_slices != len(specs):
        raise MeshError(
            f"--num-slices {req.num_slices} but {len(specs)} slice(s) were found",
            "drop --num-slices or use a queued resource with that many nodes",
        )
    topo = specs[0].to_topology(req.chips_per_host)
    for s in specs[1:]:
        if s.to_topology(req.chips_per_host) != topo:
            raise MeshError(
                f"slices {specs[0].name} and {s.name} differ ({specs[0].accelerator_type} vs {s.accelerator_type})",
                "multislice needs identical slices",
            )
    return ResolvedSlices(topo, tuple(specs), False, source)


def _rehearse(found: ResolvedSlices) -> ResolvedSlices:
    """Found through the API but nothing to run on from here: rehearse it on this machine."""
    t = found.topology
    note = (f"no Ray cluster given (--address): emulating the discovered slice {found.slices[0].name}"
            f" ({t.accelerator_type}, {t.topology}) on this machine")
    specs = tuple(SliceSpec.emulated_from(t, s.name, i) for i, s in enumerate(found.slices))
    return ResolvedSlices(t, specs, True, "tpu-api", (note,))


def _from_ray(req: SliceRequest, cluster: ClusterSlices) -> ResolvedSlices:
    """On a real Ray cluster: the slices Ray's TPU labels describe; pick free ones that fit."""
    from tpulaunch.discover import ray_labels

    want = None
    if req.topology or req.accelerator:
        want = topo_mod.resolve(topology=req.topology, accelerator=req.accelerator, chips_per_host=req.chips_per_host)
    pool = [s for s in cluster.ray_slices if s.name not in cluster.spares]
    chosen = ray_labels.choose(pool, want=want, tpu=req.tpu, num_slices=_wanted_slices(req))
    specs = tuple(s.to_spec(i) for i, s in enumerate(chosen))
    return ResolvedSlices(specs[0].to_topology(req.chips_per_host), specs, False, "ray")


def _on_emulated_cluster(topology: Topology, num_slices: int, cluster: ClusterSlices) -> ResolvedSlices:
    """On a warm emulated cluster, run on its slices (their names are what its nodes carry)."""
    specs = cluster.slices
    if len(specs) != num_slices or specs[0].to_topology() != topology:
        have = f"{len(specs)} x {specs[0].accelerator_type} ({specs[0].topology})" if specs else "no slices"
        raise LaunchError(
            f"the running emulated cluster holds {have}, not {num_slices} x {topology.accelerator_type}"
            f" ({topology.topology})",
            "run with the cluster's topology, or `tpulaunch cluster down` and bring up the one you need",
        )
    return ResolvedSlices(topology, specs, True, "emulated-cluster")
