"""The framework adapters' pure parts: emulation env, device order mapping, a missing framework.

What needs the framework itself (a runtime's devices, a mesh built) is in tests/integration.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from support import write_scripts
from tpulaunch.run.prepare import prepare
from tpulaunch import run
from tpulaunch.discover import SliceRequest
from tpulaunch.errors import LaunchError, MeshMismatchError
from tpulaunch.host import frameworks
from tpulaunch.host.frameworks.jax import ADAPTER, device_order
from tpulaunch.host.frameworks.torch_xla import runtime_device_ids
from tpulaunch.plan import mesh as M
from tpulaunch.plan import topology as T


def _plan(topo_kw, mesh=None, dcn=None, num_slices=None) -> M.MeshPlan:
    kw = dict(topo_kw)
    spec = kw.pop("spec", None)
    return M.plan_mesh(T.resolve(spec, **kw), mesh, dcn, num_slices)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return write_scripts(tmp_path_factory.mktemp("jaxwork"), {"jax_checks.py": "import jax\n"})


def test_emulation_env_gives_each_host_its_own_devices():
    topo = T.resolve(None, topology="2x8")
    env = ADAPTER.emulation_env(topo, 1)
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    tpu7x = T.resolve("tpu7x-16")  # 2 devices per chip, 4 chips per host
    assert ADAPTER.emulation_env(tpu7x, 2)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def _cpu_attrs(plan: M.MeshPlan, order: list[int]) -> list[dict]:
    """What jax.devices() reports on CPU: per process, ids p*2048+k, listed in `order`."""
    per = plan.topology.devices_per_host
    out = [{"id": p * 2048 + k, "process_index": p, "platform": "cpu"}
           for p in range(plan.num_processes) for k in range(per)]
    return [out[i] for i in order]


def test_cpu_device_order_follows_process_and_local_index():
    plan = M.plan_mesh(T.resolve(None, topology="2x8"))
    shuffled = [5, 0, 15, 9, 1, 2, 3, 4, 6, 7, 8, 10, 11, 12, 13, 14]
    attrs = _cpu_attrs(plan, shuffled)
    order = device_order(plan, attrs)
    for flat, plan_id in enumerate(plan.device_ids()):
        a = attrs[order[flat]]
        assert a["process_index"] == plan_id // 4 and a["id"] == (plan_id // 4) * 2048 + plan_id % 4


def test_tpu_device_order_matches_coords_core_and_slice():
    # v4-16 x 2 slices: 2 hosts per slice, 4 chips (one device each) per host
    plan = M.plan_mesh(T.resolve("v4-16"), "data=2,model=4", "data=2")
    attrs = []
    for dev_id in reversed(range(plan.num_devices)):  # JAX's order is not the plan's
        d = plan.device(dev_id)
        attrs.append({"id": 1000 + dev_id, "process_index": d.process, "platform": "tpu",
                      "coords": d.chip, "core_on_chip": d.core, "slice_index": d.slice})
    order = device_order(plan, attrs)
    assert [attrs[i]["id"] - 1000 for i in order] == plan.device_ids()
    # a chip on the wrong process (worker ids and process ids disagree) is refused
    attrs[0] = dict(attrs[0], process_index=(attrs[0]["process_index"] + 1) % plan.num_processes)
    with pytest.raises(MeshMismatchError, match="belongs to JAX process"):
        device_order(plan, attrs)
    # a chip the plan expects but the runtime lacks
    with pytest.raises(MeshMismatchError, match="is not among JAX's devices"):
        device_order(plan, attrs[1:])


def _without_jax(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "jax" else real(name, *a, **k))


def test_framework_jax_without_jax_installed_names_the_extra(monkeypatch, workdir):
    _without_jax(monkeypatch)
    with pytest.raises(LaunchError) as e:
        frameworks.require_installed("jax")
    assert e.value.line() == "--framework jax needs jax, which is not installed. pip install 'tpulaunch[jax]'"
    # the same, from a launch request (explicit and auto-detected), before anything starts
    monkeypatch.chdir(workdir)
    for fw in ("jax", "auto"):
        req = run.LaunchRequest(script="jax_checks.py", slices=SliceRequest(topology="2x8"), framework=fw,
                                workdir=str(workdir))
        with pytest.raises(LaunchError) as e:
            prepare(req, run.Target(None), None, None)
        assert "tpulaunch[jax]" in e.value.line()


def _tpu_attributes(plan: M.MeshPlan, seed: int, with_slice: bool) -> tuple[list[dict], list[int]]:
    """Attributes as PJRT would report them on a TPU, in a scrambled ordinal order.

    Returns (attributes by ordinal, plan device id of each ordinal)."""
    ids = list(range(plan.num_devices))
    random.Random(seed).shuffle(ids)
    attrs = []
    for dev_id in ids:
        d = plan.device(dev_id)
        a = {"coords": list(d.chip), "core_on_chip": d.core, "name": f"TPU_{dev_id}"}
        if with_slice:
            a["slice_index"] = d.slice
        attrs.append(a)
    return attrs, ids


@pytest.mark.parametrize(
    "topo_kw, mesh, num_slices, with_slice",
    [
        (dict(spec="v4-32"), None, 1, False),
        (dict(spec="tpu7x-16"), None, 1, False),  # 2 devices per chip: core_on_chip tells them apart
        (dict(spec="v2-32"), "a=4,b=8", 1, False),
        (dict(spec="v5p-32"), "data=2,model=-1", 2, True),
        (dict(spec="tpu7x-16"), "a=2,b=2,c=4", 3, True),
        (dict(spec="v6e-16"), None, 1, True),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_runtime_device_ids_maps_scrambled_tpu_ordinals(topo_kw, mesh, num_slices, with_slice, seed):
    plan = _plan(topo_kw, mesh, None, num_slices)
    attrs, id_of_ordinal = _tpu_attributes(plan, seed, with_slice)
    ordinals = runtime_device_ids(plan, attrs)
    assert sorted(ordinals) == list(range(plan.num_devices))
    # each mesh position gets the runtime ordinal of the planned physical device
    assert [id_of_ordinal[o] for o in ordinals] == plan.device_ids()
    for o, dev_id in zip(ordinals, plan.device_ids()):
        d = plan.device(dev_id)
        assert tuple(attrs[o]["coords"]) == d.chip and attrs[o]["core_on_chip"] == d.core


def test_runtime_device_ids_without_coords_is_the_identity():
    plan = _plan(dict(spec="v4-32"))
    cpu_attrs = [{"name": f"CPU_{i}"} for i in range(16)]
    assert runtime_device_ids(plan, cpu_attrs) == plan.device_ids()


@pytest.mark.parametrize(
    "topo_kw, num_slices, drop",
    [(dict(spec="v4-32"), 1, 5), (dict(spec="tpu7x-16"), 1, 0), (dict(spec="v5p-32"), 2, 31)],
)
def test_runtime_device_ids_missing_device_raises(topo_kw, num_slices, drop):
    plan = _plan(topo_kw, num_slices=num_slices)
    attrs, id_of_ordinal = _tpu_attributes(plan, 7, num_slices > 1)
    missing = id_of_ordinal[drop]
    del attrs[drop]
    with pytest.raises(MeshMismatchError) as ei:
        runtime_device_ids(plan, attrs)
    d = plan.device(missing)
    line = ei.value.line()
    assert f"planned device {missing}" in line
    assert str(d.chip) in line and "is not among the runtime's devices" in line


def test_runtime_device_ids_wrong_slice_raises():
    """A multislice plan on a runtime whose devices carry no second slice_index."""
    plan = _plan(dict(spec="v4-16"), num_slices=2)
    attrs, _ = _tpu_attributes(plan, 3, with_slice=True)
    for a in attrs:
        a["slice_index"] = 0  # every device claims slice 0
    with pytest.raises(MeshMismatchError, match="slice 1"):
        runtime_device_ids(plan, attrs)
