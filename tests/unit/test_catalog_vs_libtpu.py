"""The catalog against libtpu: every slice shape, as tpulaunch plans it and as libtpu describes it.

libtpu (from PyPI, `tpulaunch[rehearse]`) describes any TPU topology without a TPU
(`jax.experimental.topologies.get_topology_desc`), in this process. For every listed shape of every
generation, every canonical shape up to 1024 chips and each generation's whole pod: the chips'
coordinates, the devices per chip, each host's block of chips by worker id, and the device kind
must be tpulaunch's (`plan.topology`), except where `rehearse.target.KNOWN_DIFFERENCES` says
libtpu's default differs, and why. With the arguments a rehearsal passes (`topology_args`) libtpu
must describe exactly tpulaunch's slice, with no exception: that is what maps a rehearsal's
devices. libtpu missing is a failure that says how to install it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tpulaunch.plan.catalog import GENERATIONS
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.topology import Topology, resolve
from tpulaunch.rehearse import target as T


def _shapes() -> list[tuple[str, str]]:
    out = []
    for g in GENERATIONS.values():
        canonical = g.canonical_shapes()
        small = [s for s in canonical if resolve(topology=s, accelerator=g.name).chips <= 1024]
        for s in dict.fromkeys([*g.listed_shapes, *small, canonical[-1]]):
            out.append((g.name, s))
    return out


SHAPES = _shapes()


@pytest.fixture(scope="module")
def libtpu():
    """libtpu loaded in this process with its quiet, offline settings (read once, as it loads),
    and the environment given back after."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.fail("libtpu is not installed: " + T.INSTALL_HINT)
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in T.libtpu_env(resolve("v5p-8")).items()})
    os.environ.setdefault("TPU_LOG_DIR", "disabled")
    try:
        T.describe({"platform": "tpu", "topology_name": "v5p:2x2x1"})  # loads it
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return T.describe


def _ours(topo: Topology) -> dict:
    return {"chips": sorted(topo.host_chips(w)[i] for w in range(topo.num_hosts) for i in range(topo.chips_per_host)),
            "devices_per_chip": topo.generation.devices_per_chip,
            "chips_per_host_bounds": tuple(topo.chips_per_host_bounds),
            "hosts": {h.worker_id: tuple(sorted(h.chips)) for h in topo.hosts},
            "device_kind": T.DEVICE_KINDS[topo.generation.name]}


def _theirs(devices: list[dict]) -> dict:
    return {"chips": sorted({tuple(d["coords"]) for d in devices}),
            "devices_per_chip": T.devices_per_chip(devices),
            "chips_per_host_bounds": T.chips_per_host_bounds(devices),
            "hosts": T.host_blocks(devices),
            "device_kind": sorted({d["device_kind"] for d in devices})[0] if len({d["device_kind"] for d in devices}) == 1
            else sorted({d["device_kind"] for d in devices})}


def test_every_known_difference_names_a_catalog_generation_and_a_reason():
    for k in T.KNOWN_DIFFERENCES:
        assert k.generation in GENERATIONS and len(k.reason) > 40 and k.rehearsal
        assert all(GENERATIONS[k.generation].is_valid(tuple(int(d) for d in s.split("x"))) for s in k.shapes)


@pytest.mark.parametrize("gen, shape", SHAPES, ids=[f"{g}-{s}" for g, s in SHAPES])
def test_libtpus_default_slice_is_tpulaunchs_but_for_the_known_differences(libtpu, gen, shape):
    topo = resolve(topology=shape, accelerator=gen)
    ours = _ours(topo)
    known = [k for k in T.KNOWN_DIFFERENCES if k.applies(gen, shape)]
    try:
        theirs = _theirs(libtpu({"platform": "tpu", "topology_name": T.libtpu_name(topo)}))
    except Exception as e:  # noqa: BLE001 - libtpu refused the shape by default
        assert [k.libtpu for k in known] == [None], f"libtpu refuses {gen} {shape}: {e}"
        return
    differ = {f for f in ours if ours[f] != theirs[f]}
    if "chips_per_host_bounds" in differ:
        differ.discard("hosts")  # other host blocks: other hosts, said once
    assert differ == {k.field for k in known}, f"{gen} {shape}: libtpu {[(f, theirs[f]) for f in differ]}"
    for k in known:
        assert (theirs[k.field], ours[k.field]) == (k.libtpu, k.tpulaunch), k


@pytest.mark.parametrize("gen, shape", SHAPES, ids=[f"{g}-{s}" for g, s in SHAPES])
def test_with_the_rehearsals_arguments_libtpu_describes_exactly_tpulaunchs_slice(libtpu, gen, shape):
    topo = resolve(topology=shape, accelerator=gen)
    assert _theirs(libtpu(T.topology_args(topo))) == _ours(topo)


@pytest.mark.parametrize("spec, slices", [("v5e-16", 2), ("v5p-16", 4), ("v4-32", 2), ("tpu7x-16", 2)])
def test_a_multislice_maps_every_plan_device_to_its_own_libtpu_device(libtpu, spec, slices):
    """The rehearsal's device map: plan device -> libtpu device of the same slice, chip and core,
    one to one, and that device's host is the plan's."""
    topo = resolve(spec)
    plan = plan_mesh(topo, None, "data=-1" if slices > 1 else None, slices)
    devices = libtpu(T.topology_args(topo, slices))
    mapped = T.device_map(plan, devices)
    assert sorted(mapped) == list(range(plan.num_devices))
    for dev_id, i in enumerate(mapped):
        d, lib = plan.device(dev_id), devices[i]
        assert (lib["slice_index"], tuple(lib["coords"]), lib["core_on_chip"]) == (d.slice, tuple(d.chip), d.core)
        assert lib["process_index"] == d.process  # libtpu numbers hosts across the slices, as the plan does
