"""Where each position of a slice's (ICI) mesh sits on the torus, and what that costs.

Pure data and arithmetic (numpy): the driver plans the layout from the `Topology` alone.

The cost model (`ring_hops`): for every logical axis, every line of devices along it is walked as
a ring, as a ring all-reduce or all-gather does, the closing step included; the score is the mean
number of ICI hops per ring step. 1.0 means every step goes to a neighbouring chip; two cores of
one chip (v2, v3, v7x) are 0 hops apart. A dimension has wraparound links on 3-D generations when
it spans 4 chips or more, on 2-D generations when it spans 16 or more (the full-pod edges of v2,
v5e and v6e; v3's 32).

The placement rule (`layout`):

1. The slice is a grid of devices `(x, y, z, core)`. Each logical axis is given a share of every
   physical dimension (a factor of its size; the shares of one dimension multiply to it), so a
   dimension can be split between axes where the sizes demand it. Within a split dimension one
   axis holds contiguous chips and the next one strides over them.
2. An axis spread over several factors walks them in the order that makes its ring cheapest:
   row-major (best along wrapped dimensions, as `mesh_utils` does), boustrophedon, or a closed
   Hamiltonian cycle (best on an open grid: a 2x2 or 2x4 block rings at one hop a step).
3. Every such assignment is scored and the best kept: the most network-intensive axis (the
   innermost, by `mesh_utils`' convention) first, then the total over all axes, then the
   remaining axes from the inside out. Ties keep the host-walk layout tpulaunch always had.

Placements (`--placement`):

* `host`: the old rule: hosts in snake order, each host's chips in snake order, the mesh filled
  row-major. Every host's devices are one contiguous block of the flattened mesh.
* `ici`: the best layout by the cost model, nothing else asked of it.
* `auto` (default): `ici`, restricted so that each host's devices hold whole rows of the first
  (batch) axis whenever the other axes fit inside one host. That is what per-host input needs
  (`DistributedSampler(num_replicas=process_count)` with torch_xla's `minibatch=True`, or
  `jax.make_array_from_process_local_data`): no two hosts hold the same batch rows, so each host
  loads a share of its own. When the other axes do not fit in a host, no layout can give that,
  and `auto` is `ici`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from tpulaunch.plan.topology import Topology

if TYPE_CHECKING:
    import numpy as np  # imported where a layout is computed: a host that only unpickles its plan needs none

PLACEMENTS = ("auto", "ici", "host")
_EPS = 1e-9


# -- the physical model -----------------------------------------------------------------------


def wraps(torus_dims: int, chips: int) -> bool:
    """Does a slice dimension of `chips` chips have wraparound links? (see the module docstring)"""
    return chips >= (4 if torus_dims == 3 else 16)


@dataclass(frozen=True)
class Torus:
    """The devices of one slice as a grid `(x, y, z, core)`, and what a step along each costs."""

    dims: tuple[int, int, int, int]
    wrap: tuple[bool, bool, bool, bool]
    block: tuple[int, int, int, int]  # one host's share of each dimension

    @staticmethod
    def of(t: Topology) -> Torus:
        g = t.generation
        dims = (*t.shape, g.devices_per_chip)
        x, y, z = t.shape
        wrap = (wraps(g.torus_dims, x), wraps(g.torus_dims, y), wraps(g.torus_dims, z), False)
        return Torus(dims, wrap, (*t.chips_per_host_bounds, g.devices_per_chip))

    def hops(self, delta: np.ndarray) -> np.ndarray:
        """ICI hops of coordinate differences `delta[..., 4]` (the core difference costs nothing)."""
        import numpy as np

        d = np.abs(delta[..., :3])
        n = np.array(self.dims[:3])
        d = np.where(np.array(self.wrap[:3]), np.minimum(d, n - d), d)
        return d.sum(axis=-1)


def coords_of_ids(t: Topology, ids: np.ndarray) -> np.ndarray:
    """`(x, y, z, core)` of plan device ids (slice-local), as an array with a last axis of 4."""
    import numpy as np

    dpc = t.generation.devices_per_chip
    bx, by, bz = t.chips_per_host_bounds
    hx, hy, _ = t.host_bounds
    worker, local = np.divmod(ids, t.devices_per_host)
    chip, core = np.divmod(local, dpc)
    lx = chip % bx
    ly = (chip // bx) % by
    lz = chip // (bx * by)
    gx = worker % hx
    gy = (worker // hx) % hy
    gz = worker // (hx * hy)
    return np.stack([gx * bx + lx, gy * by + ly, gz * bz + lz, core], axis=-1)


def ids_of_coords(t: Topology, c: np.ndarray) -> np.ndarray:
    """Plan device ids (slice-local) of `(x, y, z, core)` coordinates; the inverse of `coords_of_ids`."""
    dpc = t.generation.devices_per_chip
    bx, by, bz = t.chips_per_host_bounds
    hx, hy, _ = t.host_bounds
    x, y, z, core = c[..., 0], c[..., 1], c[..., 2], c[..., 3]
    worker = x // bx + hx * (y // by + hy * (z // bz))
    local = x % bx + bx * (y % by + by * (z % bz))
    return worker * t.devices_per_host + local * dpc + core


def ring_hops(t: Topology, grid: np.ndarray) -> list[float | None]:
    """Mean ICI hops per ring step along each axis of `grid` (slice-local plan device ids).

    None for an axis of size 1 (it has no ring). This is the score `mesh inspect` prints and the
    tests compare with JAX's `mesh_utils`.
    """
    import numpy as np

    torus = Torus.of(t)
    coords = coords_of_ids(t, np.asarray(grid))
    out: list[float | None] = []
    for axis in range(grid.ndim):
        if grid.shape[axis] == 1:
            out.append(None)
            continue
        delta = np.roll(coords, -1, axis=axis) - coords
        out.append(float(torus.hops(delta).mean()))
    return out


# -- walks over a small grid of factors ---------------------------------------------------------


def snake(bounds: Sequence[int]) -> list[tuple[int, ...]]:
    """Boustrophedon walk over a box, first coordinate fastest: consecutive points are neighbours."""
    return [tuple(int(v) for v in p) for p in _snake_array(bounds)]


def _snake_array(sizes: Sequence[int]) -> np.ndarray:
    """The boustrophedon walk (`snake`) as an array `(prod(sizes), len(sizes))`, first coordinate fastest."""
    import numpy as np

    pts = np.arange(sizes[0], dtype=np.int64)[:, None]
    for n in sizes[1:]:
        blocks = [np.column_stack([pts if j % 2 == 0 else pts[::-1], np.full(len(pts), j)]) for j in range(n)]
        pts = np.concatenate(blocks)
    return pts


def _cycle(first: int, rest: np.ndarray) -> np.ndarray:
    """A closed Hamiltonian walk over `first` x `rest`: `first` even, `rest` a neighbour-path of 2+.

    Row 0 runs the whole path out; the other rows snake back over all but its first point; the
    first point's column brings the walk home.
    """
    import numpy as np

    cols = len(rest)
    rows = [np.zeros(cols, dtype=np.int64)]
    cs = [np.arange(cols)]
    for r in range(1, first):
        cs.append(np.arange(cols - 1, 0, -1) if r % 2 == 1 else np.arange(1, cols))
        rows.append(np.full(cols - 1, r))
    rows.append(np.arange(first - 1, 0, -1))
    cs.append(np.zeros(first - 1, dtype=np.int64))
    row_idx, col_idx = np.concatenate(rows), np.concatenate(cs)
    return np.column_stack([row_idx, rest[col_idx]])


@lru_cache(maxsize=1024)
def _walks(sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Candidate orders of one axis over its factors: arrays `(prod(sizes), len(sizes))`, read-only
    (cached: a search asks for the same few sizes thousands of times)."""
    import numpy as np

    m = len(sizes)
    if m == 1:
        one = np.arange(sizes[0])[:, None]
        one.flags.writeable = False
        return (one,)
    perms = list(itertools.permutations(range(m))) if m <= 3 else [tuple(range(m)), tuple(reversed(range(m)))]
    out = []
    for perm in perms:
        ps = [sizes[p] for p in perm]  # ps[0] slowest
        linear = np.indices(ps).reshape(m, -1).T
        walks = [linear, _snake_array(ps[::-1])[:, ::-1]]
        if ps[0] % 2 == 0:
            walks.append(_cycle(ps[0], _snake_array(ps[:0:-1])[:, ::-1]))
        for w in walks:
            arr = np.empty((len(w), m), dtype=np.int64)
            arr[:, perm] = w
            arr.flags.writeable = False
            out.append(arr)
    return tuple(out)


# -- the search ---------------------------------------------------------------------------------

Factor = tuple[int, int, int]  # (physical dim, stride, size)


@lru_cache(maxsize=4096)
def _best_walk(torus: Torus, factors: tuple[Factor, ...]) -> tuple[float, np.ndarray]:
    """The cheapest walk of one axis over its factors: (hops per ring step, offsets `(n, 4)`)."""
    import numpy as np

    strides = np.zeros((len(factors), 4), dtype=np.int64)
    for f, (dim, stride, _) in enumerate(factors):
        strides[f, dim] = stride
    offsets = np.stack(_walks(tuple(size for _, _, size in factors))) @ strides  # (walks, n, 4)
    scores = torus.hops(np.roll(offsets, -1, axis=1) - offsets).mean(axis=1)
    # the first walk within _EPS of the least (candidates are in order of preference)
    w = int(np.flatnonzero(scores < scores.min() + _EPS)[0])
    return float(scores[w]), offsets[w]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shares(size: int, room: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every way to split `size` over the dimensions: factors dividing each dimension's room."""
    if not room:
        return [()] if size == 1 else []
    out: list[tuple[int, ...]] = []
    for d in _divisors(math.gcd(size, room[0])):
        out.extend((d,) + rest for rest in _shares(size // d, room[1:]))
    return out


@dataclass(frozen=True)
class Layout:
    """A chosen layout of one slice: device ids with the ICI mesh's shape, and its scores."""

    ids: np.ndarray
    hops: tuple[float | None, ...]
    keeps_host_rows: bool  # each host holds whole rows of the first axis (per-host input)


def _key(hops: Sequence[float | None]) -> tuple[float, ...]:
    vals = [h for h in hops if h is not None]
    if not vals:
        return (0.0,)
    inner_out = [round(v, 9) for v in reversed(vals)]
    return (inner_out[0], round(sum(vals), 9), *inner_out[1:])


@lru_cache(maxsize=256)
def _search(torus: Torus, shape: tuple[int, ...], host_rows: bool) -> _Found | None:
    """The best structured assignment of `shape` onto `torus`, and each axis's best score in any."""
    axes = [j for j, n in enumerate(shape) if n > 1]
    if not axes:
        return None
    first = axes[0]
    best: tuple[tuple[float, ...], list] | None = None
    mins: dict[int, float] = {}

    def place(k: int, room: tuple[int, ...], chosen: dict[int, tuple[int, ...]]) -> None:
        nonlocal best
        if k < 0:
            for cand in _orders(chosen):
                key, parts = cand
                if best is None or key < best[0]:
                    best = (key, parts)
            return
        j = axes[k]
        limit = room
        if host_rows and j != first:
            # the other axes stay inside one host's block, so every row of the first is one host's
            limit = tuple(math.gcd(r, b) for r, b in zip(room, _inner_room(torus, chosen), strict=True))
        for share in _shares(shape[j], limit):
            place(k - 1, tuple(r // s for r, s in zip(room, share, strict=True)), {**chosen, j: share})

    def _orders(chosen: dict[int, tuple[int, ...]]):
        per_dim: list[list[list[int]]] = []
        for dim in range(4):
            users = [j for j in axes if chosen[j][dim] > 1]
            if host_rows:
                inner = [j for j in reversed(users) if j != first]
                per_dim.append([inner + [first]] if first in users else [inner] if len(inner) < 2 else
                               [list(p) for p in itertools.permutations(inner)])
            else:
                per_dim.append([list(p) for p in itertools.permutations(reversed(users))] if len(users) <= 3
                               else [list(reversed(users)), users])
        for combo in itertools.product(*per_dim):
            factors: dict[int, list[Factor]] = {j: [] for j in axes}
            for dim, order in enumerate(combo):
                stride = 1
                for j in order:
                    factors[j].append((dim, stride, chosen[j][dim]))
                    stride *= chosen[j][dim]
            parts = []
            hops: list[float | None] = []
            for j in range(len(shape)):
                if j in factors:
                    score, offsets = _best_walk(torus, tuple(factors[j]))
                    parts.append((j, offsets))
                    hops.append(score)
                    mins[j] = min(score, mins.get(j, score))
                else:
                    hops.append(None)
            yield _key(hops), parts

    place(len(axes) - 1, torus.dims, {})
    if best is None:
        return None
    return _Found(best[0], best[1], tuple(mins.get(j) for j in range(len(shape))))


@dataclass(frozen=True)
class _Found:
    key: tuple[float, ...]
    parts: list  # [(axis, offsets (n, 4)), ...]
    mins: tuple[float | None, ...]  # each axis's best score over every assignment searched


def _inner_room(torus: Torus, chosen: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """What is left of one host's block after the axes already placed inside it."""
    used = [math.prod(share[d] for share in chosen.values()) for d in range(4)]
    return tuple(b // math.gcd(b, u) if b % u == 0 else 1 for b, u in zip(torus.block, used, strict=True))


def _assemble(t: Topology, shape: tuple[int, ...], parts: list) -> np.ndarray:
    import numpy as np

    coords = np.zeros(shape + (4,), dtype=np.int64)
    for j, offsets in parts:
        view = [1] * len(shape) + [4]
        view[j] = shape[j]
        coords = coords + offsets.reshape(view)
    return ids_of_coords(t, coords)


def host_walk(t: Topology) -> list[int]:
    """Device ids of one slice in the `host` placement's order (hosts, then chips, in snake order)."""
    dpc = t.generation.devices_per_chip
    block = t.chips_per_host_bounds
    xfast: dict[tuple[int, ...], int] = {(x, y, z): x + block[0] * (y + block[1] * z)
                                         for z in range(block[2]) for y in range(block[1]) for x in range(block[0])}
    order = [tuple(c) for c in snake(block)]
    walk: list[int] = []
    for grid in snake(t.host_bounds):
        base = t.worker_id_of_grid(grid) * t.devices_per_host
        walk.extend(base + xfast[c] * dpc + core for c in order for core in range(dpc))
    return walk


def keeps_host_rows(t: Topology, ids: np.ndarray) -> bool:
    """Does every row of the first axis (all other indices varying) lie on one host?"""
    import numpy as np

    if ids.ndim == 0 or ids.shape[0] == 1:
        return False
    hosts = np.asarray(ids) // t.devices_per_host
    rows = hosts.reshape(ids.shape[0], -1)
    return bool((rows == rows[:, :1]).all())


def host_rows_possible(t: Topology, shape: Sequence[int]) -> bool:
    """Can any layout keep the first axis's rows on single hosts? (the rest must fit in a host)"""
    axes = [n for n in shape if n > 1]
    return bool(axes) and shape[0] > 1 and t.devices_per_host % (math.prod(shape) // shape[0]) == 0


@lru_cache(maxsize=256)
def layout(t: Topology, shape: tuple[int, ...], placement: str = "auto") -> Layout:
    """The device ids (slice-local, with the ICI mesh's `shape`) for a placement; see the docstring."""
    import numpy as np

    walk = np.array(host_walk(t), dtype=np.int64).reshape(shape)
    old = Layout(walk, tuple(ring_hops(t, walk)), keeps_host_rows(t, walk))
    if placement == "host":
        return old
    host_rows = placement == "auto" and host_rows_possible(t, shape)
    found = _search(Torus.of(t), shape, host_rows)
    if found is None or ((old.keeps_host_rows or not host_rows) and _key(old.hops) <= found.key):
        return old
    ids = _assemble(t, shape, found.parts)
    return Layout(ids, tuple(ring_hops(t, ids)), keeps_host_rows(t, ids))


def ideal(t: Topology, shape: tuple[int, ...]) -> tuple[float | None, ...]:
    """Each axis's hops per ring step at best: in the layout that serves that axis alone best."""
    found = _search(Torus.of(t), shape, False)
    walk = layout(t, shape, "host").hops
    if found is None:
        return walk
    # an axis with a best score has a ring (size > 1), so a score in the `host` layout too
    return tuple(None if m is None or w is None else min(m, w) for m, w in zip(found.mins, walk, strict=True))
