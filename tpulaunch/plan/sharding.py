"""How one tensor is split over a `MeshPlan`: the view `tpulaunch mesh inspect --shard` draws.

Pure, from the plan alone: the tiles, the blocks each device holds and the HLO sharding string
torch_xla's `mark_sharding` would report for the same partition spec (checked against torch_xla
in `tests/integration/test_torch_xla_mesh.py`). Nothing of a run needs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tpulaunch.errors import MeshError
from tpulaunch.plan.mesh import MeshPlan, _ravel, _unravel


def parse_spec(text: str) -> tuple[object, ...]:
    """`"data,model"` / `"data+model,None"` / `"-,model"` -> partition spec tuple."""
    out: list[object] = []
    for part in text.split(","):
        p = part.strip()
        if p in ("", "-", "None", "none", "_"):
            out.append(None)
        elif "+" in p:
            out.append(tuple(a.strip() for a in p.split("+")))
        else:
            out.append(p)
    return tuple(out)


def parse_tensor_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise MeshError(f"--shard '{text}' is not a shape", "write it as 1024x4096") from None
    if not dims or any(d <= 0 for d in dims):
        raise MeshError(f"--shard '{text}' has a non-positive dimension", "write it as 1024x4096")
    return dims


def shard(plan: MeshPlan, tensor_shape: Sequence[int], spec: Sequence[object]) -> ShardingPlan:
    """How a tensor of `tensor_shape` is split over `plan` by a partition spec (mesh axis names,
    tuples of them, or None per dimension)."""
    return ShardingPlan.build(plan, tuple(tensor_shape), tuple(spec))


@dataclass(frozen=True)
class ShardingPlan:
    """How one tensor is split over a MeshPlan, as torch_xla `mark_sharding` would do it."""

    tensor_shape: tuple[int, ...]
    spec: tuple[object, ...]
    tile_shape: tuple[int, ...]  # number of shards along each tensor dim
    shard_shape: tuple[int, ...]  # ceil(dim / shards)
    replicate: int  # copies of each shard (product of unused mesh axes)
    tile_assignment: tuple[int, ...]  # device ids, row-major over tile_shape (+ replicate)
    hlo: str

    @staticmethod
    def build(plan: MeshPlan, shape: tuple[int, ...], spec: tuple[object, ...]) -> ShardingPlan:
        if len(spec) != len(shape):
            raise MeshError(
                f"spec has {len(spec)} entries but the tensor has {len(shape)} dimensions",
                "give one mesh axis (or None) per tensor dimension",
            )
        used: list[int] = []
        tiles: list[int] = []
        for entry in spec:
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            n = 1
            for a in axes:
                idx = _axis_index(plan, a)
                if idx in used:
                    raise MeshError(f"mesh axis '{plan.axis_names[idx]}' used twice in the spec",
                                    "use each axis at most once")
                used.append(idx)
                n *= plan.shape[idx]
            tiles.append(n)
        unused = [i for i in range(len(plan.shape)) if i not in used]
        replicate = math.prod(plan.shape[i] for i in unused)
        perm = used + unused
        ids = _transpose(plan.device_ids(), plan.shape, perm)
        if replicate > 1:
            # XLA's HloSharding::PartialTile sorts the devices of each replication group;
            # do the same so the string matches what torch_xla reports.
            ids = [d for g in range(0, len(ids), replicate) for d in sorted(ids[g:g + replicate])]
        shard = tuple(-(-d // t) for d, t in zip(shape, tiles, strict=True))
        if math.prod(tiles) == 1:
            hlo = "{replicated}"
        else:
            dims = list(tiles) + ([replicate] if replicate > 1 else [])
            hlo = "{devices=[" + ",".join(map(str, dims)) + "]" + ",".join(map(str, ids))
            hlo += " last_tile_dim_replicate}" if replicate > 1 else "}"
        return ShardingPlan(shape, spec, tuple(tiles), shard, replicate, tuple(ids), hlo)

    def blocks(self) -> list[tuple[tuple[tuple[int, int], ...], list[int]]]:
        """Each distinct block of the tensor (index ranges per dim) and the devices holding it."""
        out = []
        for t in range(math.prod(self.tile_shape)):
            tidx = _unravel(t, self.tile_shape)
            ranges = tuple(
                (min(i * s, d), min((i + 1) * s, d))
                for i, s, d in zip(tidx, self.shard_shape, self.tensor_shape, strict=True)
            )
            devs = list(self.tile_assignment[t * self.replicate:(t + 1) * self.replicate])
            out.append((ranges, devs))
        return out

    def to_dict(self) -> dict:
        return {
            "tensor_shape": list(self.tensor_shape),
            "spec": [list(e) if isinstance(e, tuple) else e for e in self.spec],
            "tile_shape": list(self.tile_shape),
            "shard_shape": list(self.shard_shape),
            "replicas_per_shard": self.replicate,
            "padded": any(s * t != d
                          for s, t, d in zip(self.shard_shape, self.tile_shape, self.tensor_shape, strict=True)),
            "hlo_sharding": self.hlo,
            "blocks": [
                {"index": [list(r) for r in ranges], "devices": devs} for ranges, devs in self.blocks()
            ],
        }


def _axis_index(plan: MeshPlan, axis: object) -> int:
    if isinstance(axis, int) and 0 <= axis < len(plan.shape):
        return axis
    if isinstance(axis, str) and axis in plan.axis_names:
        return plan.axis_names.index(axis)
    raise MeshError(
        f"'{axis}' is not an axis of the mesh",
        f"the axes are {', '.join(plan.axis_names)} (use None or - to replicate a dimension)",
    )


def _transpose(flat: list[int], shape: Sequence[int], perm: Sequence[int]) -> list[int]:
    new_shape = [shape[p] for p in perm]
    out = []
    for k in range(math.prod(shape)):
        new_idx = _unravel(k, new_shape)
        old_idx = [0] * len(shape)
        for j, p in enumerate(perm):
            old_idx[p] = new_idx[j]
        out.append(flat[_ravel(old_idx, shape)])
    return out
