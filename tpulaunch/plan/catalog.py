"""The catalog of TPU generations: what each generation's chips, hosts and valid slices are.

Pure data: no network, no runtime. `topology.py` builds a slice's `Topology` from an entry here.

Valid slice shapes follow Google's published rules (the ones xpk's `system_characteristics`
encodes), as rules rather than lists, so whole pods are reachable:

* 3D generations (v4, v5p, v7x): the sub-cube slices `2x2x1`, `2x2x2`, `2x2x4`, `2x4x4`, and any
  `AxBxC` whose dimensions are all multiples of 4, up to the pod's number of 4x4x4 cubes:
  64 on v4 (4096 chips), 140 on v5p (8960 chips), 144 on v7x (9216 chips).
* 2D generations: the listed shapes; v5e and v6e reach 16x16 (256 chips), v2 16x16, v3 32x32.
  We include the single-host `2x2` of v2/v3 (v2-8, v3-8), which Ray leaves out of its table.

Several shapes can have the same size (v5p 4x4x16 and 4x8x8). The canonical shape of a size,
used for `v5p-512`-style names, is the most cubic one with dimensions in non-decreasing order:
the shape the Cloud TPU API and xpk give that accelerator type (`v5p-17920` is 16x20x28).
Every shape in Ray's `VALID_TPU_TOPOLOGY` is valid here (tested), so what we plan Ray can schedule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tpulaunch.errors import TopologyError

Coord = tuple[int, int, int]
SHAPE_RE = re.compile(r"^\d{1,5}(x\d{1,5}){1,2}$")  # bounded: a 10,000-digit dimension is not a topology
TYPE_RE = re.compile(r"^([a-z0-9]{1,20}?)-(\d{1,6})$")
CUBE = 4  # the edge of the 4x4x4 cube larger 3D slices are built from
SUB_CUBE_SHAPES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")


def _shape_str(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def _dims(shape: str) -> tuple[int, ...]:
    return tuple(int(d) for d in shape.split("x"))


@dataclass(frozen=True)
class Generation:
    """Facts about one TPU generation, and the rule for its valid slice shapes."""

    name: str  # canonical short name: v2, v3, v4, v5e, v5p, v6e, v7x
    type_prefix: str  # accelerator-type prefix as the Cloud TPU API writes it
    aliases: tuple[str, ...]
    tensorcores_per_chip: int
    devices_per_chip: int  # devices the runtime reports per chip (cores on v2/v3/v7x; 1 for megacore)
    suffix_counts: str  # what N in "<prefix>-N" counts: "cores" or "chips"
    torus_dims: int  # 2 or 3
    chips_per_host: int  # chips per TPU VM on a multi-host slice
    single_host_shapes: tuple[str, ...]  # shapes that fit one VM with all their chips
    listed_shapes: tuple[str, ...]  # valid whatever the cube rule says (2D: all of them)
    ray_accelerator: str  # Ray's `accelerator_type:` value, e.g. TPU-V4
    max_cubes: int = 0  # 3D: slices of 4x4x4 cubes up to this many (the whole pod); 0: none
    hbm_gib: int = 0  # HBM per chip, GiB, as Google publishes it (`run --rehearse` checks programs against it)

    @property
    def cores_per_suffix_unit(self) -> int:
        return self.tensorcores_per_chip if self.suffix_counts == "cores" else 1

    @property
    def max_chips(self) -> int:
        listed = max(math.prod(_dims(s)) for s in self.listed_shapes)
        return max(listed, self.max_cubes * CUBE ** 3)

    def accelerator_type(self, chips: int) -> str:
        return f"{self.type_prefix}-{chips * self.cores_per_suffix_unit}"

    def is_valid(self, dims: tuple[int, ...]) -> bool:
        """Is a shape (with this generation's number of dimensions) a slice of this generation?"""
        if len(dims) != self.torus_dims:
            return False
        if _shape_str(dims) in self.listed_shapes:
            return True
        return (self.max_cubes > 0 and all(d % CUBE == 0 and d > 0 for d in dims)
                and math.prod(d // CUBE for d in dims) <= self.max_cubes)

    def canonical_shape(self, chips: int) -> str | None:
        """The shape a slice of `chips` chips has when named by size (`v4-32`), or None."""
        same = [_dims(s) for s in self.listed_shapes if math.prod(_dims(s)) == chips]
        cubes, rest = divmod(chips, CUBE ** 3)
        if self.max_cubes and not rest and 0 < cubes <= self.max_cubes:
            same += [tuple(CUBE * f for f in t) for t in _factor_triples(cubes)]
        if not same:
            return None
        # most cubic; among equals the one written in non-decreasing order
        best = min(same, key=lambda d: (max(d) - min(d), list(d) != sorted(d), d))
        return _shape_str(best)

    def sizes(self) -> list[int]:
        """Every slice size (chips) of this generation, ascending."""
        out = {math.prod(_dims(s)) for s in self.listed_shapes}
        out.update(c * CUBE ** 3 for c in range(1, self.max_cubes + 1))
        return sorted(out)

    def canonical_shapes(self) -> list[str]:
        """One shape per size, the canonical one, ascending by size (what `v<N>-<size>` names)."""
        shapes = (self.canonical_shape(c) for c in self.sizes())
        return [s for s in shapes if s is not None]  # every size has one: none is left out

    def describe_shapes(self, limit: int = 12) -> str:
        """The valid shapes, for an error message."""
        listed = ", ".join(self.listed_shapes[:limit])
        if self.max_cubes:
            return (f"{listed}, or AxBxC with every dimension a multiple of {CUBE}, up to"
                    f" {self.max_cubes} cubes of 4x4x4 ({self.max_cubes * CUBE ** 3} chips)")
        return listed + (f", ... ({len(self.listed_shapes)} in all)" if len(self.listed_shapes) > limit else "")


def _factor_triples(n: int) -> list[tuple[int, int, int]]:
    """(a, b, c) with a <= b <= c and a * b * c == n."""
    out = []
    for a in range(1, int(round(n ** (1 / 3))) + 2):
        if n % a:
            continue
        for b in range(a, int(math.isqrt(n // a)) + 1):
            if (n // a) % b == 0 and n // a // b >= b:
                out.append((a, b, n // a // b))
    return out


_V2_SHAPES = ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16")
_LITE_SHAPES = ("1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16")

GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v2", "v2", (), 2, 2, "cores", 2, 4, ("2x2",), _V2_SHAPES, "TPU-V2", hbm_gib=16),
        Generation("v3", "v3", (), 2, 2, "cores", 2, 4, ("2x2",), _V2_SHAPES + ("16x32", "32x32"), "TPU-V3",
                   hbm_gib=32),
        Generation("v4", "v4", (), 2, 1, "cores", 3, 4, ("2x2x1",), SUB_CUBE_SHAPES, "TPU-V4", max_cubes=64,
                   hbm_gib=32),
        Generation("v5e", "v5litepod", ("v5litepod", "v5lite", "v5e"), 1, 1, "chips", 2, 4,
                   ("1x1", "2x2", "2x4"), _LITE_SHAPES, "TPU-V5LITEPOD", hbm_gib=16),
        Generation("v5p", "v5p", (), 2, 1, "cores", 3, 4, ("2x2x1",), SUB_CUBE_SHAPES, "TPU-V5P", max_cubes=140,
                   hbm_gib=95),
        Generation("v6e", "v6e", ("trillium",), 1, 1, "chips", 2, 4, ("1x1", "2x2", "2x4"), _LITE_SHAPES,
                   "TPU-V6E", hbm_gib=32),
        Generation("v7x", "tpu7x", ("tpu7x", "v7", "ironwood"), 2, 2, "cores", 3, 4, ("2x2x1",), SUB_CUBE_SHAPES,
                   "TPU-V7X", max_cubes=144, hbm_gib=192),
    )
}

_ALIASES: dict[str, str] = {}
for _g in GENERATIONS.values():
    for _name in (_g.name, _g.type_prefix, *_g.aliases):
        _ALIASES[_name.lower()] = _g.name

DEFAULT_2D_GENERATION = "v6e"


def generation(name: str) -> Generation:
    """Look up a generation by any of its names (`v5e`, `v5litepod`, `tpu7x`, `TPU-V4`, ...)."""
    key = name.strip().lower()
    if key.startswith("tpu-"):
        key = key[4:]
    if key in _ALIASES:
        return GENERATIONS[_ALIASES[key]]
    raise TopologyError(
        f"unknown TPU generation {name[:40]!r}" + (f" ({len(name)} characters)" if len(name) > 40 else ""),
        f"choose one of {', '.join(GENERATIONS)}",
    )
