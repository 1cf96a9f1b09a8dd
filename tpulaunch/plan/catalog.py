"""The catalog of TPU generations: what each generation's chips, hosts and valid slices are.

Pure data: no network, no runtime. `topology.py` builds a slice's `Topology` from an entry here.

Valid shapes follow Ray's `VALID_TPU_TOPOLOGY` table (`ray/_private/accelerators/tpu.py`), so that a
slice we accept is a slice Ray can schedule; we add the single-host `2x2` of v2/v3 (v2-8, v3-8),
which Ray leaves out of its multi-host table but which are the most common v2/v3 slices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tpulaunch.errors import TopologyError

Coord = tuple[int, int, int]
SHAPE_RE = re.compile(r"^\d+(x\d+){1,2}$")
TYPE_RE = re.compile(r"^([a-z0-9]+?)-(\d+)$")


@dataclass(frozen=True)
class Generation:
    """Facts about one TPU generation."""

    name: str  # canonical short name: v2, v3, v4, v5e, v5p, v6e, v7x
    type_prefix: str  # accelerator-type prefix as the Cloud TPU API writes it
    aliases: tuple[str, ...]
    tensorcores_per_chip: int
    devices_per_chip: int  # devices the runtime reports per chip (cores on v2/v3/v7x; 1 for megacore)
    suffix_counts: str  # what N in "<prefix>-N" counts: "cores" or "chips"
    torus_dims: int  # 2 or 3
    chips_per_host: int  # chips per TPU VM on a multi-host slice
    single_host_shapes: tuple[str, ...]  # shapes that fit one VM with all their chips
    valid_shapes: tuple[str, ...]
    ray_accelerator: str  # Ray's `accelerator_type:` value, e.g. TPU-V4

    @property
    def cores_per_suffix_unit(self) -> int:
        return self.tensorcores_per_chip if self.suffix_counts == "cores" else 1

    def accelerator_type(self, chips: int) -> str:
        return f"{self.type_prefix}-{chips * self.cores_per_suffix_unit}"


def _shape_str(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def _cube_shapes(xy: range, z: range) -> tuple[str, ...]:
    small = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
    big = tuple(_shape_str((x, y, zz)) for x in xy for y in xy for zz in z)
    return small + big


_V2_SHAPES = ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16")
_LITE_SHAPES = ("1x1", "2x2", "2x4", "2x8", "4x4", "4x8", "8x8", "8x16", "16x16")
_V7X_SHAPES = (
    "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16",
)

GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v2", "v2", (), 2, 2, "cores", 2, 4, ("2x2",), _V2_SHAPES, "TPU-V2"),
        Generation(
            "v3", "v3", (), 2, 2, "cores", 2, 4, ("2x2",), _V2_SHAPES + ("16x32", "32x32"), "TPU-V3"
        ),
        Generation(
            "v4", "v4", (), 2, 1, "cores", 3, 4, ("2x2x1",),
            _cube_shapes(range(4, 13, 4), range(4, 17, 4)), "TPU-V4",
        ),
        Generation(
            "v5e", "v5litepod", ("v5litepod", "v5lite", "v5e"), 1, 1, "chips", 2, 4,
            ("1x1", "2x2", "2x4"), _LITE_SHAPES, "TPU-V5LITEPOD",
        ),
        Generation(
            "v5p", "v5p", (), 2, 1, "cores", 3, 4, ("2x2x1",),
            _cube_shapes(range(4, 17, 4), range(4, 25, 4)), "TPU-V5P",
        ),
        Generation(
            "v6e", "v6e", ("trillium",), 1, 1, "chips", 2, 4, ("1x1", "2x2", "2x4"), _LITE_SHAPES,
            "TPU-V6E",
        ),
        Generation(
            "v7x", "tpu7x", ("tpu7x", "v7", "ironwood"), 2, 2, "cores", 3, 4, ("2x2x1",), _V7X_SHAPES,
            "TPU-V7X",
        ),
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
        f"unknown TPU generation '{name}'",
        f"choose one of {', '.join(GENERATIONS)}",
    )
