"""`MeshPlan` (tpulaunch/plan/mesh.py) and `ShardingPlan` (tpulaunch/plan/sharding.py): pure data, planned from a Topology alone."""

from __future__ import annotations

import itertools
import json
import math
import pickle

import pytest

from tpulaunch.plan import mesh as M
from tpulaunch.plan import sharding as S
from tpulaunch.plan import topology as T
from tpulaunch.errors import MeshError


def topo(spec: str, gen: str | None = None, **kw) -> T.Topology:
    if gen:
        return T.resolve(topology=spec, accelerator=gen, **kw)
    return T.resolve(spec, **kw)


# -- pure data ------------------------------------------------------------------------------------


LARGEST = [("16x16x24", "v5p"), ("12x12x16", "v4"), ("8x16x16", "v7x"), ("32x32", "v3"), ("16x16", "v6e")]


@pytest.mark.parametrize("shape, gen", LARGEST)
def test_plan_pickles_small_even_for_the_largest_pods(shape, gen):
    t = topo(shape, gen)
    slices = 1 if gen == "v3" else 4  # Cloud TPU Multislice is v4 and later
    plan = M.plan_mesh(t, num_slices=slices)
    cold = pickle.dumps(plan)
    ids = plan.device_ids()  # fills the cached grid
    assert len(ids) == t.devices * slices
    blob = pickle.dumps(plan)
    assert len(blob) == len(cold) < 4096, len(blob)
    back = pickle.loads(blob)
    assert back == plan
    assert back.device_ids() == ids


# -- default meshes -------------------------------------------------------------------------------

SINGLE_HOST = [("v2-8", None), ("v3-8", None), ("v4-8", None), ("v5litepod-1", None), ("v5litepod-8", None),
               ("v5p-8", None), ("v6e-4", None), ("v6e-8", None), ("tpu7x-8", None)]
MULTI_HOST = [("v2-32", None), ("v3-64", None), ("v4-16", None), ("v4-32", None), ("v4-128", None),
              ("v5litepod-16", None), ("2x8", "v5e"), ("v5p-32", None), ("v5p-128", None), ("v6e-16", None),
              ("v6e-32", None), ("2x4", "v6e"), ("tpu7x-16", None), ("tpu7x-64", None)]


def _multi(spec, gen):
    # ("2x4", "v6e") means the two-VM (GKE) form of a v6e 2x4
    return topo(spec, gen, chips_per_host=4) if spec == "2x4" else topo(spec, gen)


@pytest.mark.parametrize("spec, gen", SINGLE_HOST)
def test_default_mesh_one_host_is_1d_data(spec, gen):
    t = topo(spec, gen)
    assert t.num_hosts == 1
    plan = M.plan_mesh(t)
    assert plan.axis_names == ("data",)
    assert plan.shape == (t.devices,)
    assert sorted(plan.device_ids()) == list(range(t.devices))


@pytest.mark.parametrize("spec, gen", MULTI_HOST)
@pytest.mark.parametrize("num_slices", [1, 2])
def test_default_mesh_several_hosts_is_hosts_by_devices(spec, gen, num_slices):
    t = _multi(spec, gen)
    assert t.num_hosts > 1
    if num_slices > 1 and t.generation.name in ("v2", "v3"):
        with pytest.raises(MeshError, match="Multislice is v4 and later"):
            M.plan_mesh(t, num_slices=num_slices)
        return
    plan = M.plan_mesh(t, num_slices=num_slices)
    assert plan.axis_names == ("data", "model")
    assert plan.shape == (t.num_hosts * num_slices, t.devices_per_host)
    assert plan.num_processes == t.num_hosts * num_slices
    grid = plan.grid()
    assert sorted(itertools.chain.from_iterable(grid)) == list(range(plan.num_devices))
    row_process = []
    for ids in grid:
        # each row is exactly one host's devices
        (p,) = {plan.device(d).process for d in ids}
        assert sorted(ids) == plan.process_device_ids(p)
        row_process.append(p)
    assert sorted(row_process) == list(range(plan.num_processes))
    assert plan.layout().keeps_host_rows  # each row one host: per-host input loads one share per host
    # slices outermost
    assert [p // t.num_hosts for p in row_process] == sorted(p // t.num_hosts for p in row_process)
    # with placement=host the rows follow the torus walk: the hosts in snake order over the host grid
    walk = M.plan_mesh(t, num_slices=num_slices, placement="host")
    snake = [t.worker_id_of_grid(g) for g in M.snake(t.host_bounds)]
    assert [walk.device(row[0]).process for row in walk.grid()] == [
        s * t.num_hosts + w for s in range(num_slices) for w in snake]


# -- explicit meshes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh, names, shape",
    [
        ("data=4,model=4", ("data", "model"), (4, 4)),
        ("data=-1,model=4", ("data", "model"), (4, 4)),
        ("data=2,model=-1", ("data", "model"), (2, 8)),
        ("x=16", ("x",), (16,)),
        ("x=-1", ("x",), (16,)),
        ("a=2,b=2,c=4", ("a", "b", "c"), (2, 2, 4)),
        ("a=2,b=-1,c=2,d=2", ("a", "b", "c", "d"), (2, 2, 2, 2)),
        ("a=1,b=1,c=16,d=1,e=1", ("a", "b", "c", "d", "e"), (1, 1, 16, 1, 1)),
        (" data = 8 , model=2 ", ("data", "model"), (8, 2)),
    ],
)
def test_explicit_mesh(mesh, names, shape):
    plan = M.plan_mesh(topo("v4-32"), mesh)
    assert plan.axis_names == names
    assert plan.shape == plan.ici_shape == shape
    assert plan.dcn_shape == (1,) * len(shape)
    assert sorted(plan.device_ids()) == list(range(16))
    assert all(plan.axis_size(n) == s for n, s in zip(names, shape))
    for pos, dev in plan.iter_positions():
        assert plan.position_of(dev.id) == pos


def test_explicit_mesh_as_tuples():
    plan = M.plan_mesh(topo("v4-32"), (("data", -1), ("model", 2)))
    assert plan.shape == (8, 2)


@pytest.mark.parametrize(
    "mesh, words",
    [
        ("data=3,model=-1", ["not divisible by 3", "16"]),  # non-factoring with -1
        ("data=3,model=5", ["15", "16"]),  # non-factoring
        ("data=4,model=8", ["32", "16"]),
        ("data=4,data=4", ["'data' twice"]),  # duplicate names
        ("data=-1,model=-1", ["more than one -1"]),
        ("data=0,model=16", ["size 0"]),
        ("data=-2,model=-8", ["size -2"]),
        ("data=x", ["not an integer"]),
        ("data:4", ["NAME=SIZE"]),
        ("4", ["NAME=SIZE"]),
        ("1abc=16", ["NAME=SIZE"]),
        (",", ["empty"]),
    ],
)
def test_bad_mesh_is_a_clear_error(mesh, words):
    with pytest.raises(MeshError) as ei:
        M.plan_mesh(topo("v4-32"), mesh)
    line = ei.value.line()
    assert "\n" not in line
    for w in words:
        assert w in line, (w, line)


def test_duplicate_axis_names_as_tuples():
    with pytest.raises(MeshError, match="repeat"):
        M.plan_mesh(topo("v4-32"), (("a", 4), ("a", 4)))


# -- multislice (DCN) -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, mesh, dcn, num_slices, names, ici, dcn_shape",
    [
        ("v4-32", "data=4,model=4", "data=2", None, ("data", "model"), (4, 4), (2, 1)),
        ("v4-32", "data=4,model=4", "data=2,model=2", None, ("data", "model"), (4, 4), (2, 2)),
        ("v4-32", "data=4,model=4", "model=-1", 3, ("data", "model"), (4, 4), (1, 3)),
        ("v4-32", "data=4,model=4", "replica=2", None, ("replica", "data", "model"), (1, 4, 4), (2, 1, 1)),
        ("v4-32", "data=4,model=4", None, 2, ("data", "model"), (4, 4), (2, 1)),
        ("v6e-8", None, "data=4", None, ("data",), (8,), (4,)),
        ("tpu7x-16", "a=2,b=2,c=4", "c=2,a=2", None, ("a", "b", "c"), (2, 2, 4), (2, 1, 2)),
        ("v5litepod-16", None, "pp=2,dp=2", None, ("pp", "dp", "data", "model"), (1, 1, 4, 4), (2, 2, 1, 1)),
    ],
)
def test_dcn_shapes(spec, mesh, dcn, num_slices, names, ici, dcn_shape):
    t = topo(spec)
    plan = M.plan_mesh(t, mesh, dcn, num_slices)
    assert plan.axis_names == names
    assert plan.ici_shape == ici
    assert plan.dcn_shape == dcn_shape
    assert plan.shape == tuple(i * d for i, d in zip(ici, dcn_shape))
    assert plan.num_slices == math.prod(dcn_shape)
    assert plan.num_devices == t.devices * plan.num_slices
    assert sorted(plan.device_ids()) == list(range(plan.num_devices))
    _check_slice_placement(plan)


def _check_slice_placement(plan: M.MeshPlan) -> None:
    """Rule 3: slice s holds the block at row-major position s of the DCN shape, and inside it
    the devices sit exactly where the single-slice plan puts them (index = dcn * ici + ici_index)."""
    one = M.MeshPlan(plan.topology, plan.axis_names, plan.ici_shape, (1,) * len(plan.ici_shape), 1)
    per_slice = plan.topology.devices
    for pos, dev in plan.iter_positions():
        dcn_idx = tuple(p // i for p, i in zip(pos, plan.ici_shape))
        ici_idx = tuple(p % i for p, i in zip(pos, plan.ici_shape))
        assert dev.slice == M._ravel(dcn_idx, plan.dcn_shape)
        assert one.position_of(dev.id - dev.slice * per_slice) == ici_idx


@pytest.mark.parametrize(
    "mesh, dcn, num_slices, words",
    [
        ("data=4,model=4", "data=2", 3, ["2", "3"]),  # dcn does not match the number of slices
        ("data=4,model=4", "data=2,model=2", 2, ["4", "2"]),
        ("data=4,model=4", "data=3,model=-1", 4, ["not divisible by 3"]),
        ("data=4,model=4", "data=-1", None, ["--num-slices"]),
        ("data=4,model=4", "data=-1,model=-1", 4, ["more than one -1"]),
        ("data=4,model=4", "data=2,data=2", None, ["'data' twice"]),
        (None, None, 0, ["--num-slices 0"]),
    ],
)
def test_bad_dcn_is_a_clear_error(mesh, dcn, num_slices, words):
    with pytest.raises(MeshError) as ei:
        M.plan_mesh(topo("v4-32"), mesh, dcn, num_slices)
    for w in words:
        assert w in ei.value.line(), (w, ei.value.line())


# -- device ids and the placement rule --------------------------------------------------------------


@pytest.mark.parametrize("spec", ["v4-32", "tpu7x-16", "v2-32", "v6e-16", "v5litepod-8"])
def test_device_id_rule(spec):
    """id = slice * devices_per_slice + worker * devices_per_host + local (chips x-fastest, cores inner)."""
    t = topo(spec)
    plan = M.plan_mesh(t, num_slices=1 if t.generation.name == "v2" else 2)  # multislice: v4 and later
    dpc = t.generation.devices_per_chip
    for dev_id in range(plan.num_devices):
        d = plan.device(dev_id)
        local = t.host_chips(d.worker_id).index(d.chip) * dpc + d.core
        assert dev_id == d.slice * t.devices + d.worker_id * t.devices_per_host + local
        assert d.process == d.slice * t.num_hosts + d.worker_id
        assert dev_id in plan.process_device_ids(d.process)
        assert 0 <= d.core < dpc


def test_snake_walks_neighbours():
    for bounds in [(2, 2, 1), (2, 4, 1), (4, 4, 4), (3, 5, 2), (1, 1, 6)]:
        walk = M.snake(bounds)
        assert set(walk) == {(x, y, z) for x in range(bounds[0]) for y in range(bounds[1]) for z in range(bounds[2])}
        assert len(walk) == math.prod(bounds)
        for a, b in zip(walk, walk[1:]):
            assert sum(abs(i - j) for i, j in zip(a, b)) == 1, (bounds, a, b)


def _torus_distance(a, b, shape) -> int:
    return sum(min(abs(i - j), n - abs(i - j)) for i, j, n in zip(a, b, shape))


def _shapes_for_neighbour_check():
    out = []
    for g in T.GENERATIONS.values():
        for s in sorted(set(g.listed_shapes) | set(g.canonical_shapes()[:12])):
            t = T.make_topology(g, T.parse_shape(s))
            if t.chips <= 512:
                out.append(pytest.param(g.name, s, id=f"{g.name}-{s}"))
    return out


def _check_inner_axis_neighbours(plan: M.MeshPlan) -> int:
    """Along the innermost axis, consecutive positions on one host are torus neighbours
    (or the same chip, other core). Returns how many pairs were checked."""
    shape = plan.topology.shape
    n = plan.shape[-1]
    flat = plan.device_ids()
    checked = 0
    for row in range(0, len(flat), n):
        for a, b in zip(flat[row:row + n], flat[row + 1:row + n]):
            da, db = plan.device(a), plan.device(b)
            if da.process != db.process:
                continue
            dist = _torus_distance(da.chip, db.chip, shape)
            if dist == 0:
                assert da.core != db.core, (da, db)
            else:
                assert dist == 1, (plan.topology.topology, da, db)
            checked += 1
    return checked


@pytest.mark.parametrize("gen, shape", _shapes_for_neighbour_check())
def test_host_placement_steps_between_torus_neighbours(gen, shape):
    """The `host` placement (the rule before `auto`): hosts in snake order, each a contiguous block."""
    g = T.GENERATIONS[gen]
    t = T.make_topology(g, T.parse_shape(shape))
    plans = [M.plan_mesh(t, placement="host"), M.plan_mesh(t, f"x={t.devices}", placement="host")]
    if t.devices % 2 == 0 and t.devices > 2:
        plans.append(M.plan_mesh(t, "a=2,b=-1", placement="host"))
    if t.devices_per_host % 2 == 0:
        plans.append(M.plan_mesh(t, f"a=-1,b={t.devices_per_host // 2}", placement="host"))
    total = sum(_check_inner_axis_neighbours(p) for p in plans)
    assert total > 0 or t.devices == 1
    # rule 2: every aligned block of devices_per_host positions of the 1D mesh is one host
    flat = plans[1].device_ids()
    per_host = t.devices_per_host
    for start in range(0, len(flat), per_host):
        assert len({plans[1].device(d).process for d in flat[start:start + per_host]}) == 1


@pytest.mark.parametrize("spec, gen, cph", [("2x4", "v6e", 4), ("2x4", "v5e", 4), ("2x4", "v5e", None)])
def test_neighbour_rule_on_two_vm_and_single_vm_2x4(spec, gen, cph):
    t = topo(spec, gen, chips_per_host=cph)
    plan = M.plan_mesh(t, "x=8", placement="host")
    assert _check_inner_axis_neighbours(plan) == 8 - t.num_hosts


def test_default_v4_32_grid():
    plan = M.plan_mesh(topo("v4-32"))
    assert plan.grid() == [[0, 1, 3, 2], [4, 5, 7, 6], [8, 9, 11, 10], [12, 13, 15, 14]]
    assert [plan.device(d).chip for d in plan.grid()[0]] == [(0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 1, 0)]


def test_default_tpu7x_grid_keeps_cores_of_a_chip_together():
    plan = M.plan_mesh(topo("tpu7x-16"))
    assert plan.shape == (2, 8)
    row = [plan.device(d) for d in plan.grid()[0]]
    assert [(d.chip[:2], d.core) for d in row] == [
        ((0, 0), 0), ((0, 0), 1), ((1, 0), 0), ((1, 0), 1), ((1, 1), 0), ((1, 1), 1), ((0, 1), 0), ((0, 1), 1),
    ]


# -- sharding of a tensor -------------------------------------------------------------------------


def test_sharding_full_2d():
    plan = M.plan_mesh(topo("2x8"))  # v6e 2x8: 4 hosts of 4
    s = S.shard(plan, (1024, 4096), ("data", "model"))
    assert s.tile_shape == (4, 4)
    assert s.shard_shape == (256, 1024)
    assert s.replicate == 1
    assert s.hlo == "{devices=[4,4]0,1,3,2,4,5,7,6,8,9,11,10,12,13,15,14}"


def test_sharding_partial_replication_sorts_each_group():
    plan = M.plan_mesh(topo("2x8"))
    s = S.shard(plan, (1024, 4096), ("data", None))
    assert s.shard_shape == (256, 4096) and s.replicate == 4
    assert s.hlo == "{devices=[4,1,4]0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 last_tile_dim_replicate}"
    s = S.shard(plan, (8, 8), (None, "model"))
    assert s.hlo == "{devices=[1,4,4]0,4,8,12,1,5,9,13,3,7,11,15,2,6,10,14 last_tile_dim_replicate}"


def test_sharding_replicated_and_tuple_specs():
    plan = M.plan_mesh(topo("2x8"))
    assert S.shard(plan, (8, 8), (None, None)).hlo == "{replicated}"
    s = S.shard(plan, (64, 3), (("data", "model"), None))
    assert s.tile_shape == (16, 1) and s.shard_shape == (4, 3)
    assert s.hlo == "{devices=[16,1]" + ",".join(map(str, plan.device_ids())) + "}"
    s = S.shard(plan, (64, 3), (("model", "data"), None))
    assert s.hlo == "{devices=[16,1]0,4,8,12,1,5,9,13,3,7,11,15,2,6,10,14}"
    # axes by index work too
    assert S.shard(plan, (8, 8), (0, 1)).hlo == S.shard(plan, (8, 8), ("data", "model")).hlo


@pytest.mark.parametrize(
    "spec, tensor, pspec",
    [
        ("v4-32", (10, 6), ("data", "model")),  # padded: 10 over 4, 6 over 4
        ("v4-32", (5, 7), ("model", None)),
        ("tpu7x-16", (16, 16, 3), ("data", None, None)),
        ("v6e-16", (7,), (("data", "model"),)),
        ("v2-32", (32, 32), ("model", "data")),
    ],
)
def test_sharding_blocks_cover_the_tensor_once_and_every_device_once(spec, tensor, pspec):
    plan = M.plan_mesh(topo(spec))
    s = S.shard(plan, tensor, pspec)
    blocks = s.blocks()
    assert len(blocks) == math.prod(s.tile_shape)
    devices = [d for _, devs in blocks for d in devs]
    assert sorted(devices) == list(range(plan.num_devices))
    assert all(len(devs) == s.replicate for _, devs in blocks)
    covered = 0
    for ranges, _ in blocks:
        for (a, b), d, sh in zip(ranges, tensor, s.shard_shape):
            assert 0 <= a <= b <= d and b - a <= sh
        covered += math.prod(b - a for a, b in ranges)
    assert covered == math.prod(tensor)
    doc = s.to_dict()
    assert doc["padded"] == any(sh * t != d for sh, t, d in zip(s.shard_shape, s.tile_shape, tensor))
    assert doc["hlo_sharding"] == s.hlo


def test_sharding_on_a_multislice_mesh():
    plan = M.plan_mesh(topo("v6e-8"), "data=2,model=4", "data=2")
    s = S.shard(plan, (16, 16), ("data", "model"))
    assert s.tile_shape == (4, 4)
    # slice 0 holds the first two row-blocks, slice 1 the last two
    rows = [devs[0] // 8 for _, devs in s.blocks()]
    assert rows == [0] * 8 + [1] * 8


@pytest.mark.parametrize(
    "tensor, pspec, words",
    [
        ((8, 8), ("data",), ["1 entries", "2 dimensions"]),
        ((8, 8), ("data", "data"), ["'data' used twice"]),
        ((8, 8), (("data", "model"), "model"), ["'model' used twice"]),
        ((8, 8), ("nope", None), ["'nope'", "data, model"]),
        ((8, 8), (5, None), ["'5'"]),
    ],
)
def test_bad_sharding_is_a_clear_error(tensor, pspec, words):
    plan = M.plan_mesh(topo("2x8"))
    with pytest.raises(MeshError) as ei:
        S.shard(plan, tensor, pspec)
    for w in words:
        assert w in ei.value.line()


def test_parse_spec_and_tensor_shape():
    assert S.parse_spec("data,model") == ("data", "model")
    assert S.parse_spec("data+model,None") == (("data", "model"), None)
    assert S.parse_spec("-, model,_,none,") == (None, "model", None, None, None)
    assert S.parse_tensor_shape("1024x4096") == (1024, 4096)
    assert S.parse_tensor_shape("7") == (7,)
    for bad in ("1024x", "ax4", "0x4", "-1x4"):
        with pytest.raises(MeshError):
            S.parse_tensor_shape(bad)


def test_to_dict_schema():
    plan = M.plan_mesh(topo("v4-32"), "data=4,model=4", "data=2")
    d = plan.to_dict()
    assert d["schema"] == "tpulaunch.mesh/v1"
    assert (d["shape"], d["ici_shape"], d["dcn_shape"], d["num_slices"], d["num_devices"], d["num_processes"]) == (
        [8, 4], [4, 4], [2, 1], 2, 32, 8,
    )
    assert d["grid"] == plan.grid()
    assert [x["id"] for x in d["devices"]] == list(range(32))
    for x in d["devices"]:
        assert plan.grid()[x["position"][0]][x["position"][1]] == x["id"]
    assert d["processes"][5] == {"process": 5, "slice": 1, "worker_id": 1, "device_ids": [20, 21, 22, 23]}
    json.dumps(d)
    assert "devices" not in plan.to_dict(devices=False)
