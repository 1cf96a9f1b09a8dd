"""The target TPU as libtpu names it: pure data and arithmetic, no libtpu import.

A rehearsal asks libtpu (`jax.experimental.topologies.get_topology_desc`) for the slice the plan
describes, with the plan's host blocks and one device per chip where tpulaunch plans one
(megacore), so libtpu's devices and tpulaunch's are the same set and map one to one by
(slice, chip coordinates, core). Where libtpu's *default* description of a shape differs from
tpulaunch's, the difference is data here (`KNOWN_DIFFERENCES`), checked by
`tests/unit/test_catalog_vs_libtpu.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpulaunch.errors import LaunchError
from tpulaunch.plan.catalog import Generation
from tpulaunch.plan.mesh import MeshPlan
from tpulaunch.plan.topology import Topology

INSTALL_HINT = ("install the TPU compiler: pip install 'tpulaunch[rehearse]' (jax[tpu]: libtpu from PyPI,"
                " about 700 MB; no TPU needed)")

# What libtpu calls each generation in a topology name (`v5p:4x4x4`); it refuses `v5litepod`, `v7x`.
LIBTPU_NAMES = {"v2": "v2", "v3": "v3", "v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "v7x": "tpu7x"}

# libtpu's device_kind for each generation (what `jax.devices()[0].device_kind` says on the chip).
DEVICE_KINDS = {"v2": "TPU v2", "v3": "TPU v3", "v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5",
                "v6e": "TPU v6 lite", "v7x": "TPU7x"}


@dataclass(frozen=True)
class KnownDifference:
    """Where libtpu's default description of a slice is not tpulaunch's, and why both stand."""

    generation: str
    shapes: tuple[str, ...]  # () for every shape of the generation
    field: str  # devices_per_chip, chips_per_host_bounds
    libtpu: Any
    tpulaunch: Any
    reason: str
    rehearsal: dict  # the get_topology_desc arguments a rehearsal passes so libtpu gives tpulaunch's slice

    def applies(self, gen: str, shape: str) -> bool:
        return gen == self.generation and (not self.shapes or shape in self.shapes)


KNOWN_DIFFERENCES = (
    KnownDifference(
        "v4", (), "devices_per_chip", 2, 1,
        "libtpu's AOT topology lists each TensorCore of a v4 chip as a device (chip config 'default');"
        " a v4 VM runs megacore (one device per chip, both cores fused), which is what JAX sees on the"
        " chip and what tpulaunch plans",
        {"chip_config_name": "megacore"}),
    KnownDifference(
        "v5e", ("2x4",), "chips_per_host_bounds", (2, 2, 1), (2, 4, 1),
        "v5litepod-8 exists both as one 8-chip VM (ct5lp-hightpu-8t, what tpulaunch plans for a 2x4) and as"
        " two 4-chip VMs; libtpu's default for a 2x4 is the two-host form",
        {"chips_per_host_bounds": (2, 4, 1)}),
    KnownDifference(
        "v6e", ("2x4",), "chips_per_host_bounds", (2, 2, 1), (2, 4, 1),
        "v6e-8 exists both as one 8-chip VM (ct6e-standard-8t, what tpulaunch plans for a 2x4) and as two"
        " 4-chip VMs; libtpu's default for a 2x4 is the two-host form",
        {"chips_per_host_bounds": (2, 4, 1)}),
    KnownDifference(
        "v5e", ("1x1",), "chips_per_host_bounds", None, (1, 1, 1),
        "libtpu refuses a 1x1 by default (not divisible by its default 2x2 host); v5litepod-1 is one VM with one"
        " chip, which libtpu describes when given that host block",
        {"chips_per_host_bounds": (1, 1, 1)}),
    KnownDifference(
        "v6e", ("1x1",), "chips_per_host_bounds", None, (1, 1, 1),
        "libtpu refuses a 1x1 by default (not divisible by its default 2x2 host); v6e-1 is one VM with one chip,"
        " which libtpu describes when given that host block",
        {"chips_per_host_bounds": (1, 1, 1)}),
)


def libtpu_name(topology: Topology) -> str:
    """`v5p:4x4x4`: the name get_topology_desc takes for this slice's shape."""
    return f"{LIBTPU_NAMES[topology.generation.name]}:{topology.topology}"


def topology_args(topology: Topology, num_slices: int = 1) -> dict:
    """Keyword arguments for get_topology_desc that describe exactly the plan's slices: its host
    blocks, one device per chip on v4 (megacore), and the number of slices."""
    args: dict = {"topology_name": libtpu_name(topology), "platform": "tpu",
                  "chips_per_host_bounds": tuple(topology.chips_per_host_bounds)}
    if topology.generation.name == "v4":
        args["chip_config_name"] = "megacore"
    if num_slices > 1:
        args["num_slices"] = num_slices
    return args


def hbm_bytes_per_device(gen: Generation) -> int:
    """The published HBM of one device: the chip's, shared by its devices where a chip has two (v2,
    v3, v7x)."""
    return gen.hbm_gib * 2**30 // gen.devices_per_chip


def libtpu_env(topology: Topology) -> dict[str, str]:
    """What libtpu needs to describe a slice on a machine that is no TPU VM, quietly and without
    asking a metadata server: it would otherwise warn that it cannot find this VM's accelerator
    type and workers, and it holds /tmp/libtpu_lockfile against a second process on the machine
    (several rehearsals, or a rehearsal beside a test, load it at once)."""
    return {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": topology.accelerator_type,
            "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def device_map(plan: MeshPlan, tpu_devices: Sequence[Mapping[str, Any]]) -> list[int]:
    """For each plan device id, the index of the libtpu device with its (slice, chip, core).

    `tpu_devices`: one dict per libtpu device with `coords`, `core_on_chip` and `slice_index`
    (as `host.frameworks.jax.device_attributes` reads them). The rehearsal's CPU device `i` stands
    for plan device `i`, so this is also the CPU-to-TPU map of every program's device assignment.
    """
    index = {(int(a.get("slice_index") or 0), tuple(int(c) for c in a["coords"]), int(a.get("core_on_chip") or 0)): i
             for i, a in enumerate(tpu_devices)}
    if len(index) != plan.num_devices:
        raise LaunchError(f"libtpu describes {len(index)} devices for {plan.topology.accelerator_type}"
                          f" x {plan.num_slices}, tpulaunch plans {plan.num_devices}",
                          "this libtpu does not know the slice as tpulaunch does; report it")
    out = []
    for dev_id in range(plan.num_devices):
        d = plan.device(dev_id)
        key = (d.slice, tuple(d.chip), d.core)
        if key not in index:
            raise LaunchError(f"libtpu has no device at slice {d.slice} chip {d.chip} core {d.core}",
                              "this libtpu does not know the slice as tpulaunch does; report it")
        out.append(index[key])
    return out


def describe(args: dict) -> list[dict]:
    """libtpu's devices for `get_topology_desc(**args)`, as plain dicts (`coords`, `core_on_chip`,
    `slice_index`, `process_index`, `device_kind`). Imports JAX and loads libtpu: call it in a process
    whose environment has `libtpu_env` (libtpu reads it once, when it loads)."""
    from jax.experimental import topologies

    from tpulaunch.host.frameworks.jax import device_attributes

    devices: list[Any] = topologies.get_topology_desc(**args).devices  # jaxlib's Device: a C type, no stubs
    return [{**device_attributes(d), "device_kind": d.device_kind} for d in devices]


def host_blocks(devices: Sequence[Mapping[str, Any]]) -> dict[int, tuple[tuple[int, int, int], ...]]:
    """Each process's chips (sorted), from libtpu's devices: what the catalog test compares."""
    chips: dict[int, set] = {}
    for a in devices:
        chips.setdefault(int(a["process_index"]), set()).add(tuple(int(c) for c in a["coords"]))
    return {p: tuple(sorted(c)) for p, c in sorted(chips.items())}


def devices_per_chip(devices: Sequence[Mapping[str, Any]]) -> int:
    """Devices on each chip (the same on every chip of a slice, else an error)."""
    per: dict[tuple, int] = {}
    for a in devices:
        key = (int(a.get("slice_index") or 0), tuple(int(c) for c in a["coords"]))
        per[key] = per.get(key, 0) + 1
    counts = set(per.values())
    if len(counts) != 1:
        raise ValueError(f"chips hold different numbers of devices: {sorted(counts)}")
    return counts.pop()


def chips_per_host_bounds(devices: Sequence[Mapping[str, Any]]) -> tuple[int, int, int]:
    """The block of chips one host holds, from libtpu's devices (process 0's extent)."""
    mine = [tuple(int(c) for c in a["coords"]) for a in devices if int(a["process_index"]) == 0]
    x, y, z = (max(c[k] for c in mine) - min(c[k] for c in mine) + 1 for k in range(3))
    if x * y * z != len(set(mine)):
        raise ValueError(f"process 0's chips are no block: {sorted(set(mine))}")
    return x, y, z
