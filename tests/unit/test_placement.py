"""The mesh's placement on the torus (tpulaunch/plan/placement.py), checked against JAX's own `mesh_utils`.

Devices are built with the chip coordinates, cores and worker order a slice reports (the order
`jax.devices()` gives on a TPU: by process, then chips x-fastest, cores innermost) and handed to
`jax._src.mesh_utils.create_device_mesh` / `create_hybrid_device_mesh`; both layouts are scored
with one cost model (ICI hops per ring step, per axis). Ours must be no worse: the innermost
(most network-intensive) axis first, and where that ties, the total over all axes.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from mesh_utils_ref import hybrid, jax_ids, no_worse
from tpulaunch.errors import MeshError
from tpulaunch.plan import catalog as C
from tpulaunch.plan import mesh as M
from tpulaunch.plan import placement as P
from tpulaunch.plan import topology as T


# -- the cost model, against a brute-force reading of its definition --------------------------


def brute_hops(t: T.Topology, grid: np.ndarray) -> list[float | None]:
    """Every line along every axis walked as a ring (closure included), hops counted chip by chip."""
    plan = M.plan_mesh(t, "x=-1")  # only for `device(id)`: coordinates from the topology's own rule
    dims = t.shape
    wrap = [T.GENERATIONS[t.generation.name].torus_dims == 3 and n >= 4 or
            T.GENERATIONS[t.generation.name].torus_dims == 2 and n >= 16 for n in dims]
    out = []
    for axis in range(grid.ndim):
        n = grid.shape[axis]
        if n == 1:
            out.append(None)
            continue
        steps = []
        for line in np.moveaxis(grid, axis, -1).reshape(-1, n):
            for a, b in zip(line, np.roll(line, -1)):
                ca, cb = plan.device(int(a)).chip, plan.device(int(b)).chip
                steps.append(sum(min(abs(i - j), d - abs(i - j)) if w else abs(i - j)
                                 for i, j, d, w in zip(ca, cb, dims, wrap)))
        out.append(sum(steps) / len(steps))
    return out


@pytest.mark.parametrize("spec, mesh", [("v6e-256", "data=16,model=16"), ("v4-128", "data=4,fsdp=4,model=4"),
                                        ("v5litepod-64", "data=8,model=8"), ("tpu7x-32", "data=4,model=8"),
                                        ("v3-32", None), ("v6e-16", None), ("v4-32", "a=2,b=2,c=4")])
@pytest.mark.parametrize("placement", P.PLACEMENTS)
def test_ring_hops_is_the_cost_model(spec, mesh, placement):
    plan = M.plan_mesh(T.resolve(spec), mesh, placement=placement)
    grid = plan.layout().ids
    assert P.ring_hops(plan.topology, grid) == pytest.approx(brute_hops(plan.topology, grid))
    assert [c["hops"] for c in plan.cost()] == pytest.approx(brute_hops(plan.topology, grid), abs=1e-4)


def test_wraparound_rule():
    # 3-D generations wrap at 4 chips and more; 2-D generations at 16 (v5e/v6e/v2 pods; v3's 32)
    assert [P.wraps(3, n) for n in (2, 4, 8)] == [False, True, True]
    assert [P.wraps(2, n) for n in (4, 8, 16, 32)] == [False, False, True, True]


def test_the_issue_table_for_the_old_rule_and_the_new():
    """The scores of the rule before `auto` (now `--placement host`), as the issue measured them."""
    table = [  # spec, mesh, host (old), auto
        ("v6e-256", "data=16,model=16", [7.0, 1.75], [1.0, 1.0]),
        ("v5litepod-64", "data=8,model=8", [4.5, 1.5], [2.5, 1.0]),
        ("v4-128", "data=4,model=16", [3.0, 1.25], [1.0, 1.0]),
        ("v4-128", "data=4,fsdp=4,model=4", [3.0, 2.0, 1.0], [1.0, 1.0, 1.0]),
        ("v4-64", "data=4,model=8", [3.0, 1.0], [1.0, 1.0]),
        ("v4-32", None, [1.0, 1.0], [1.0, 1.0]),
        ("v6e-16", None, [2.0, 1.0], [2.0, 1.0]),
    ]
    for spec, mesh, old, new in table:
        t = T.resolve(spec)
        assert [c["hops"] for c in M.plan_mesh(t, mesh, placement="host").cost()] == old, spec
        assert [c["hops"] for c in M.plan_mesh(t, mesh).cost()] == new, spec


# -- the golden table: ours beside mesh_utils ---------------------------------------------------

GOLDEN = [  # spec, mesh, ours (auto), mesh_utils' (None: it refuses without splitting axes)
    ("v6e-256", "data=16,model=16", [1.0, 1.0], [1.0, 1.0]),
    ("v6e-256", None, [2.0, 1.0], None),
    ("v5litepod-64", "data=8,model=8", [2.5, 1.0], [1.75, 1.75]),
    ("v5litepod-16", None, [2.0, 1.0], [1.5, 1.5]),
    ("v5litepod-16", "data=8,model=2", [1.25, 1.0], None),
    ("v4-128", "data=4,model=16", [1.0, 1.0], [1.0, 1.25]),
    ("v4-128", "data=4,fsdp=4,model=4", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),
    ("v4-128", None, [1.25, 1.0], [1.25, 1.0]),
    ("v4-64", "data=4,model=8", [1.0, 1.0], [1.0, 1.25]),
    ("v4-32", None, [1.0, 1.0], [1.0, 1.5]),
    ("v4-32", "data=8,model=2", [1.0, 1.0], [1.25, 1.0]),
    ("v5p-128", "data=8,model=8", [1.25, 1.0], None),
    ("v5p-256", "data=2,fsdp=8,model=8", [1.0, 1.25, 1.0], None),
    ("v5p-16", None, [1.0, 1.0], [2.0, 1.0]),
    ("v6e-16", None, [2.0, 1.0], [1.5, 1.5]),
    ("v6e-8", None, [1.0], [1.5]),
    ("v2-32", None, [2.0, 0.5], [3.0, 0.5]),
    ("v3-64", "data=8,model=8", [2.0, 0.5], [3.5, 0.5]),
    ("tpu7x-16", None, [1.0, 0.5], [1.0, 0.5]),
    ("tpu7x-128", "data=16,model=8", [1.25, 0.5], [1.25, 0.5]),
    ("tpu7x-128", "data=8,fsdp=4,model=4", [1.25, 1.0, 0.5], [0.5, 1.0, 1.0]),
]


@pytest.mark.parametrize("spec, mesh, ours, theirs", GOLDEN, ids=[f"{g[0]}-{g[1]}" for g in GOLDEN])
def test_golden_scores_beside_mesh_utils(spec, mesh, ours, theirs):
    plan = M.plan_mesh(T.resolve(spec), mesh)
    got = [c["hops"] for c in plan.cost()]
    assert got == ours
    ref = jax_ids(plan.topology, plan.shape)
    if theirs is None:
        assert ref is None  # mesh_utils refuses it without splitting physical axes
        return
    assert ref is not None
    assert [round(h, 4) for h in P.ring_hops(plan.topology, ref)] == theirs
    assert no_worse(got, theirs)


# -- every generation in the catalog, a table of meshes ----------------------------------------


def _meshes(t: T.Topology) -> list[tuple[int, ...]]:
    n = t.devices
    out = [(t.num_hosts, t.devices_per_host) if t.num_hosts > 1 else (n,)]
    out += [(n // m, m) for m in (2, 4, 8, 16) if n % m == 0 and n // m > 1]  # data x model
    out += [(n // (f * m), f, m) for f in (2, 4, 8) for m in (2, 4)  # data x fsdp x model
            if n % (f * m) == 0 and n // (f * m) > 1]
    return list(dict.fromkeys(out))


def _catalog(max_devices: int) -> list:
    out = []
    for g in C.GENERATIONS.values():
        for shape in dict.fromkeys(g.listed_shapes + tuple(g.canonical_shapes())):
            t = T.make_topology(g, C._dims(shape))
            if 1 < t.devices <= max_devices:
                out.append(pytest.param(t, id=f"{g.name}-{shape}"))
    return out


@pytest.mark.parametrize("t", _catalog(1024))
def test_no_worse_than_mesh_utils_on_every_catalog_slice(t):
    compared = 0
    for shape in _meshes(t):
        ids = ",".join(f"a{i}={n}" for i, n in enumerate(shape))
        ours = M.plan_mesh(t, ids).cost()
        hops = [c["hops"] for c in ours]
        for kw in ({}, {"allow_split_physical_axes": True}):
            ref = jax_ids(t, shape, **kw)
            if ref is None:
                continue
            theirs = P.ring_hops(t, ref)
            if all(h is None for h in theirs):
                continue
            assert no_worse(hops, theirs), (t.accelerator_type, shape, kw, hops, theirs)
            compared += 1
    assert compared or t.num_hosts == 1


@pytest.mark.parametrize("spec, mesh, dcn", [("v4-32", "data=4,model=4", "data=2"), ("v6e-16", None, "data=4"),
                                             ("v5p-128", "data=8,model=8", "model=2"),
                                             ("tpu7x-32", "data=4,model=8", "replica=2,data=2")])
def test_multislice_matches_the_hybrid_mesh_and_scores_no_worse(spec, mesh, dcn):
    t = T.resolve(spec)
    plan = M.plan_mesh(t, mesh, dcn)
    ref = hybrid(t, plan.ici_shape, plan.dcn_shape, plan.num_slices)
    slice_of = np.vectorize(lambda d: d.slice_index)(ref)
    grid = np.array(plan.device_ids()).reshape(plan.shape)
    # the same slice at every position: DCN axes outermost, slices in row-major order of the DCN shape
    assert (grid // t.devices == slice_of).all()
    # every slice laid out alike, and no worse than mesh_utils' per-slice mesh
    first = tuple(slice(0, n) for n in plan.ici_shape)
    local = grid % t.devices
    for s in range(plan.num_slices):
        block = tuple(slice(i * n, (i + 1) * n) for i, n in zip(np.unravel_index(s, plan.dcn_shape), plan.ici_shape))
        assert (local[block] == local[first]).all()
    theirs = P.ring_hops(t, np.vectorize(lambda d: d.id % t.devices)(ref[first]))
    assert no_worse([c["hops"] for c in plan.cost()], theirs)


# -- placements and per-host input ----------------------------------------------------------------


@pytest.mark.parametrize("t", _catalog(512))
def test_auto_keeps_each_hosts_rows_of_the_first_axis_whenever_it_can(t):
    for shape in _meshes(t):
        spec = ",".join(f"a{i}={n}" for i, n in enumerate(shape))
        plan = M.plan_mesh(t, spec)
        ids = np.array(plan.device_ids()).reshape(shape)
        assert sorted(ids.flat) == list(range(t.devices))  # a layout is a permutation of the slice
        hosts = ids // t.devices_per_host
        rows_on_one_host = bool((hosts.reshape(shape[0], -1) == hosts.reshape(shape[0], -1)[:, :1]).all())
        assert plan.layout().keeps_host_rows == rows_on_one_host
        assert rows_on_one_host == P.host_rows_possible(t, shape), (t.accelerator_type, shape)
        ici = M.plan_mesh(t, spec, placement="ici")
        # `ici` asks nothing else of the layout: never worse than auto on the model's terms
        assert P._key(ici.layout().hops) <= P._key(plan.layout().hops)


def test_host_placement_is_the_walk_and_auto_never_loses_to_it():
    for t in (T.resolve("v6e-256"), T.resolve("v4-128"), T.resolve("tpu7x-64"), T.resolve("v3-64")):
        for shape in _meshes(t):
            spec = ",".join(f"a{i}={n}" for i, n in enumerate(shape))
            host = M.plan_mesh(t, spec, placement="host")
            assert host.device_ids() == P.host_walk(t)
            auto = M.plan_mesh(t, spec)
            if auto.device_ids() != host.device_ids():
                assert P._key(auto.layout().hops) < P._key(host.layout().hops)


def test_ties_keep_the_old_layout():
    """Where the walk is already best, nothing moves (runs on the slices people use keep their order)."""
    for spec in ("2x8", "v4-16", "v4-32", "tpu7x-16", "v2-8"):
        t = T.resolve(spec)
        assert M.plan_mesh(t).device_ids() == M.plan_mesh(t, placement="host").device_ids(), spec


def test_a_bad_placement_is_one_line():
    with pytest.raises(MeshError) as e:
        M.plan_mesh(T.resolve("v4-32"), placement="nearest")
    assert e.value.line() == "--placement 'nearest' is not a placement. use one of auto, ici, host"


def test_plan_pickles_with_its_placement_and_gives_the_same_grid():
    import pickle

    plan = M.plan_mesh(T.resolve("v6e-256"), "data=16,model=16", placement="ici")
    ids = plan.device_ids()
    back = pickle.loads(pickle.dumps(plan))
    assert back.placement == "ici" and back.device_ids() == ids


def test_the_largest_pods_plan_fast_enough_to_inspect():
    """No timing here (the suite never times): the search stays small, as counted by its walks."""
    P._best_walk.cache_clear()
    t = T.resolve("tpu7x-18432")
    plan = M.plan_mesh(t)
    assert len(plan.device_ids()) == t.devices
    assert P._best_walk.cache_info().currsize < 1000
    assert all(len(w) == math.prod(s) for s in itertools.islice(itertools.product((2, 3), repeat=3), 4)
               for w in P._walks(s))
