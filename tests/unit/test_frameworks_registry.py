"""The framework registry (`plan.frameworks`): every row names a real adapter, the ports rule, and a
cluster's spares planned by the same rule as a run on it, so their environments agree."""

from __future__ import annotations

import importlib
import itertools

import pytest

from support import write_scripts
from tpulaunch.run.prepare import prepare
from tpulaunch import run
from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.errors import LaunchError
from tpulaunch.plan.env import split_env
from tpulaunch.plan.frameworks import FACTS, Framework, facts, ports
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
from tpulaunch.run.prepare import recorded_slices
from tpulaunch.run.warm import spare_plan


@pytest.mark.parametrize("name", list(Framework))
def test_each_row_names_the_adapter_that_boots_it(name):
    adapter = importlib.import_module(FACTS[name].adapter).ADAPTER
    assert adapter.name == name.value and facts(name.value) is FACTS[name]


def test_an_unknown_framework_is_one_line():
    with pytest.raises(LaunchError) as e:
        facts("tensorflow")
    assert e.value.line() == "unknown framework 'tensorflow'. choose one of torch_xla, jax, torch_tpu, none, or auto"


@pytest.mark.parametrize("name, base, want", [
    (Framework.TORCH_XLA, None, (8476, 8478, None, None, 8477)),
    (Framework.JAX, None, (8476, 8478, 8477, None, None)),
    (Framework.TORCH_TPU, None, (29500, 29502, None, None, None)),
    (Framework.NONE, 9000, (9000, 9002, None, None, None)),
])
def test_on_a_slice_the_ports_are_the_masters_and_the_next_three(name, base, want):
    p = ports(FACTS[name], local=False, emulated=False, command=False, base=base, free=lambda: 1 / 0)
    assert (p.coordinator, p.group, p.jax, p.emulation, p.exit) == want
    emu = ports(FACTS[name], local=False, emulated=True, command=True, base=base, free=lambda: 1 / 0)
    assert emu.emulation == want[0] + 3 and emu.exit is None  # a command leaves in no order


def test_on_one_machine_every_port_is_a_free_one():
    free = itertools.count(40000).__next__
    p = ports(FACTS[Framework.JAX], local=True, emulated=True, command=False, base=None, free=free)
    assert (p.coordinator, p.group, p.jax, p.emulation, p.exit) == (40000, 40001, 40002, 40003, None)


@pytest.mark.parametrize("framework", ["torch_xla", "jax"])
def test_a_clusters_spares_get_the_environment_its_first_run_gets(tmp_path, framework):
    """What stays from run to run (`split_env`'s first part) is what a spare imports with: the same
    for the spare `cluster up` starts and the hosts of a plain run on that cluster."""
    slices = [SliceSpec(name=f"emulated-{i}", accelerator_type="v4-16", topology="2x2x2", source="emulated",
                        workers=(WorkerEndpoint(0, "127.0.0.2"), WorkerEndpoint(1, "127.0.0.2")), slice_index=i)
              for i in range(2)]
    info = ClusterInfo(address="127.0.0.2:1", temp_dir=str(tmp_path / "ray"), token_path=None, emulated=True,
                       slices=slices)
    (tmp_path / "w").mkdir()
    write_scripts(tmp_path / "w", {"train.py": f"import {framework}\n"})
    req = run.LaunchRequest(script=str(tmp_path / "w" / "train.py"), workdir=str(tmp_path / "w"),
                            log_dir=str(tmp_path / "runs"), framework=framework, address="auto")
    plan = prepare(req, run.Target(info), recorded_slices(info), None).plan
    spare = spare_plan(info, framework)
    assert len(plan.hosts) == len(spare.hosts) == 4
    for i in range(4):
        assert split_env(spare.state(i))[0] == split_env(plan.state(i))[0]
