"""`tpulaunch topology` and `tpulaunch mesh inspect`, run as a user would (real CLI, subprocess)."""

from __future__ import annotations

import json

import pytest

from fakes import invoke
from support import invoke_json


def _one_error_line(proc) -> str:
    """A usage error: exit 2, nothing on stdout, exactly one non-empty stderr line, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert "internal error" not in lines[0]
    return lines[0]


# -- tpulaunch topology --json ----------------------------------------------------------------------


def test_topology_v4_32_json():
    d = invoke_json("topology", "v4-32")
    assert d["schema"] == "tpulaunch.topology/v1"
    assert (d["generation"], d["accelerator_type"], d["topology"], d["torus_dims"]) == ("v4", "v4-32", "2x2x4", 3)
    assert (d["chips"], d["devices"], d["hosts"], d["chips_per_host"]) == (16, 16, 4, 4)
    assert (d["host_bounds"], d["chips_per_host_bounds"]) == ("1,1,4", "2,2,1")
    assert (d["tensorcores_per_chip"], d["devices_per_chip"], d["suffix_counts"]) == (2, 1, "cores")
    assert [h["worker_id"] for h in d["host_list"]] == [0, 1, 2, 3]
    for z, h in enumerate(d["host_list"]):
        assert h["grid"] == [0, 0, z]
        assert h["chips"] == [[0, 0, z], [1, 0, z], [0, 1, z], [1, 1, z]]


def test_topology_v6e_8_json():
    d = invoke_json("topology", "v6e-8")
    assert (d["generation"], d["topology"], d["chips"], d["devices"], d["hosts"], d["chips_per_host"]) == (
        "v6e", "2x4", 8, 8, 1, 8,
    )
    assert (d["host_bounds"], d["chips_per_host_bounds"], d["suffix_counts"]) == ("1,1,1", "2,4,1", "chips")
    assert len(d["host_list"]) == 1
    assert d["host_list"][0]["chips"] == [[x, y, 0] for y in range(4) for x in range(2)]
    assert any("--chips-per-host 4" in n for n in d["notes"])


def test_topology_v6e_8_as_two_vms():
    d = invoke_json("topology", "v6e-8", "--chips-per-host", "4")
    assert (d["hosts"], d["chips_per_host"], d["host_bounds"], d["chips_per_host_bounds"]) == (2, 4, "1,2,1", "2,2,1")


@pytest.mark.parametrize("spec", ["tpu7x-16", "v7x-16"])
def test_topology_tpu7x_16_json(spec):
    d = invoke_json("topology", spec)
    assert (d["generation"], d["accelerator_type"], d["topology"]) == ("v7x", "tpu7x-16", "2x2x2")
    assert (d["chips"], d["devices"], d["hosts"], d["chips_per_host"], d["devices_per_host"]) == (8, 16, 2, 4, 8)
    assert (d["host_bounds"], d["chips_per_host_bounds"], d["devices_per_chip"]) == ("1,1,2", "2,2,1", 2)
    assert d["host_list"][1]["chips"] == [[0, 0, 1], [1, 0, 1], [0, 1, 1], [1, 1, 1]]


@pytest.mark.parametrize(
    "args, acc, chips, hosts",
    [
        (("--topology", "2x2x4", "--accelerator", "v4"), "v4-32", 16, 4),
        (("-t", "2x2x2", "-a", "tpu7x"), "tpu7x-16", 8, 2),
        (("2x2x4", "--accelerator", "v5p"), "v5p-32", 16, 4),
        (("v5litepod-16",), "v5litepod-16", 16, 4),
        (("--topology", "2x8", "--accelerator", "v5e"), "v5litepod-16", 16, 4),
        (("--accelerator", "v3-64"), "v3-64", 32, 8),
        (("v2-8",), "v2-8", 4, 1),
    ],
)
def test_topology_inputs(args, acc, chips, hosts):
    d = invoke_json("topology", *args)
    assert (d["accelerator_type"], d["chips"], d["hosts"]) == (acc, chips, hosts)
    assert d["notes"] == [] or "2x4" in d["topology"]


def test_2d_shape_without_generation_says_v6e():
    d = invoke_json("topology", "2x8")
    assert (d["generation"], d["accelerator_type"]) == ("v6e", "v6e-16")
    assert any("v6e" in n and "no generation" in n for n in d["notes"])
    proc = invoke("topology", "--topology", "2x8")
    assert proc.returncode == 0
    assert "note: no generation given: a 2D shape means v6e" in proc.stdout


def test_json_is_one_document_and_nothing_else():
    proc = invoke("topology", "v4-32", "--json")
    assert proc.returncode == 0
    json.loads(proc.stdout)  # the whole of stdout is one document
    assert proc.stderr == ""


# -- bad input: one clear line, exit 2 ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, must_name",
    [
        (("topology", "2x3"), ["2x3", "2x8", "4x4", "16x16"]),
        (("topology", "v4-33"), ["v4-33", "v4-32", "cores"]),
        (("topology", "v9-8"), ["v9", "v2", "v4", "v5e", "v5p", "v6e", "v7x"]),
        (("topology", "--topology", "2x4x8", "--accelerator", "v4"), ["2x4x8", "2x2x4", "4x4x4"]),
        (("topology", "garbage"), ["garbage", "v4-32", "2x8"]),
        (("topology", "--topology", "2x2x4"), ["2x2x4", "v4", "v5p", "v7x", "--accelerator"]),
        (("topology", "v6e-16", "--chips-per-host", "8"), ["--chips-per-host 8"]),
        (("topology", "--accelerator", "v4"), ["2x2x4", "v4-N"]),
        (("topology",), ["v4-32", "--topology"]),
        (("mesh", "inspect", "-t", "2x8", "--mesh", "data=3,model=-1"), ["data=3", "16", "divisible"]),
        (("mesh", "inspect", "-t", "2x8", "--mesh", "data=4,model=8"), ["32", "16", "-1"]),
        (("mesh", "inspect", "-t", "2x8", "--mesh", "data=4,data=4"), ["'data' twice"]),
        (("mesh", "inspect", "-t", "2x8", "--mesh", "data=-1,model=-1"), ["more than one -1"]),
        (("mesh", "inspect", "-t", "2x8", "--dcn", "data=2", "--num-slices", "3"), ["2", "3"]),
        (("mesh", "inspect", "-t", "2x8", "--shard", "4x4", "--spec", "data,nope"), ["'nope'", "data, model"]),
        (("mesh", "inspect", "-t", "2x8", "--shard", "4x4"), ["--spec"]),
        (("mesh", "inspect", "-t", "2x8", "--shard", "4xq", "--spec", "data,model"), ["4xq", "1024x4096"]),
        (("mesh", "inspect", "-t", "2x2x4"), ["v4", "v5p", "v7x"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else None,
)
def test_bad_input_is_one_clear_line(args, must_name):
    line = _one_error_line(invoke(*args))
    for word in must_name:
        assert word in line, (word, line)


def test_bad_flag_is_a_usage_error_not_an_internal_error():
    proc = invoke("topology", "v4-32", "--bogus")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert "--bogus" in proc.stderr
    proc = invoke("topology", "v4-32", "--chips-per-host", "abc")
    assert proc.returncode == 2, proc.stderr
    assert "internal error" not in proc.stderr


def test_no_arguments_shows_help_not_an_internal_error():
    proc = invoke()
    assert proc.returncode in (0, 2), proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    text = proc.stdout + proc.stderr
    assert "topology" in text and "mesh" in text


# -- plain (piped) output -----------------------------------------------------------------------------


def test_topology_plain_output_reads_well():
    proc = invoke("topology", "v4-32")
    assert proc.returncode == 0 and proc.stderr == ""
    out = proc.stdout
    for phrase in [
        "accelerator_type: v4-32", "generation: v4", "topology: 2x2x4", "torus: 3D", "chips: 16",
        "hosts: 4", "chips_per_host: 4", "TPU_HOST_BOUNDS: 1,1,4", "TPU_CHIPS_PER_HOST_BOUNDS: 2,2,1",
        "host 0: grid 0,0,0 chips (0,0,0) (1,0,0) (0,1,0) (1,1,0)",
        "host 3: grid 0,0,3 chips (0,0,3) (1,0,3) (0,1,3) (1,1,3)",
    ]:
        assert phrase in out, phrase
    assert "\x1b[" not in out  # no color codes when piped
    assert all(len(l) <= 100 for l in out.splitlines())


def test_topology_plain_2d_coordinates_have_two_numbers():
    out = invoke("topology", "v6e-16").stdout
    assert "host 1: grid 1,0 chips (2,0) (3,0) (2,1) (3,1)" in out
    assert "torus: 2D" in out and "suffix_counts: chips" in out


def test_long_host_lists_are_cut_in_plain_output_but_not_in_json():
    out = invoke("topology", "v5p-12288").stdout
    assert "host 63:" in out and "host 64:" not in out
    assert "1472 more hosts (use --json for all)" in out
    assert len(invoke_json("topology", "v5p-12288")["host_list"]) == 1536


# -- tpulaunch mesh inspect -----------------------------------------------------------------------------


def test_mesh_inspect_2x8_json_rows_are_hosts():
    d = invoke_json("mesh", "inspect", "--topology", "2x8")
    assert d["schema"] == "tpulaunch.mesh/v1"
    assert (d["axis_names"], d["shape"], d["num_devices"], d["num_processes"]) == (["data", "model"], [4, 4], 16, 4)
    assert (d["generation"], d["accelerator_type"], d["topology"]) == ("v6e", "v6e-16", "2x8")
    hosts = {p["process"]: sorted(p["device_ids"]) for p in d["processes"]}
    assert sorted(hosts) == [0, 1, 2, 3]
    rows = [sorted(r) for r in d["grid"]]
    assert sorted(rows) == sorted(hosts.values())
    for row in d["grid"]:
        procs = {x["process"] for x in d["devices"] if x["id"] in row}
        assert len(procs) == 1
    chips_of = {x["id"]: x["chip"] for x in d["devices"]}
    assert [chips_of[i] for i in d["grid"][0]] == [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0]]


def test_mesh_inspect_shard_json():
    d = invoke_json("mesh", "inspect", "--topology", "2x8", "--shard", "1024x4096", "--spec", "data,model")
    s = d["sharding"]
    assert s["tensor_shape"] == [1024, 4096]
    assert s["shard_shape"] == [256, 1024]
    assert s["tile_shape"] == [4, 4] and s["replicas_per_shard"] == 1 and not s["padded"]
    assert s["hlo_sharding"].startswith("{devices=[4,4]")
    assert s["hlo_sharding"] == "{devices=[4,4]" + ",".join(str(i) for r in d["grid"] for i in r) + "}"
    assert len(s["blocks"]) == 16
    assert s["blocks"][1] == {"index": [[0, 256], [1024, 2048]], "devices": [d["grid"][0][1]]}


def test_mesh_inspect_shard_plain_output():
    proc = invoke("mesh", "inspect", "--topology", "2x8", "--shard", "1024x4096", "--spec", "data,model")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for phrase in [
        "mesh data=4, model=4 over v6e-16 (2x8), 16 devices",
        "data=0: 0 1 3 2",
        "data=3: 12 13 15 14",
        "host 0: slice 0 worker 0 devices 0-3",
        "tensor 1024x4096 spec (data,model)",
        "shard shape: 256x1024 (16 shards, 1 replica(s) each)",
        "hlo sharding: {devices=[4,4]0,1,3,2,",
        "block [0:256] [0:1024] on devices 0",
    ]:
        assert phrase in out, phrase
    # the note about the default generation goes to stderr, not into the result
    assert "note: no generation given" in proc.stderr and "note:" not in out


def test_mesh_inspect_partial_replication_plain():
    out = invoke("mesh", "inspect", "-t", "2x8", "--shard", "1024x4096", "--spec", "data,None").stdout
    assert "shard shape: 256x4096 (4 shards, 4 replica(s) each)" in out
    assert "last_tile_dim_replicate}" in out
    assert "block [0:256] [0:4096] on devices 0,1,2,3" in out


def test_mesh_inspect_one_host_is_1d():
    proc = invoke("mesh", "inspect", "-a", "v6e-8")
    assert proc.returncode == 0, proc.stderr
    assert "mesh data=8 over v6e-8 (2x4), 8 devices" in proc.stdout
    assert "data: 0 2 4 6 7 5 3 1" in proc.stdout  # one closed ring of the 2x4 chips: 1 hop a step


def test_mesh_inspect_multislice():
    args = ("mesh", "inspect", "-t", "2x2x4", "-a", "v4", "--mesh", "data=4,model=4", "--dcn", "data=2")
    d = invoke_json(*args)
    assert (d["shape"], d["ici_shape"], d["dcn_shape"], d["num_slices"], d["num_processes"]) == (
        [8, 4], [4, 4], [2, 1], 2, 8,
    )
    assert all(i < 16 for r in d["grid"][:4] for i in r) and all(i >= 16 for r in d["grid"][4:] for i in r)
    out = invoke(*args).stdout
    assert "mesh data=8, model=4  (ICI 4x4 x DCN 2x1) over 2 x v4-32 (2x2x4), 32 devices" in out
    assert "host 7: slice 1 worker 3 devices 28-31" in out


def test_mesh_inspect_three_axes():
    d = invoke_json("mesh", "inspect", "-a", "tpu7x-16", "--mesh", "a=2,b=-1,c=4")
    assert d["axis_names"] == ["a", "b", "c"] and d["shape"] == [2, 2, 4]
    out = invoke("mesh", "inspect", "-a", "tpu7x-16", "--mesh", "a=2,b=-1,c=4").stdout
    assert "a=1,b=1: " in out


# -- help -----------------------------------------------------------------------------------------------


def test_root_help():
    proc = invoke("--help")
    assert proc.returncode == 0
    out = proc.stdout
    for phrase in ["Launch SPMD training", "Cloud TPU slice", "emulated", "topology", "mesh", "--debug"]:
        assert phrase in out, phrase


def test_topology_help():
    proc = invoke("topology", "--help")
    assert proc.returncode == 0
    out = proc.stdout
    for phrase in [
        "[ACCELERATOR_OR_SHAPE]", "v4-32", "tpu7x-16", "--topology", "--accelerator", "--chips-per-host",
        "--json", "A 2D shape alone means", "v6e",
    ]:
        assert phrase in out, phrase
    assert "[[" not in out


def test_mesh_inspect_help():
    proc = invoke("mesh", "inspect", "-h")
    assert proc.returncode == 0
    out = proc.stdout
    for phrase in ["--topology", "--mesh", "NAME=SIZE", "-1", "--dcn", "--num-slices", "--shard", "--spec",
                   "--json", "1024x4096", "data,model", "colored by host"]:
        assert phrase in out, phrase


# -- terminal (rich) rendering, in-process -----------------------------------------------------------


def _render(renderable) -> str:
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=100, no_color=True, color_system=None, markup=False).print(renderable)
    return buf.getvalue()


def test_rich_topology_and_mesh_render():
    from tpulaunch.plan import mesh as M
    from tpulaunch.plan import topology as T
    from tpulaunch.plan.sharding import shard
    from tpulaunch.cli import render

    t = T.resolve("tpu7x-16")
    text = _render(render.topology_rich(t))
    for phrase in ["tpu7x-16", "2 TensorCore(s)/chip, 2 device(s)/chip", "3D torus", "8 / 16", "2 x 4 chips",
                   "TPU_HOST_BOUNDS", "1,1,2", "(0,0,1) (1,0,1) (0,1,1) (1,1,1)"]:
        assert phrase in text, phrase
    plan = M.plan_mesh(T.resolve(topology="2x8"))
    text = _render(render.mesh_rich(plan))
    assert "mesh data=4, model=4 over v6e-16 (2x8), 16 devices" in text
    assert "model=3" in text and "colored by host" in text
    assert "0-3" in text and "12-15" in text
    text = _render(render.sharding_rich(shard(plan, (1024, 4096), ("data", "model"))))
    assert "shard shape: 256x1024" in text and "{devices=[4,4]" in text


@pytest.mark.parametrize("acc, topology, hosts, devices", [
    ("v4-4096", "8x16x16", 512, 2048), ("v4-8192", "16x16x16", 1024, 4096),
    ("v5p-17920", "16x20x28", 2240, 8960), ("tpu7x-18432", "16x24x24", 2304, 18432),
])
def test_whole_pods_from_the_command_line(acc, topology, hosts, devices):
    doc = json.loads(invoke("topology", acc, "--json").stdout)
    assert (doc["topology"], doc["hosts"], doc["devices"], len(doc["host_list"])) == (topology, hosts, devices, hosts)


def test_mesh_inspect_of_a_whole_pod_is_a_summary():
    proc = invoke("mesh", "inspect", "tpu7x-18432")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "mesh data=2304, model=8 over tpu7x-18432 (16x24x24), 18432 devices"
    assert "... 2240 more rows (use --json for all)" in lines and "... 2240 more hosts (use --json for all)" in lines
    assert len(lines) < 140
