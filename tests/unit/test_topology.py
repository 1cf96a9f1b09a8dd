"""The TPU generation catalog and `Topology` (tpulaunch/topology.py): pure, in-process."""

from __future__ import annotations

import math
import pickle

import pytest
import ray._private.accelerators.tpu as ray_tpu

from tpulaunch.errors import TopologyError
from tpulaunch.plan import topology as T

ALL_GENS = list(T.GENERATIONS)


def shapes_to_check(g, max_chips: int = 4096) -> list[str]:
    """A generation's listed shapes, the canonical shape of every size, and Ray's table for it."""
    ray = next((set(v) for k, v in ray_tpu.VALID_TPU_TOPOLOGY.items() if T.generation(k) is g), set())
    shapes = set(g.listed_shapes) | set(g.canonical_shapes()) | ray
    return sorted(s for s in shapes if math.prod(T.parse_shape(s)) <= max_chips)

# -- the catalog ----------------------------------------------------------------------------------

# name: (type prefix, TensorCores/chip, devices/chip, suffix counts, torus dims, chips per VM)
# From /work/shared/notes/launchers.md section C and ray_tpu.md section 3.
CATALOG = {
    "v2": ("v2", 2, 2, "cores", 2, 4),
    "v3": ("v3", 2, 2, "cores", 2, 4),
    "v4": ("v4", 2, 1, "cores", 3, 4),
    "v5e": ("v5litepod", 1, 1, "chips", 2, 4),
    "v5p": ("v5p", 2, 1, "cores", 3, 4),
    "v6e": ("v6e", 1, 1, "chips", 2, 4),
    "v7x": ("tpu7x", 2, 2, "cores", 3, 4),
}


def test_catalog_lists_exactly_the_seven_generations():
    assert set(T.GENERATIONS) == set(CATALOG)


@pytest.mark.parametrize("name", ALL_GENS)
def test_generation_facts(name):
    g = T.GENERATIONS[name]
    prefix, tcs, dpc, suffix, dims, cph = CATALOG[name]
    assert (g.type_prefix, g.tensorcores_per_chip, g.devices_per_chip, g.suffix_counts, g.torus_dims,
            g.chips_per_host) == (prefix, tcs, dpc, suffix, dims, cph)
    # every listed and canonical shape has the generation's number of dimensions and is valid
    for s in shapes_to_check(g, max_chips=10**6):
        assert len(T.parse_shape(s)) == dims and g.is_valid(T.parse_shape(s)), s
    assert len(set(g.listed_shapes)) == len(g.listed_shapes)
    assert set(g.single_host_shapes) <= set(g.listed_shapes)


@pytest.mark.parametrize(
    "alias, name",
    [
        ("v2", "v2"), ("v3", "v3"), ("v4", "v4"), ("V4", "v4"), ("TPU-V4", "v4"), ("v5e", "v5e"),
        ("v5litepod", "v5e"), ("TPU-V5LITEPOD", "v5e"), ("v5p", "v5p"), ("v6e", "v6e"),
        ("TPU-V6E", "v6e"), ("v7x", "v7x"), ("tpu7x", "v7x"), ("TPU-V7X", "v7x"),
    ],
)
def test_generation_aliases(alias, name):
    assert T.generation(alias).name == name


def test_unknown_generation_lists_choices():
    with pytest.raises(TopologyError) as ei:
        T.generation("v9")
    line = ei.value.line()
    assert "v9" in line
    for g in ALL_GENS:
        assert g in line


# -- agreement with Ray's VALID_TPU_TOPOLOGY ------------------------------------------------------

RAY_TYPES = sorted(ray_tpu.VALID_TPU_TOPOLOGY)
OUR_ADDITIONS = {"v2": {"2x2"}, "v3": {"2x2"}}  # documented single-host v2-8 / v3-8


def test_ray_table_covers_every_generation():
    assert {T.generation(k).name for k in RAY_TYPES} == set(T.GENERATIONS)


@pytest.mark.parametrize("ray_type", RAY_TYPES)
def test_every_shape_ray_schedules_is_valid_here(ray_type):
    """What Ray's VALID_TPU_TOPOLOGY accepts we accept; what we list beyond it is documented."""
    g = T.generation(ray_type)
    ray = set(ray_tpu.VALID_TPU_TOPOLOGY[ray_type])
    for s in ray:
        assert g.is_valid(T.parse_shape(s)), s
        assert T.make_topology(g, T.parse_shape(s)).topology == s  # and the parser agrees with the table
    assert set(g.listed_shapes) - OUR_ADDITIONS.get(g.name, set()) <= ray


# Google's published slice shapes, as xpk's system_characteristics lists them (one per size).
XPK_V4 = ["2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x12", "8x8x16", "8x16x16"]
XPK_V5P_LARGEST = ["12x24x24", "16x16x24", "16x20x28", "12x20x24", "4x4x244", "4x8x188", "8x16x44", "12x12x36"]
XPK_TPU7X = ["4x4x4", "8x8x8", "12x12x12", "16x16x16", "16x20x28", "16x24x24", "4x4x244", "12x24x24", "8x12x52"]


@pytest.mark.parametrize("gen, shapes", [("v4", XPK_V4), ("v5p", XPK_V5P_LARGEST), ("v7x", XPK_TPU7X)])
def test_canonical_shapes_are_the_published_ones(gen, shapes):
    g = T.GENERATIONS[gen]
    for s in shapes:
        assert g.canonical_shape(math.prod(T.parse_shape(s))) == s


@pytest.mark.parametrize(
    "acc, topology, chips, hosts, devices",
    [
        ("v4-4096", "8x16x16", 2048, 512, 2048),
        ("v4-8192", "16x16x16", 4096, 1024, 4096),
        ("v5p-17920", "16x20x28", 8960, 2240, 8960),
        ("tpu7x-18432", "16x24x24", 9216, 2304, 18432),
        ("v5litepod-256", "16x16", 256, 64, 256),
        ("v6e-256", "16x16", 256, 64, 256),
    ],
)
def test_whole_pods_resolve(acc, topology, chips, hosts, devices):
    t = T.resolve(acc)
    assert (t.topology, t.chips, t.num_hosts, t.devices) == (topology, chips, hosts, devices)


@pytest.mark.parametrize(
    "gen, shape, ok",
    [
        ("v4", "16x16x16", True), ("v4", "16x16x20", False),  # 64 cubes is the v4 pod, 80 is not
        ("v4", "4x16x64", True), ("v4", "4x4x6", False), ("v4", "2x2x8", False), ("v4", "4x8x4", True),
        ("v5p", "16x20x28", True), ("v5p", "16x20x32", False), ("v5p", "4x4x244", True),
        ("v7x", "16x24x24", True), ("v7x", "16x24x28", False), ("v7x", "2x4x4", True), ("v7x", "4x2x4", False),
        ("v6e", "16x16", True), ("v6e", "16x32", False), ("v3", "32x32", True), ("v2", "16x32", False),
    ],
)
def test_the_shape_rule(gen, shape, ok):
    g = T.GENERATIONS[gen]
    assert g.is_valid(T.parse_shape(shape)) is ok
    if not ok:
        with pytest.raises(TopologyError, match=f"{shape} is not a valid {gen} slice"):
            T.make_topology(g, T.parse_shape(shape))


def test_sizes_beyond_the_pod_are_refused_with_the_largest_named():
    with pytest.raises(TopologyError) as ei:
        T.resolve("v5p-17922")
    assert "v5p-17920" in ei.value.line()


@pytest.mark.parametrize("ray_type", RAY_TYPES)
def test_counts_match_ray(ray_type):
    """Chips, chips per host, cores per chip and the accelerator type agree with Ray's helpers."""
    g = T.generation(ray_type)
    for s in sorted(ray_tpu.VALID_TPU_TOPOLOGY[ray_type]):
        t = T.make_topology(g, T.parse_shape(s))
        assert t.chips == ray_tpu.get_num_chips_from_topology(s)
        assert t.chips_per_host == ray_tpu.get_chips_per_host(s, ray_type), s
        ray_pod_type = ray_tpu.infer_tpu_pod_type_from_topology(s, ray_type)
        # Ray writes v7x-N where the Cloud TPU API (and we) write tpu7x-N
        assert t.accelerator_type.replace("tpu7x-", "v7x-") == ray_pod_type
        assert ray_tpu.get_total_chips_from_accelerator_type(ray_pod_type) == t.chips
        assert g.cores_per_suffix_unit == (
            ray_tpu.get_tpu_cores_per_chip(ray_pod_type) if g.suffix_counts == "cores" else 1
        )


def test_ray_rejects_what_we_reject():
    """Spot checks from the notes: v4 accepts 4x8x4 but not 2x4x8; v6e rejects 2x2x2."""
    v4, v6e = T.generation("v4"), T.generation("v6e")
    assert T.make_topology(v4, (4, 8, 4)).chips == 128
    with pytest.raises(TopologyError):
        T.make_topology(v4, (2, 4, 8))
    assert "2x4x8" not in ray_tpu.VALID_TPU_TOPOLOGY["v4"]
    with pytest.raises(TopologyError):
        T.make_topology(v6e, (2, 2, 2))


# -- accelerator types ----------------------------------------------------------------------------

# type, topology, chips, devices, hosts, chips/host, TPU_HOST_BOUNDS, TPU_CHIPS_PER_HOST_BOUNDS
EXAMPLES = [
    ("v2-8", "2x2", 4, 8, 1, 4, "1,1,1", "2,2,1"),
    ("v2-32", "4x4", 16, 32, 4, 4, "2,2,1", "2,2,1"),
    ("v2-512", "16x16", 256, 512, 64, 4, "8,8,1", "2,2,1"),
    ("v3-8", "2x2", 4, 8, 1, 4, "1,1,1", "2,2,1"),
    ("v3-64", "4x8", 32, 64, 8, 4, "2,4,1", "2,2,1"),
    ("v3-2048", "32x32", 1024, 2048, 256, 4, "16,16,1", "2,2,1"),
    ("v4-8", "2x2x1", 4, 4, 1, 4, "1,1,1", "2,2,1"),
    ("v4-16", "2x2x2", 8, 8, 2, 4, "1,1,2", "2,2,1"),
    ("v4-32", "2x2x4", 16, 16, 4, 4, "1,1,4", "2,2,1"),
    ("v4-64", "2x4x4", 32, 32, 8, 4, "1,2,4", "2,2,1"),
    ("v4-128", "4x4x4", 64, 64, 16, 4, "2,2,4", "2,2,1"),
    ("v5litepod-1", "1x1", 1, 1, 1, 1, "1,1,1", "1,1,1"),
    ("v5litepod-4", "2x2", 4, 4, 1, 4, "1,1,1", "2,2,1"),
    ("v5litepod-8", "2x4", 8, 8, 1, 8, "1,1,1", "2,4,1"),
    ("v5litepod-16", "4x4", 16, 16, 4, 4, "2,2,1", "2,2,1"),
    ("v5litepod-256", "16x16", 256, 256, 64, 4, "8,8,1", "2,2,1"),
    ("v5p-8", "2x2x1", 4, 4, 1, 4, "1,1,1", "2,2,1"),
    ("v5p-32", "2x2x4", 16, 16, 4, 4, "1,1,4", "2,2,1"),
    ("v5p-12288", "16x16x24", 6144, 6144, 1536, 4, "8,8,24", "2,2,1"),
    ("v6e-1", "1x1", 1, 1, 1, 1, "1,1,1", "1,1,1"),
    ("v6e-4", "2x2", 4, 4, 1, 4, "1,1,1", "2,2,1"),
    ("v6e-8", "2x4", 8, 8, 1, 8, "1,1,1", "2,4,1"),
    ("v6e-16", "4x4", 16, 16, 4, 4, "2,2,1", "2,2,1"),
    ("v6e-32", "4x8", 32, 32, 8, 4, "2,4,1", "2,2,1"),
    ("v6e-256", "16x16", 256, 256, 64, 4, "8,8,1", "2,2,1"),
    ("tpu7x-8", "2x2x1", 4, 8, 1, 4, "1,1,1", "2,2,1"),
    ("tpu7x-16", "2x2x2", 8, 16, 2, 4, "1,1,2", "2,2,1"),
    ("v7x-16", "2x2x2", 8, 16, 2, 4, "1,1,2", "2,2,1"),
]


@pytest.mark.parametrize("acc, shape, chips, devices, hosts, cph, hb, cphb", EXAMPLES)
def test_accelerator_type_examples(acc, shape, chips, devices, hosts, cph, hb, cphb):
    t = T.resolve(acc)
    assert t.topology == shape
    assert (t.chips, t.devices, t.num_hosts, t.chips_per_host) == (chips, devices, hosts, cph)
    assert t.bounds_str(t.host_bounds) == hb
    assert t.bounds_str(t.chips_per_host_bounds) == cphb
    assert t.devices_per_host == cph * t.generation.devices_per_chip
    assert t.accelerator_type == acc.replace("v7x-", "tpu7x-")  # canonical prefix
    # the same slice from its shape + generation
    by_shape = T.resolve(topology=shape, accelerator=t.generation.name)
    assert by_shape == t


# torch_xla/_internal/tpu.py `_ACCELERATOR_TYPE_TO_HOST_BOUNDS` (v2/v3 only; v4+ come from metadata)
TORCH_XLA_HOST_BOUNDS = {
    "v2-8": "1,1,1", "v2-32": "2,2,1", "v2-128": "4,4,1", "v2-256": "4,8,1", "v2-512": "8,8,1",
    "v3-8": "1,1,1", "v3-32": "2,2,1", "v3-64": "2,4,1", "v3-128": "4,4,1", "v3-256": "4,8,1",
    "v3-512": "8,8,1", "v3-1024": "8,16,1", "v3-2048": "16,16,1",
}


@pytest.mark.parametrize("acc", sorted(TORCH_XLA_HOST_BOUNDS))
def test_v2_v3_host_bounds_match_torch_xla(acc):
    t = T.resolve(acc)
    assert t.bounds_str(t.host_bounds) == TORCH_XLA_HOST_BOUNDS[acc]


@pytest.mark.parametrize("name", ALL_GENS)
def test_every_valid_shape_round_trips_through_its_accelerator_type(name):
    g = T.GENERATIONS[name]
    for s in shapes_to_check(g, max_chips=10**6):
        t = T.make_topology(g, T.parse_shape(s))
        back = T.parse_accelerator_type(t.accelerator_type)
        assert back.generation is g
        assert back.chips == t.chips
        n = int(t.accelerator_type.rsplit("-", 1)[1])
        assert n == t.chips * (g.tensorcores_per_chip if g.suffix_counts == "cores" else 1)
        # the canonical shape for a size is the most cubic one, longest dimension last
        same = [T.parse_shape(c) for c in shapes_to_check(g, max_chips=10**6) if math.prod(T.parse_shape(c)) == t.chips]
        spread = min(max(d) - min(d) for d in same)
        got = T.parse_shape(back.topology)
        assert max(got) - min(got) == spread
        if any(list(d) == sorted(d) and max(d) - min(d) == spread for d in same):
            assert list(got) == sorted(got)


def test_suffix_counts_cores_or_chips():
    assert T.resolve("v4-32").chips == 16  # cores
    assert T.resolve("v5p-8").chips == 4  # cores
    assert T.resolve("tpu7x-16").chips == 8  # cores
    assert T.resolve("v6e-8").chips == 8  # chips
    assert T.resolve("v5litepod-16").chips == 16  # chips


# -- shapes, generations and defaults --------------------------------------------------------------


def test_2d_shape_without_generation_means_v6e_and_says_so():
    t = T.resolve("2x8")
    assert t.generation.name == "v6e"
    assert t.accelerator_type == "v6e-16"
    assert any("v6e" in n and "no generation" in n for n in t.notes)
    assert T.resolve(topology="4x4").generation.name == "v6e"
    # with a generation there is no such note
    assert not any("no generation" in n for n in T.resolve(topology="2x8", accelerator="v5e").notes)


def test_3d_shape_without_generation_is_an_error_listing_choices():
    with pytest.raises(TopologyError) as ei:
        T.resolve(topology="2x2x4")
    line = ei.value.line()
    for g in ("v4", "v5p", "v7x"):
        assert g in line
    assert "--accelerator" in line


@pytest.mark.parametrize("name", ALL_GENS)
def test_wrong_number_of_dimensions_is_an_error(name):
    g = T.GENERATIONS[name]
    dims = (2, 2, 2) if g.torus_dims == 2 else (4, 4)
    with pytest.raises(TopologyError) as ei:
        T.make_topology(g, dims)
    assert f"{g.torus_dims}D" in ei.value.line()


@pytest.mark.parametrize(
    "kwargs, must_name",
    [
        (dict(spec="2x3"), ["2x8", "4x4"]),  # v6e default: lists v6e shapes
        (dict(spec="v4-33"), ["v4-32", "cores"]),
        (dict(spec="v6e-12"), ["v6e-8", "v6e-16", "chips"]),
        (dict(spec="v9-8"), ["v4", "v6e", "v7x"]),
        (dict(topology="2x4x8", accelerator="v4"), ["2x2x4", "the 64-chip v4 slice is 4x4x4", "multiple of 4"]),
        (dict(topology="8x8", accelerator="v2", chips_per_host=8), ["4"]),
        (dict(spec="garbage"), ["v4-32", "2x8"]),
        (dict(spec="0x8"), ["at least 1"]),
        (dict(topology="2x2x4", accelerator="v4-16"), ["2x2x2"]),  # shape and type disagree
        (dict(accelerator="v4"), ["2x2x4", "v4-N"]),  # a generation but no size
        (dict(), ["v4-32", "--topology"]),
    ],
)
def test_bad_input_names_the_valid_choices(kwargs, must_name):
    spec = kwargs.pop("spec", None)
    with pytest.raises(TopologyError) as ei:
        T.resolve(spec, **kwargs)
    line = ei.value.line()
    assert "\n" not in line
    for word in must_name:
        assert word in line, (word, line)


# -- chips per host --------------------------------------------------------------------------------


@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_2x4_is_one_or_two_hosts(gen):
    one = T.resolve(topology="2x4", accelerator=gen)
    assert (one.num_hosts, one.chips_per_host, one.chips_per_host_bounds) == (1, 8, (2, 4, 1))
    assert any("--chips-per-host 4" in n for n in one.notes)
    two = T.resolve(topology="2x4", accelerator=gen, chips_per_host=4)
    assert (two.num_hosts, two.chips_per_host, two.host_bounds) == (2, 4, (1, 2, 1))
    assert [h.chips for h in two.hosts] == [
        ((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)),
        ((0, 2, 0), (1, 2, 0), (0, 3, 0), (1, 3, 0)),
    ]
    assert not any("--chips-per-host" in n for n in two.notes)
    assert T.resolve(topology="2x4", accelerator=gen, chips_per_host=8) == one


@pytest.mark.parametrize("gen, shape", [("v5e", "1x1"), ("v5e", "2x2"), ("v6e", "1x1"), ("v6e", "2x2")])
def test_small_single_host_shapes(gen, shape):
    t = T.resolve(topology=shape, accelerator=gen)
    assert t.num_hosts == 1
    assert t.chips_per_host == t.chips


@pytest.mark.parametrize(
    "spec, cph",
    [
        ("v4-16", 8),  # v4 VMs hold 4 chips: no 8-chip v4 host
        ("tpu7x-16", 8),
        ("v5p-16", 8),
        ("v4-8", 1),
        ("v6e-8", 2),
        ("v6e-16", 8),  # 8 chips per host only for the single-host 2x4
        ("v6e-4", 1),
        ("v6e-1", 4),
    ],
)
def test_chips_per_host_that_does_not_fit_is_an_error(spec, cph):
    with pytest.raises(TopologyError) as ei:
        T.resolve(spec, chips_per_host=cph)
    assert f"--chips-per-host {cph}" in ei.value.line()


@pytest.mark.parametrize("spec", ["v4-32", "v6e-16", "tpu7x-16", "v2-32"])
def test_chips_per_host_4_is_the_default_on_multi_host(spec):
    assert T.resolve(spec, chips_per_host=4) == T.resolve(spec)


# -- hosts and chips -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_GENS)
def test_hosts_partition_the_chips_into_blocks(name):
    g = T.GENERATIONS[name]
    for s in shapes_to_check(g, max_chips=2304):
        t = T.make_topology(g, T.parse_shape(s))
        assert t.num_hosts * t.chips_per_host == t.chips
        seen = set()
        bx, by, bz = t.chips_per_host_bounds
        for h in t.hosts:
            assert t.host_grid(h.worker_id) == h.grid
            assert t.worker_id_of_grid(h.grid) == h.worker_id
            assert len(h.chips) == t.chips_per_host
            # a rectangular block of chips_per_host_bounds, x fastest
            expect = [
                (h.grid[0] * bx + x, h.grid[1] * by + y, h.grid[2] * bz + z)
                for z in range(bz) for y in range(by) for x in range(bx)
            ]
            assert list(h.chips) == expect
            for c in h.chips:
                assert all(0 <= c[i] < t.shape[i] for i in range(3))
                assert t.host_of_chip(c) == h.worker_id
            seen.update(h.chips)
        assert len(seen) == t.chips
        if g.torus_dims == 2:
            assert t.shape[2] == 1 and all(c[2] == 0 for c in seen)


def test_worker_ids_enumerate_the_host_grid_x_fastest():
    t = T.resolve("v6e-16")  # 4x4: host grid 2x2
    assert [h.grid for h in t.hosts] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert t.hosts[1].chips == ((2, 0, 0), (3, 0, 0), (2, 1, 0), (3, 1, 0))
    t = T.resolve("v4-128")  # 4x4x4: host grid 2x2x4
    assert t.host_bounds == (2, 2, 4)
    assert [h.grid for h in t.hosts[:5]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1)]


def test_iter_devices_follows_device_id_order():
    t = T.resolve("tpu7x-16")
    devs = list(t.iter_devices())
    assert len(devs) == t.devices == 16
    assert devs[:3] == [(0, (0, 0, 0), 0), (0, (0, 0, 0), 1), (0, (1, 0, 0), 0)]
    assert devs[8] == (1, (0, 0, 1), 0)
    assert len({(c, k) for _, c, k in devs}) == 16


def test_topology_is_small_and_pickles_without_host_cache():
    t = T.resolve(topology="16x16x24", accelerator="v5p")
    cold = len(pickle.dumps(t))
    assert len(t.hosts) == 1536  # fills the cache
    blob = pickle.dumps(t)
    assert len(blob) == cold < 4096
    back = pickle.loads(blob)
    assert back == t and back.hosts == t.hosts


def test_to_dict_schema():
    d = T.resolve("v4-32").to_dict()
    assert d["schema"] == "tpulaunch.topology/v1"
    assert (d["chips"], d["hosts"], d["chips_per_host"], d["host_bounds"], d["chips_per_host_bounds"]) == (
        16, 4, 4, "1,1,4", "2,2,1",
    )
    assert [h["grid"] for h in d["host_list"]] == [[0, 0, z] for z in range(4)]
    assert d["host_list"][2]["chips"] == [[0, 0, 2], [1, 0, 2], [0, 1, 2], [1, 1, 2]]
    assert "host_list" not in T.resolve("v4-32").to_dict(with_hosts=False)
    assert math.prod(T.resolve("v4-32").shape) == d["chips"]


def test_a_slices_workers_settle_how_many_vms_a_2x4_is():
    """`cluster up --topology 2x4 --chips-per-host 4` records two workers: the record's slice is the
    two-VM form, so `run --address auto` (no --chips-per-host) plans the slice the cluster holds."""
    from tpulaunch.plan.slicespec import SliceSpec

    for gen in ("v6e", "v5e"):
        two = T.resolve(topology="2x4", accelerator=gen, chips_per_host=4)
        one = T.resolve(topology="2x4", accelerator=gen)
        assert (two.num_hosts, one.num_hosts) == (2, 1)
        assert SliceSpec.emulated_from(two, "s").to_topology() == two
        assert SliceSpec.emulated_from(one, "s").to_topology() == one
    big = T.resolve("v4-32")
    assert SliceSpec.emulated_from(big, "s").to_topology() == big  # where the shape decides, the workers agree
