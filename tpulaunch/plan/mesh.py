"""`MeshPlan`: the logical device mesh, planned on the driver from a `Topology` alone.

A MeshPlan is a *recipe*, not a framework object: a handful of ints and strings (it pickles
to under 2 KB even for a 6144-chip pod). Every derived table (which physical device sits
at which mesh position; the HLO sharding of a tensor, `plan/sharding.py`) is recomputed from those fields, so the
driver and every host agent agree on it without shipping large arrays. The framework mesh
(`torch_xla.distributed.spmd.Mesh`, `jax.sharding.Mesh`) is only ever built from it inside the
process that trains, after its runtime is up (see `tpulaunch/host/frameworks/`).

Device ids
    Plan device id = `slice * devices_per_slice + worker_id * devices_per_host + local`, where
    `local` enumerates the host's chips x-fastest (see `topology.py`) with cores innermost. In an
    emulated slice these are exactly the CPU runtime's device ordinals; on a TPU the agent maps
    them to runtime ordinals through each device's `coords` / `core_on_chip` / `slice_index`.

Placement (how mesh positions map to chips): see `placement.py`
    1. Each slice's (ICI) mesh is laid onto the torus by the placement the plan names
       (`auto` by default, `ici`, or `host`, the old host-walk rule), scored per axis in ICI hops
       per ring step (`MeshPlan.cost()`); `auto` keeps each host's devices on whole rows of the
       first axis where the other axes fit in a host, so per-host input loads one share per host.
    2. Multislice (DCN): slice `s` takes the block at row-major position `s` of the DCN shape;
       along each axis the DCN index is the outer part: `index = dcn_index * ici_size + ici_index`
       (the `HybridMesh` / `create_hybrid_device_mesh` convention). DCN axes are outermost.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from tpulaunch.errors import MeshError
from tpulaunch.plan import placement as placement_mod
from tpulaunch.plan.placement import PLACEMENTS, snake  # noqa: F401 - snake: the host walk, for tests
from tpulaunch.plan.topology import Coord, Topology

_AXIS_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_AXIS_NAMES = ("None", "none", "_")  # `--spec` reads these as "replicate this dimension"
# The most slices one multislice job may span. Cloud TPU documents no number; this is well above the
# largest published run (199 slices of v5e-256, 50,944 chips, Google Cloud blog, 2023) and keeps a
# typo (10000) from being planned.
MAX_SLICES = 1024

AxisSpec = tuple[tuple[str, int], ...]  # ordered (name, size); size -1 means "infer"


@dataclass(frozen=True)
class Device:
    """One device of the planned mesh, with its physical place."""

    id: int
    slice: int
    worker_id: int  # TPU worker id within its slice
    process: int  # global process index = slice * hosts_per_slice + worker_id
    chip: Coord
    core: int


# -- parsing ------------------------------------------------------------------------------------


def parse_axes(text: str, flag: str = "--mesh") -> AxisSpec:
    """`"data=4,model=-1"` -> `(("data", 4), ("model", -1))`."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        raise MeshError(f"{flag} is empty", f"write it as {flag} data=4,model=4")
    out: list[tuple[str, int]] = []
    for item in items:
        name, sep, size = item.partition("=")
        name = name.strip()
        if not sep or not _AXIS_RE.match(name):
            raise MeshError(
                f"{flag} entry '{item}' is not NAME=SIZE",
                f"write it as {flag} data=4,model=4 (one axis may be -1 to infer it)",
            )
        try:
            n = int(size)
        except ValueError:
            raise MeshError(f"{flag} axis '{name}' has size '{size}', not an integer",
                            "use a positive integer or -1") from None
        if n == 0 or n < -1:
            raise MeshError(f"{flag} axis '{name}' has size {n}", "sizes are positive integers (or -1 once, to infer)")
        if any(name == o for o, _ in out):
            raise MeshError(f"{flag} names axis '{name}' twice", "give every axis a distinct name")
        if name in RESERVED_AXIS_NAMES:
            raise MeshError(f"{flag} axis name '{name}' is reserved: --spec reads it as 'replicate'",
                            "call the axis something else, e.g. data or model")
        out.append((name, n))
    if sum(1 for _, n in out if n == -1) > 1:
        raise MeshError(f"{flag} has more than one -1 axis", "only one axis size can be inferred")
    return tuple(out)


def _infer(axes: AxisSpec, total: int, what: str) -> tuple[int, ...]:
    known = math.prod(n for _, n in axes if n != -1)
    desc = ",".join(f"{a}={n}" for a, n in axes)
    if any(n == -1 for _, n in axes):
        if total % known:
            raise MeshError(
                f"mesh {desc} cannot be completed: {total} {what} is not divisible by {known}",
                f"choose sizes whose product divides {total}",
            )
        return tuple(total // known if n == -1 else n for _, n in axes)
    if known != total:
        raise MeshError(
            f"mesh {desc} has {known} positions but there are {total} {what}",
            f"choose sizes whose product is {total} (or use -1 for one axis)",
        )
    return tuple(n for _, n in axes)


# -- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshPlan:
    """Logical mesh over one or more identical slices. Pure data; see the module docstring."""

    topology: Topology
    axis_names: tuple[str, ...]
    ici_shape: tuple[int, ...]
    dcn_shape: tuple[int, ...]
    num_slices: int = 1
    placement: str = "auto"  # see placement.py: auto, ici or host

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(i * d for i, d in zip(self.ici_shape, self.dcn_shape, strict=True))

    @property
    def num_devices(self) -> int:
        return self.topology.devices * self.num_slices

    @property
    def num_processes(self) -> int:
        return self.topology.num_hosts * self.num_slices

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_names.index(name)]

    # -- physical devices -----------------------------------------------------------------------
    def device(self, device_id: int) -> Device:
        t = self.topology
        s, rest = divmod(device_id, t.devices)
        w, local = divmod(rest, t.devices_per_host)
        chip_i, core = divmod(local, t.generation.devices_per_chip)
        chip = t.host_chips(w)[chip_i]
        return Device(device_id, s, w, s * t.num_hosts + w, chip, core)

    @cached_property
    def _grid(self) -> list[int]:
        """Device ids in row-major order of `shape` (cached; not pickled)."""
        walk = self.layout().ids.reshape(-1).tolist()
        per_slice = self.topology.devices
        ici, dcn, shape = self.ici_shape, self.dcn_shape, self.shape
        grid = [0] * math.prod(shape)
        for s in range(self.num_slices):
            dcn_idx = _unravel(s, dcn)
            for k, dev in enumerate(walk):
                ici_idx = _unravel(k, ici)
                full = tuple(d * i_size + i for d, i, i_size in zip(dcn_idx, ici_idx, ici, strict=True))
                grid[_ravel(full, shape)] = s * per_slice + dev
        return grid

    def layout(self) -> placement_mod.Layout:
        """One slice's layout (slice-local device ids with the ICI shape) and its scores."""
        return placement_mod.layout(self.topology, self.ici_shape, self.placement)

    def cost(self) -> list[dict]:
        """Per axis: its sizes, ICI hops per ring step in this layout, and the best any layout gives.

        `hops` is None for an axis with no ICI extent (it crosses slices only, over DCN).
        """
        lay = self.layout()
        best = placement_mod.ideal(self.topology, self.ici_shape)
        return [
            {"axis": name, "size": size, "ici": ici, "dcn": dcn,
             "hops": None if h is None else round(h, 4), "ideal": None if b is None else round(b, 4)}
            for name, size, ici, dcn, h, b in zip(self.axis_names, self.shape, self.ici_shape, self.dcn_shape,
                                                  lay.hops, best, strict=True)
        ]

    def device_ids(self) -> list[int]:
        """Flat device ids in row-major mesh order (the `device_ids` of a torch_xla Mesh)."""
        return list(self._grid)

    def grid(self) -> list:
        """Nested lists of device ids with the mesh's shape."""
        return _nest(self._grid, self.shape)

    def position_of(self, device_id: int) -> tuple[int, ...]:
        return _unravel(self._grid.index(device_id), self.shape)

    def iter_positions(self) -> Iterator[tuple[tuple[int, ...], Device]]:
        for flat, dev in enumerate(self._grid):
            yield _unravel(flat, self.shape), self.device(dev)

    def match_physical(self, attributes: list[dict], runtime: str) -> list[int]:
        """Indices into `attributes` (TPU device attribute dicts) in row-major mesh order.

        Matches on (`slice_index`, `coords`, `core_on_chip`), so the mesh is right whatever order
        the runtime numbered its devices in. Shared by the framework adapters.
        """
        from tpulaunch.errors import MeshMismatchError

        index = {
            (int(a.get("slice_index", 0)), tuple(int(c) for c in a["coords"]), int(a.get("core_on_chip", 0))): i
            for i, a in enumerate(attributes)
        }
        out = []
        for dev_id in self.device_ids():
            d = self.device(dev_id)
            i = index.get((d.slice, tuple(d.chip), d.core))
            if i is None:
                raise MeshMismatchError(
                    f"planned device {dev_id} (slice {d.slice}, chip {d.chip}, core {d.core}) is not among"
                    f" {runtime}'s devices",
                    "the slice's physical layout differs from the plan; check --topology",
                )
            out.append(i)
        return out

    def process_device_ids(self, process: int) -> list[int]:
        """Device ids owned by one process (host), in id order."""
        per_host = self.topology.devices_per_host
        return list(range(process * per_host, (process + 1) * per_host))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_grid", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # -- rendering data ---------------------------------------------------------------------------
    def to_dict(self, devices: bool = True) -> dict:
        """Documented JSON form (schema `tpulaunch.mesh/v1`)."""
        t = self.topology
        doc: dict = {
            "schema": "tpulaunch.mesh/v1",
            "axis_names": list(self.axis_names),
            "shape": list(self.shape),
            "ici_shape": list(self.ici_shape),
            "dcn_shape": list(self.dcn_shape),
            "num_slices": self.num_slices,
            "num_devices": self.num_devices,
            "num_processes": self.num_processes,
            "generation": t.generation.name,
            "accelerator_type": t.accelerator_type,
            "topology": t.topology,
            "devices_per_host": t.devices_per_host,
            "placement": self.placement,
            "keeps_host_rows": self.layout().keeps_host_rows,
            "cost": self.cost(),
            "grid": self.grid(),
        }
        if devices:
            doc["devices"] = [
                {
                    "id": d.id, "position": list(pos), "slice": d.slice, "worker_id": d.worker_id,
                    "process": d.process, "chip": list(d.chip), "core": d.core,
                }
                for pos, d in sorted(self.iter_positions(), key=lambda pd: pd[1].id)
            ]
            doc["processes"] = [
                {
                    "process": p, "slice": p // t.num_hosts, "worker_id": p % t.num_hosts,
                    "device_ids": self.process_device_ids(p),
                }
                for p in range(self.num_processes)
            ]
        return doc


def check_slice_count(num_slices: int, asked: str | None = None) -> None:
    """1 to MAX_SLICES slices, checked before anything is built per slice: a typo of a billion
    slices is one line at once, not a minute of planning that ends in MemoryError. `asked`: the
    flag as the user gave it (default `--num-slices N`)."""
    asked = asked or f"--num-slices {num_slices}"
    if num_slices < 1:
        raise MeshError(f"{asked} is not a number of slices", "use 1 or more")
    if num_slices > MAX_SLICES:
        raise MeshError(f"{asked} is more slices than a multislice job can have ({MAX_SLICES})",
                        "the largest published multislice run spans 199 slices; check the number")


def check_num_slices(topology: Topology, num_slices: int) -> None:
    """How many slices a multislice of `topology` may have: 1 to MAX_SLICES, and more than one only
    for generations Cloud TPU Multislice supports (v4 and later)."""
    check_slice_count(num_slices)
    if num_slices > 1 and topology.generation.name in ("v2", "v3"):
        raise MeshError(f"{topology.generation.name} slices do not form a multislice"
                        " (Cloud TPU Multislice is v4 and later)",
                        "use one slice, or a v4 or later generation")


def elastic_axis(plan: MeshPlan) -> int | None:
    """The one mesh axis that spans the slices (`--dcn data=N`), which a run on fewer slices shrinks;
    None when the slices are spread over several axes (no shape to shrink to) or there is one slice."""
    over = [i for i, d in enumerate(plan.dcn_shape) if d > 1]
    return over[0] if len(over) == 1 and plan.dcn_shape[over[0]] == plan.num_slices else None


def resize_slices(plan: MeshPlan, num_slices: int) -> MeshPlan:
    """The mesh on `num_slices` slices: its DCN axis (`elastic_axis`) that long, the rest as planned."""
    if num_slices == plan.num_slices:
        return plan
    axis = elastic_axis(plan)
    if axis is None:
        raise MeshError(f"the mesh {dict(zip(plan.axis_names, plan.dcn_shape, strict=True))} over DCN has no one"
                        f" axis across its {plan.num_slices} slices to resize",
                        "put the slices on one --dcn axis, e.g. --dcn data=2")
    check_num_slices(plan.topology, num_slices)
    dcn = tuple(num_slices if i == axis else d for i, d in enumerate(plan.dcn_shape))
    return replace(plan, dcn_shape=dcn, num_slices=num_slices)


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise MeshError(f"--placement {placement[:40]!r} is not a placement", f"use one of {', '.join(PLACEMENTS)}")


def plan_mesh(
    topology: Topology,
    mesh: str | AxisSpec | None = None,
    dcn: str | AxisSpec | None = None,
    num_slices: int | None = None,
    placement: str = "auto",
) -> MeshPlan:
    """Plan the mesh for `num_slices` copies of `topology`.

    `mesh` is the per-slice (ICI) mesh, e.g. `data=4,model=4`; default: `("data",)` over one
    host, `("data", "model") = (hosts, devices_per_host)` over several. `dcn` gives how many
    slices each axis spans, e.g. `data=2`; an axis named only in `dcn` is added as the outermost
    axis. The full mesh is the elementwise product of the two, as in torch_xla's `HybridMesh`.
    `placement` (`auto`, `ici`, `host`) lays each slice's mesh onto its chips; see `placement.py`.
    """
    check_placement(placement)
    ici_axes = parse_axes(mesh) if isinstance(mesh, str) else mesh
    dcn_axes = parse_axes(dcn, "--dcn") if isinstance(dcn, str) else dcn
    if dcn_axes and any(n == -1 for _, n in dcn_axes):
        if num_slices is None:
            raise MeshError("--dcn with -1 needs --num-slices", "give the DCN sizes explicitly or pass --num-slices")
    if num_slices is None:
        num_slices = math.prod(n for _, n in dcn_axes) if dcn_axes else 1
    check_num_slices(topology, num_slices)

    if ici_axes is None:
        if topology.num_hosts == 1:
            ici_axes = (("data", topology.devices),)
        else:
            ici_axes = (("data", topology.num_hosts), ("model", topology.devices_per_host))
    ici = _infer(ici_axes, topology.devices, "devices per slice")
    names = [n for n, _ in ici_axes]

    if dcn_axes is None:
        dcn_axes = ((names[0], num_slices),) if num_slices > 1 else ()
    dcn_sizes = _infer(dcn_axes, num_slices, "slices") if dcn_axes else ()
    ici_list = list(ici)
    dcn_by_name = dict(zip((n for n, _ in dcn_axes), dcn_sizes, strict=True))
    for name in reversed([n for n, _ in dcn_axes if n not in names]):
        names.insert(0, name)
        ici_list.insert(0, 1)
    if len(set(names)) != len(names):
        raise MeshError("mesh axis names repeat", "give every axis a distinct name")
    dcn_shape = tuple(dcn_by_name.get(n, 1) for n in names)
    if math.prod(dcn_shape) != num_slices:
        raise MeshError(
            f"--dcn {','.join(f'{n}={s}' for n, s in dcn_by_name.items())} spans {math.prod(dcn_shape)} slices"
            f" but there are {num_slices}",
            "make the DCN sizes multiply to --num-slices",
        )
    return MeshPlan(topology, tuple(names), tuple(ici_list), dcn_shape, num_slices, placement)


# -- small index helpers ------------------------------------------------------------------------


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    idx = []
    for n in reversed(shape):
        flat, r = divmod(flat, n)
        idx.append(r)
    return tuple(reversed(idx))


def _ravel(idx: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(idx, shape, strict=True):
        flat = flat * n + i
    return flat


def _nest(flat: list[int], shape: Sequence[int]) -> list:
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
