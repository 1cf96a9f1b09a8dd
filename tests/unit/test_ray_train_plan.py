"""Ray Train's worker group planned as a slice (`ray_train.plan_for_workers`): a pure function."""

from __future__ import annotations

import pytest

from tpulaunch.errors import LaunchError, MeshError
from tpulaunch.ray_train import WorkerFacts, plan_for_workers  # pure: no Ray Train (ray_train/planning.py)


def _facts(order: list[int], slices: tuple[str, ...] = ("s",), pod="v6e-16", topo="4x4", tpu=False) -> list[WorkerFacts]:
    """Workers in rank order, placed on (slice, worker id) in `order` (index into all hosts)."""
    hosts = [(s, w) for s in slices for w in range(len(order) // len(slices))]
    return [WorkerFacts(rank=r, ip=f"10.0.0.{10 + i}", slice_name=hosts[i][0], worker_id=hosts[i][1],
                        pod_type=pod, topology=topo, tpu_devices=tpu) for r, i in enumerate(order)]


def test_process_index_is_the_tpu_worker_id_not_the_rank():
    facts = _facts([3, 0, 1, 2])
    plan, states = plan_for_workers(facts, framework="torch_xla", mesh=None, dcn=None, run_id="r", ports=[5001, 5002, 5003])
    assert {r: s.process_index for r, s in states.items()} == {0: 3, 1: 0, 2: 1, 3: 2}
    assert all(s.worker_id == s.process_index for s in states.values())
    assert plan.coordinator_address == "10.0.0.10:5001"  # process 0 (worker 0) is rank 1, on 10.0.0.10
    assert plan.emulated and plan.mesh.shape == (4, 4) and plan.mesh.axis_names == ("data", "model")
    env = {h.process_index: plan.env(h.process_index) for h in plan.hosts}
    assert [env[i]["TPU_WORKER_ID"] for i in range(4)] == ["0", "1", "2", "3"]
    assert env[2]["RANK"] == "2" and env[2]["PJRT_DEVICE"] == "CPU" and env[2]["CPU_NUM_DEVICES"] == "16"
    assert env[0]["TPULAUNCH_EMULATION_PORT"] == "5003"


def test_multislice_is_slice_major_in_slice_name_order():
    facts = _facts([5, 4, 0, 1, 3, 2, 7, 6], slices=("b", "a"), pod="v4-32", topo="2x2x4")
    plan, states = plan_for_workers(facts, framework="jax", mesh=None, dcn="data=2", run_id="r", ports=[1, 2, 3])
    by_proc = {s.process_index: (s.slice_name, s.worker_id) for s in states.values()}
    assert by_proc == {p: ("ab"[p // 4], p % 4) for p in range(8)}
    assert [plan.env(h.process_index)["MEGASCALE_SLICE_ID"] for h in plan.hosts] == ["0"] * 4 + ["1"] * 4
    assert plan.env(0)["JAX_COORDINATOR_ADDRESS"] == f"{plan.hosts[0].ip}:2"
    assert plan.hosts[0].slice_name == "a" and plan.mesh.shape[0] == 2 * 4


def test_restart_attempt_is_counted_and_real_tpus_are_not_emulated():
    plan, states = plan_for_workers(_facts([0, 1, 2, 3], tpu=True), framework="torch_xla", mesh="data=2,model=8",
                                    dcn=None, run_id="r", ports=[1, 2, 3], attempt=2)
    assert not plan.emulated and plan.env(0)["PJRT_DEVICE"] == "TPU"
    assert "TPU_SKIP_MDS_QUERY" not in plan.env(0)  # real hosts ask their metadata server
    assert {s.attempt for s in states.values()} == {2}
    assert plan.mesh.shape == (2, 8)


@pytest.mark.parametrize("facts, words", [
    (_facts([0, 1, 2, 3])[:3], "has Ray Train workers on TPU workers [0, 1, 2]"),  # a host without a worker
    ([*_facts([0, 1, 2, 3])[:3], WorkerFacts(3, "10.0.0.11", "s", 1, "v6e-16", "4x4", False)],
     "on TPU workers [0, 1, 1, 2]"),  # two workers on one host
    ([WorkerFacts(0, "10.0.0.1", None, None, None, None, False)], "which has no TPU labels"),
])
def test_workers_that_are_not_one_per_host_are_refused(facts, words):
    with pytest.raises(LaunchError) as e:
        plan_for_workers(facts, framework="torch_xla", mesh=None, dcn=None, run_id="r", ports=[1, 2, 3])
    assert words in e.value.line()


def test_bad_mesh_syntax_fails_on_the_driver():
    # here, not at the top: they import torch and Ray Train, 4 s that every pytest process of
    # `./scripts/test` would spend collecting the suite
    from tpulaunch.ray_train import JaxSpmdConfig, XlaSpmdConfig

    with pytest.raises(MeshError):
        XlaSpmdConfig(mesh="data=four")
    with pytest.raises(MeshError):
        JaxSpmdConfig(dcn="data")
    assert XlaSpmdConfig().backend  # non-empty: TorchTrainer must not swap in "tpu_dist"


def test_a_worker_of_a_one_slice_fit_keeps_none_of_its_nodes_slices():
    """On a multislice pod the node's MEGASCALE_* name its job's slices, not this fit's: a worker booted
    for one slice has none of them (libtpu would wait for the others), as a `tpulaunch run` host has none."""
    import os
    import pickle
    from unittest import mock

    from tpulaunch.host import context as ctx_mod
    from tpulaunch.plan.env import PLAN_MULTISLICE_ENV
    from tpulaunch.ray_train import backends

    facts = [WorkerFacts(rank=r, ip=f"10.0.0.{r}", slice_name="s", worker_id=r, pod_type="v5p-16", topology="2x2x2",
                         tpu_devices=False) for r in range(2)]
    plan, states = plan_for_workers(facts, framework="none", mesh=None, dcn=None, run_id="r", ports=[1, 2, 3])
    pod = {"MEGASCALE_COORDINATOR_ADDRESS": "10.9.9.9", "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
           "MEGASCALE_PORT": "8080", "MEGASCALE_GRPC_ENABLE_XOR_TRACER": "false"}
    with mock.patch.dict(os.environ, pod), mock.patch.dict(ctx_mod._STATE):
        assert backends._boot_worker(pickle.dumps(states[1]), plan.env(1)) is None
        assert [k for k in PLAN_MULTISLICE_ENV if k in os.environ] == []
        assert os.environ["TPU_WORKER_ID"] == "1" and os.environ["MEGASCALE_GRPC_ENABLE_XOR_TRACER"] == "false"


def test_torch_tpu_workers_are_grouped_by_host_one_per_device():
    from tpulaunch.plan import torch_tpu
    from tpulaunch.ray_train import local_indices

    # v5p-16: 2 hosts x 4 devices; Ray placed the 8 workers interleaved across the two hosts
    facts = [WorkerFacts(rank=r, ip=f"10.0.0.{r % 2}", slice_name="s", worker_id=r % 2, pod_type="v5p-16",
                         topology="2x2x2", tpu_devices=False) for r in range(8)]
    plan, states = plan_for_workers(facts, framework="torch_tpu", mesh=None, dcn=None, run_id="r", ports=[1, 2, 3])
    local = local_indices(facts)
    assert local == {0: 0, 2: 1, 4: 2, 6: 3, 1: 0, 3: 1, 5: 2, 7: 3}
    ranks = {r: torch_tpu.processes(states[r])[local[r]].rank for r in range(8)}
    assert ranks == {0: 0, 2: 1, 4: 2, 6: 3, 1: 4, 3: 5, 5: 6, 7: 7}  # host-major, whatever Ray's order
    assert [w.worker_id for w in plan.slices[0].workers] == [0, 1]
    with pytest.raises(LaunchError, match="has 3 Ray Train workers, not one per device"):
        plan_for_workers(facts[:7], framework="torch_tpu", mesh=None, dcn=None, run_id="r", ports=[1, 2, 3])
