"""Turn what the user asked for into concrete slices: flags, Cloud TPU API, or metadata server.

One place decides where the slice comes from, so `run`, `exec` and `mesh inspect` agree:

1. `--tpu NAME` / `--queued-resource NAME`: the Cloud TPU API (`tpulaunch.discovery`).
2. Running on a TPU VM with no slice flags: the GCE metadata server.
3. Otherwise `--topology` / `--accelerator`: an emulated slice on this machine.

Flags given next to a discovered slice are checked against it, never silently applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpulaunch import topology as topo_mod
from tpulaunch.errors import MeshError
from tpulaunch.slicespec import SliceSpec
from tpulaunch.topology import Topology


@dataclass(frozen=True)
class ResolvedSlices:
    topology: Topology
    slices: tuple[SliceSpec, ...]
    emulated: bool
    source: str  # flags | tpu-api | metadata

    @property
    def num_slices(self) -> int:
        return len(self.slices)


def _dcn_slices(dcn: str | None) -> int | None:
    if not dcn:
        return None
    from tpulaunch.mesh import parse_axes

    sizes = [n for _, n in parse_axes(dcn, "--dcn")]
    return None if -1 in sizes else math.prod(sizes)


def resolve_slices(
    *,
    topology: str | None = None,
    accelerator: str | None = None,
    chips_per_host: int | None = None,
    tpu: str | None = None,
    queued_resource: str | None = None,
    zone: str | None = None,
    project: str | None = None,
    num_slices: int | None = None,
    dcn: str | None = None,
    force: bool = False,
    slice_name: str = "emulated",
    use_metadata: bool = True,
) -> ResolvedSlices:
    """Find the slice(s) to plan for. See the module docstring for the order."""
    from_dcn = _dcn_slices(dcn)
    if num_slices is not None and from_dcn is not None and num_slices != from_dcn:
        raise MeshError(f"--dcn spans {from_dcn} slices but --num-slices is {num_slices}", "make them agree")
    wanted = num_slices or from_dcn or 1

    if tpu or queued_resource:
        from tpulaunch import discovery

        if queued_resource:
            specs = list(discovery.describe_queued_resource(queued_resource, zone=zone, project=project))
        else:
            specs = [discovery.describe_node(tpu, zone=zone, project=project)]  # type: ignore[arg-type]
        return _discovered(specs, topology, accelerator, chips_per_host, num_slices, force, "tpu-api")

    if use_metadata and not (topology or accelerator):
        from tpulaunch import discovery

        local = discovery.local_slice()
        if local is not None:
            return _discovered([local], topology, accelerator, chips_per_host, num_slices, force, "metadata")

    topo = topo_mod.resolve(topology=topology, accelerator=accelerator, chips_per_host=chips_per_host)
    specs = [
        SliceSpec.emulated_from(topo, slice_name if wanted == 1 else f"{slice_name}-{i}", slice_index=i)
        for i in range(wanted)
    ]
    return ResolvedSlices(topo, tuple(specs), True, "flags")


def _discovered(
    specs: list[SliceSpec], topology: str | None, accelerator: str | None, chips_per_host: int | None,
    num_slices: int | None, force: bool, source: str,
) -> ResolvedSlices:
    from tpulaunch import discovery

    for s in specs:
        discovery.check_matches(s, topology, accelerator)
        discovery.check_ready(s, force)
    if num_slices is not None and num_slices != len(specs):
        raise MeshError(
            f"--num-slices {num_slices} but {len(specs)} slice(s) were found",
            "drop --num-slices or use a queued resource with that many nodes",
        )
    topo = specs[0].to_topology(chips_per_host)
    for s in specs[1:]:
        if s.to_topology(chips_per_host) != topo:
            raise MeshError(
                f"slices {specs[0].name} and {s.name} differ ({specs[0].accelerator_type} vs {s.accelerator_type})",
                "multislice needs identical slices",
            )
    return ResolvedSlices(topo, tuple(specs), False, source)
