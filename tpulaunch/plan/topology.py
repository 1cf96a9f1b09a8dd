"""The `Topology` of one slice: its shape, hosts and chips, resolved from what a user typed.

Pure data and arithmetic: no network, no runtime. Everything downstream (mesh planning,
per-host environment, Ray resources) is derived from a `Topology`; the generations it is built
from are in `catalog.py`.

Conventions (documented because every other module relies on them):

* Chip coordinates are `(x, y, z)`; 2D generations have `z == 0` and a shape `(X, Y, 1)`.
* A host owns a rectangular block of `chips_per_host_bounds` chips. Host grid coordinates are
  `(x // bx, y // by, z // bz)`.
* TPU worker id (= process index on a single slice) enumerates the host grid with x fastest,
  then y, then z, the order libtpu uses for `TPU_HOST_BOUNDS`.
* Inside a host, chips are listed x fastest, then y, then z, and each chip contributes
  `devices_per_chip` runtime devices (cores) innermost.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from tpulaunch.errors import TopologyError
from tpulaunch.plan.catalog import (
    _ALIASES,
    DEFAULT_2D_GENERATION,
    GENERATIONS,
    SHAPE_RE,
    TYPE_RE,
    Coord,
    Generation,
    _shape_str,
    generation,
)

__all__ = ["Coord", "Generation", "GENERATIONS", "Host", "Topology", "generation", "make_topology",
           "parse_accelerator_type", "parse_shape", "resolve"]


@dataclass(frozen=True)
class Host:
    """One TPU VM of a slice: its worker id, place in the host grid, and chips."""

    worker_id: int
    grid: Coord
    chips: tuple[Coord, ...]


@dataclass(frozen=True)
class Topology:
    """One slice: generation, shape, and how chips are split over hosts.

    Frozen and small (a few ints and strings) so it pickles cheaply; per-host and per-chip
    lists are derived on demand.
    """

    generation: Generation
    shape: Coord  # chips along x, y, z (z == 1 on 2D generations)
    chips_per_host_bounds: Coord
    notes: tuple[str, ...] = field(default=(), compare=False)

    # -- basic counts -------------------------------------------------------------------------
    @property
    def topology(self) -> str:
        """The shape as the Cloud TPU API writes it (`2x8`, `2x2x4`)."""
        dims = self.shape if self.generation.torus_dims == 3 else self.shape[:2]
        return _shape_str(dims)

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def chips_per_host(self) -> int:
        return math.prod(self.chips_per_host_bounds)

    @property
    def devices_per_host(self) -> int:
        return self.chips_per_host * self.generation.devices_per_chip

    @property
    def host_bounds(self) -> Coord:
        b = self.chips_per_host_bounds
        return (self.shape[0] // b[0], self.shape[1] // b[1], self.shape[2] // b[2])

    @property
    def num_hosts(self) -> int:
        return math.prod(self.host_bounds)

    @property
    def accelerator_type(self) -> str:
        return self.generation.accelerator_type(self.chips)

    @staticmethod
    def bounds_str(b: Coord) -> str:
        """`TPU_HOST_BOUNDS` / `TPU_CHIPS_PER_HOST_BOUNDS` form: `2,2,1`."""
        return ",".join(str(v) for v in b)

    # -- hosts and chips ----------------------------------------------------------------------
    def host_grid(self, worker_id: int) -> Coord:
        hx, hy, _ = self.host_bounds
        return (worker_id % hx, (worker_id // hx) % hy, worker_id // (hx * hy))

    def worker_id_of_grid(self, grid: Sequence[int]) -> int:
        hx, hy, _ = self.host_bounds
        return grid[0] + hx * (grid[1] + hy * grid[2])

    def host_chips(self, worker_id: int) -> tuple[Coord, ...]:
        """Chip coordinates owned by a host, x fastest."""
        bx, by, bz = self.chips_per_host_bounds
        gx, gy, gz = self.host_grid(worker_id)
        return tuple(
            (gx * bx + x, gy * by + y, gz * bz + z)
            for z in range(bz)
            for y in range(by)
            for x in range(bx)
        )

    def host_of_chip(self, chip: Coord) -> int:
        b = self.chips_per_host_bounds
        return self.worker_id_of_grid((chip[0] // b[0], chip[1] // b[1], chip[2] // b[2]))

    @cached_property
    def hosts(self) -> tuple[Host, ...]:
        return tuple(
            Host(w, self.host_grid(w), self.host_chips(w)) for w in range(self.num_hosts)
        )

    def __getstate__(self) -> dict:
        # cached_property stores into __dict__; keep pickles small by dropping caches.
        state = dict(self.__dict__)
        state.pop("hosts", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def iter_devices(self) -> Iterator[tuple[int, Coord, int]]:
        """(worker_id, chip coords, core) for every device, in slice device-id order."""
        for w in range(self.num_hosts):
            for chip in self.host_chips(w):
                for core in range(self.generation.devices_per_chip):
                    yield w, chip, core

    def to_dict(self, with_hosts: bool = True) -> dict:
        """The documented JSON form (schema `tpulaunch.topology/v1`)."""
        g = self.generation
        doc = {
            "schema": "tpulaunch.topology/v1",
            "generation": g.name,
            "accelerator_type": self.accelerator_type,
            "topology": self.topology,
            "torus_dims": g.torus_dims,
            "tensorcores_per_chip": g.tensorcores_per_chip,
            "devices_per_chip": g.devices_per_chip,
            "suffix_counts": g.suffix_counts,
            "chips": self.chips,
            "devices": self.devices,
            "hosts": self.num_hosts,
            "chips_per_host": self.chips_per_host,
            "devices_per_host": self.devices_per_host,
            "host_bounds": self.bounds_str(self.host_bounds),
            "chips_per_host_bounds": self.bounds_str(self.chips_per_host_bounds),
            "notes": list(self.notes),
        }
        if with_hosts:
            doc["host_list"] = [
                {"worker_id": h.worker_id, "grid": list(h.grid), "chips": [list(c) for c in h.chips]}
                for h in self.hosts
            ]
        return doc


# -- parsing ------------------------------------------------------------------------------------


def _short(text: str, n: int = 40) -> str:
    """What a user typed, cut for an error line."""
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters)"


def parse_shape(text: str) -> tuple[int, ...]:
    """`"2x2x4"` -> `(2, 2, 4)`; anything else is a TopologyError."""
    t = text.strip().lower()
    if not SHAPE_RE.fullmatch(t):
        raise TopologyError(
            f"'{_short(text)}' is not a topology",
            "write it as XxY (2D: v2, v3, v5e, v6e) or XxYxZ (3D: v4, v5p, v7x), e.g. 2x8 or 2x2x4",
        )
    dims = tuple(int(d) for d in t.split("x"))
    if any(d <= 0 for d in dims):
        raise TopologyError(f"'{text}' has a zero dimension", "every dimension must be at least 1")
    return dims


def _chips_per_host_bounds(gen: Generation, dims3: Coord, chips_per_host: int | None) -> Coord:
    chips = math.prod(dims3)
    shape = _shape_str(dims3 if gen.torus_dims == 3 else dims3[:2])
    if chips_per_host is not None:
        # Only v5e/v6e have 1- and 8-chip VMs; every other generation's VM holds 4 chips.
        allowed = (1, 4, 8) if gen.name in ("v5e", "v6e") else (4,)
        if chips_per_host not in allowed or chips % chips_per_host:
            raise TopologyError(
                f"--chips-per-host {chips_per_host} does not fit {gen.name} {shape}",
                "use 4, or 8 for single-host v5e/v6e 2x4",
            )
        if chips_per_host == chips:
            return dims3
        if chips_per_host == 4:
            return (2, 2, 1)
        raise TopologyError(
            f"--chips-per-host {chips_per_host} does not fit {gen.name} {shape}",
            "1 or 8 chips per host only exist on single-host v5e/v6e (1x1, 2x4)",
        )
    if shape in gen.single_host_shapes:
        return dims3
    return (2, 2, 1)


def make_topology(
    gen: Generation, dims: tuple[int, ...], chips_per_host: int | None = None,
    notes: tuple[str, ...] = (),
) -> Topology:
    """Validate a shape for a generation and build the Topology."""
    if len(dims) != gen.torus_dims:
        want = "XxYxZ" if gen.torus_dims == 3 else "XxY"
        raise TopologyError(
            f"{gen.name} is a {gen.torus_dims}D torus but '{_shape_str(dims)}' has {len(dims)} dimensions",
            f"write it as {want}; valid {gen.name} shapes: {gen.describe_shapes()}",
        )
    shape = _shape_str(dims)
    if not gen.is_valid(dims):
        same_size = gen.canonical_shape(math.prod(dims))
        suggest = f"the {math.prod(dims)}-chip {gen.name} slice is {same_size}; " if same_size else ""
        raise TopologyError(
            f"{shape} is not a valid {gen.name} slice",
            f"{suggest}valid {gen.name} shapes: {gen.describe_shapes()}",
        )
    dims3: Coord = (dims[0], dims[1], dims[2] if len(dims) == 3 else 1)
    bounds = _chips_per_host_bounds(gen, dims3, chips_per_host)
    all_notes = list(notes)
    if gen.name in ("v5e", "v6e") and shape == "2x4" and math.prod(bounds) == 8:
        all_notes.append(
            "a 2x4 slice is one 8-chip VM through the Cloud TPU API (two 4-chip VMs on GKE:"
            " pass --chips-per-host 4)"
        )
    return Topology(gen, dims3, bounds, tuple(all_notes))


def parse_accelerator_type(text: str, chips_per_host: int | None = None) -> Topology:
    """`v4-32`, `v5litepod-16`, `v6e-8`, `tpu7x-16` -> Topology (the canonical shape for that size)."""
    t = text.strip().lower()
    m = TYPE_RE.fullmatch(t)
    if not m:
        raise TopologyError(
            f"'{_short(text)}' is not an accelerator type",
            "write it as <generation>-<N>, e.g. v4-32, v5litepod-16, v6e-8, tpu7x-16",
        )
    gen = generation(m.group(1))
    n = int(m.group(2))
    unit = gen.cores_per_suffix_unit
    shape = gen.canonical_shape(n // unit) if n % unit == 0 else None
    if shape is None:
        sizes = [c * unit for c in gen.sizes()]
        shown = ", ".join(f"{gen.type_prefix}-{s}" for s in sizes[:10])
        raise TopologyError(
            f"{text} is not a {gen.name} slice size",
            f"the suffix counts {gen.suffix_counts}; valid sizes: {shown}"
            + (f" ... {gen.type_prefix}-{sizes[-1]}" if len(sizes) > 10 else ""),
        )
    return make_topology(gen, parse_shape(shape), chips_per_host)


def resolve(
    spec: str | None = None,
    *,
    topology: str | None = None,
    accelerator: str | None = None,
    chips_per_host: int | None = None,
) -> Topology:
    """Resolve what a user typed into a Topology.

    `spec` is a positional ACCELERATOR_OR_SHAPE (`v4-32` or `2x2x4`). `topology` is a shape and
    `accelerator` a generation (`v4`) or accelerator type (`v4-32`). A 2D shape with no
    generation means v6e (said in `notes`); a 3D shape with no generation is an error.
    """
    shape_text = topology
    acc = accelerator
    if spec:
        if SHAPE_RE.match(spec.strip().lower()):
            if shape_text and shape_text != spec:
                raise TopologyError(f"two shapes given: '{spec}' and --topology '{shape_text}'", "give one")
            shape_text = spec
        else:
            if acc and acc != spec:
                raise TopologyError(f"two accelerators given: '{spec}' and --accelerator '{acc}'", "give one")
            acc = spec
    if not shape_text and not acc:
        raise TopologyError(
            "no slice given",
            "pass an accelerator type (v4-32) or a shape (--topology 2x8 [--accelerator v6e])",
        )
    if acc and TYPE_RE.match(acc.strip().lower()) and not acc.lower().startswith("tpu-"):
        by_type = parse_accelerator_type(acc, chips_per_host)
        if shape_text:
            dims = parse_shape(shape_text)
            topo = make_topology(by_type.generation, dims, chips_per_host)
            if topo.chips != by_type.chips:
                raise TopologyError(
                    f"--topology {shape_text} has {topo.chips} chips but {acc} has {by_type.chips}",
                    f"use --topology {by_type.topology} or drop one of the two",
                )
            return topo
        return by_type
    if not shape_text:
        if spec and acc == spec and "-" not in spec and spec.strip().lower() not in _ALIASES:
            raise TopologyError(
                f"'{spec}' is neither an accelerator type nor a topology",
                "write an accelerator type (v4-32, v5litepod-16, v6e-8, tpu7x-16) or a shape"
                " (2x8, or 2x2x4 with --accelerator v4)",
            )
        assert acc  # no shape: an accelerator, as checked above
        gen = generation(acc)
        raise TopologyError(
            f"--accelerator {acc} needs a shape or a size",
            f"add --topology (valid {gen.name} shapes: {gen.describe_shapes()}) or write {gen.type_prefix}-N",
        )
    dims = parse_shape(shape_text)
    if acc:
        return make_topology(generation(acc), dims, chips_per_host)
    if len(dims) == 3:
        three_d = [g.name for g in GENERATIONS.values() if g.torus_dims == 3]
        raise TopologyError(
            f"a 3D shape ({shape_text}) needs a generation",
            f"add --accelerator with one of {', '.join(three_d)}",
        )
    return make_topology(
        GENERATIONS[DEFAULT_2D_GENERATION], dims, chips_per_host,
        notes=(f"no generation given: a 2D shape means {DEFAULT_2D_GENERATION} (pass --accelerator to change)",),
    )
