"""Slice selection from Ray's TPU node labels (pure: node dicts shaped like `ray.nodes()`)."""

from __future__ import annotations

import pytest

from tpulaunch.plan import topology
from tpulaunch.errors import ClusterError
from tpulaunch.discover.ray_labels import choose, slices_from_nodes


def node(slice_name: str, worker: int, pod: str, topo: str, *, alive: bool = True, tpu: float = 4.0) -> dict:
    return {
        "NodeID": f"{slice_name}-{worker}", "Alive": alive, "NodeManagerAddress": f"10.0.{len(slice_name)}.{worker}",
        "Resources": {"TPU": tpu},
        "Labels": {"ray.io/tpu-slice-name": slice_name, "ray.io/tpu-worker-id": str(worker),
                   "ray.io/tpu-pod-type": pod, "ray.io/tpu-topology": topo},
    }


NODES = (
    [node("a", w, "v4-32", "2x2x4") for w in (3, 1, 0, 2)]
    + [node("bb", w, "v4-32", "2x2x4") for w in range(4)]
    + [node("ccc", w, "v6e-16", "4x4") for w in range(4)]
    + [node("dddd", w, "v4-32", "2x2x4", alive=w != 2) for w in range(4)]
    + [{"NodeID": "cpu", "Alive": True, "Resources": {"CPU": 8}, "Labels": {}}]
)


def test_groups_by_label_in_worker_order():
    slices = {s.name: s for s in slices_from_nodes(NODES, {})}
    assert sorted(slices) == ["a", "bb", "ccc", "dddd"]
    assert [w for w, *_ in slices["a"].workers] == [0, 1, 2, 3]
    spec = slices["a"].to_spec()
    assert spec.worker_ips == ("10.0.1.0", "10.0.1.1", "10.0.1.2", "10.0.1.3")
    assert spec.to_topology().accelerator_type == "v4-32"


def test_busy_slice_is_skipped_for_a_free_one():
    busy = {"a-1": {"TPU": 0.0}}
    chosen = choose(slices_from_nodes(NODES, busy), want=topology.resolve("v4-32"), tpu=None)
    assert [s.name for s in chosen] == ["bb"]


def test_a_node_whose_chips_are_all_taken_is_busy_though_ray_leaves_tpu_out():
    """Ray's per-node available resources leave out a resource none of which is left: a host whose
    every chip a run holds is listed without "TPU", and that is busy, not free. A node Ray said
    nothing about (a Ray without the per-node view) counts as free."""
    taken = {"a-1": {"CPU": 1.0, "memory": 1e9}}
    slices = {s.name: s for s in slices_from_nodes(NODES, taken)}
    assert [busy for *_, busy in slices["a"].workers] == [False, True, False, False]
    chosen = choose(slices_from_nodes(NODES, taken), want=topology.resolve("v4-32"), tpu=None)
    assert [s.name for s in chosen] == ["bb"]


def test_wrong_generation_and_dead_hosts_are_explained():
    with pytest.raises(ClusterError) as e:
        choose(slices_from_nodes(NODES, {"a-0": {"TPU": 0}, "bb-0": {"TPU": 2}}), want=topology.resolve("v4-32"),
               tpu=None)
    msg = e.value.line()
    assert "a: busy with another run" in msg and "bb: busy" in msg
    assert "ccc: v6e-16 (4x4), wrong generation" in msg
    assert "dddd: only 3 of 4 hosts alive" in msg


def test_size_mismatch_and_named_slice():
    with pytest.raises(ClusterError, match="wrong size"):
        choose(slices_from_nodes(NODES, {}), want=topology.resolve("v6e-8"), tpu="ccc")
    with pytest.raises(ClusterError, match="no slice named zzz"):
        choose(slices_from_nodes(NODES, {}), want=None, tpu="zzz")
    assert [s.name for s in choose(slices_from_nodes(NODES, {}), want=None, tpu="ccc")] == ["ccc"]


def test_multislice_needs_enough_free_slices():
    chosen = choose(slices_from_nodes(NODES, {}), want=topology.resolve("v4-32"), tpu=None, num_slices=2)
    assert [s.name for s in chosen] == ["a", "bb"]
    with pytest.raises(ClusterError, match="no free slice fits 3 x v4-32"):
        choose(slices_from_nodes(NODES, {}), want=topology.resolve("v4-32"), tpu=None, num_slices=3)


def test_no_tpu_hosts_at_all():
    with pytest.raises(ClusterError, match="no TPU hosts"):
        choose(slices_from_nodes([{"NodeID": "x", "Alive": True, "Resources": {}, "Labels": {}}], {}), want=None,
               tpu=None)


def test_a_host_that_came_back_is_listed_once():
    nodes = [node("e", w, "v4-32", "2x2x4") for w in range(4)] + [{**node("e", 2, "v4-32", "2x2x4", alive=False),
                                                                   "NodeID": "e-2-old"}]
    (s,) = slices_from_nodes(nodes, {})
    assert [(w, alive) for w, _, alive, _ in s.workers] == [(0, True), (1, True), (2, True), (3, True)]
    (gone,) = slices_from_nodes(nodes[:2] + nodes[3:], {})  # not back yet: the dead entry stays
    assert [(w, alive) for w, _, alive, _ in gone.workers] == [(0, True), (1, True), (2, False), (3, True)]
