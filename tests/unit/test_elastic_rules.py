"""Elastic multislice (`--min-slices`): the plan of a smaller fleet and the policy, as pure rules.

The plan a run shrinks to must be the plan a fresh run on those slices would get: every host's
environment (and, for torch_tpu, every process's) is compared with `build_plan` of the smaller
fleet, so nothing of the attempt before (slice ids, `MEGASCALE_*`, process indices, world sizes,
the emulation's device counts) is carried over.
"""

from __future__ import annotations

import pytest

from tpulaunch.errors import LaunchError, MeshError
from tpulaunch.host import frameworks
from tpulaunch.host.context import RunContext
from tpulaunch.plan import topology as T
from tpulaunch.plan import torch_tpu
from tpulaunch.plan.launch import build_plan
from tpulaunch.plan.mesh import plan_mesh, resize_slices
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
from tpulaunch.run import policy
from tpulaunch.run.recovery import elastic
from tpulaunch.run.summary import Attempt, Cause, HostResult, Outcome

pytestmark = pytest.mark.unit

RUN = "20261125-000000-abcd"


def _slices(topo: T.Topology, names: list[str], emulated: bool) -> list[SliceSpec]:
    if emulated:
        return [SliceSpec.emulated_from(topo, n, i) for i, n in enumerate(names)]
    return [SliceSpec(name=n, accelerator_type=topo.accelerator_type, topology=topo.topology, source="tpu-api",
                      workers=tuple(WorkerEndpoint(w, f"10.{ord(n) - ord('a')}.0.{w + 2}") for w in range(topo.num_hosts)),
                      slice_index=i) for i, n in enumerate(names)]


def _plan(topo, names, fw, emulated, dcn):
    slices = _slices(topo, names, emulated)
    return build_plan(
        slices=slices, mesh=plan_mesh(topo, None, dcn, len(slices)), script="t.py", framework=fw, run_id=RUN,
        coordinator_port=9000, group_port=9001, jax_coordinator_port=9002 if fw == "jax" else None,
        emulated=emulated, emulation_env=frameworks.get(fw).emulation_env(topo, len(slices)),
        emulation_port=9003 if emulated else None, metadata_server=not emulated, log_dir="/l", workdir="/w",
        user_env={"FOO": "bar"})


@pytest.mark.parametrize("fw", ["torch_xla", "jax", "torch_tpu"])
@pytest.mark.parametrize("emulated", [True, False])
@pytest.mark.parametrize("keep", [["b"], ["a", "c"], ["c"]])
def test_a_shrunk_plan_is_a_fresh_plan_of_the_smaller_fleet(fw, emulated, keep):
    topo = T.resolve(accelerator="v5p-16")
    full = _plan(topo, ["a", "b", "c"], fw, emulated, "data=3")
    small = full.on_fleet(keep, frameworks.get(fw).emulation_env(topo, len(keep)))
    fresh = _plan(topo, keep, fw, emulated, f"data={len(keep)}")
    if not emulated:  # a fresh run on these slices meets on the first one's worker 0: so does the shrunk one
        assert small.endpoints.host == fresh.endpoints.host
    assert small.mesh == fresh.mesh and [s.to_dict() for s in small.slices] == [s.to_dict() for s in fresh.slices]
    assert len(small.hosts) == len(fresh.hosts) == topo.num_hosts * len(keep)
    for h in fresh.hosts:
        assert small.env(h.process_index) == fresh.env(h.process_index), (fw, keep, h.process_index)
        if fw == "torch_tpu":
            assert [p.env for p in torch_tpu.processes(small.state(h.process_index))] == \
                   [p.env for p in torch_tpu.processes(fresh.state(h.process_index))]
    if len(keep) == 1:
        assert not any(k.startswith("MEGASCALE") for k in small.env(0))
    ctx = RunContext(small.for_attempt(1, reason="shrink").state(0))
    assert (ctx.num_slices, ctx.full_num_slices, ctx.attempt_reason) == (len(keep), 3, "shrink")


def test_growing_back_is_the_full_plan_again():
    topo = T.resolve(accelerator="v5p-16")
    full = _plan(topo, ["a", "b"], "jax", False, "data=2")
    small = full.on_fleet(["b"], {})
    assert small.env(0)["TPU_NAME"] == "b" and small.env(0)["TPU_WORKER_HOSTNAMES"] == "10.1.0.2,10.1.0.3"
    grown = full.for_attempt(2, reason="grow")
    assert all(grown.env(h.process_index) == {**full.env(h.process_index), "TPULAUNCH_RESTART_COUNT": "2"}
               for h in full.hosts)
    assert RunContext(grown.state(3)).attempt_reason == "grow"


def test_the_mesh_shrinks_along_its_dcn_axis_only():
    topo = T.resolve(accelerator="v5p-16")
    mesh = plan_mesh(topo, "data=2,model=4", "data=4", 4)
    small = resize_slices(mesh, 3)
    assert small.shape == (6, 4) and small.dcn_shape == (3, 1) and small.num_slices == 3
    assert small.num_devices == 3 * topo.devices and len(small.device_ids()) == 3 * topo.devices
    spread = plan_mesh(topo, "data=2,model=4", "data=2,model=2", 4)
    with pytest.raises(MeshError, match="no one axis across"):
        resize_slices(spread, 2)


def test_min_slices_is_checked_against_the_run():
    topo = T.resolve(accelerator="v5p-16")
    plan = _plan(topo, ["a", "b"], "jax", True, "data=2")
    elastic.check(plan, 1)
    for bad in (0, 3):
        with pytest.raises(LaunchError, match="is not between 1 and the run's 2"):
            elastic.check(plan, bad)
    spread = build_plan(slices=_slices(topo, ["a", "b", "c", "d"], True),
                        mesh=plan_mesh(topo, "data=2,model=4", "data=2,model=2", 4), script="t.py", framework="jax",
                        run_id=RUN, coordinator_port=1, emulated=True, log_dir="/l", workdir="/w")
    with pytest.raises(LaunchError, match="one mesh axis to shrink"):
        elastic.check(spread, 2)


def _attempt(outcome: Outcome, slices: int, lost: int = 1) -> Attempt:
    hosts = [HostResult(i, i, 0) for i in range(slices)]
    for h in hosts[:lost]:
        h.lost, h.cause, h.reason = True, Cause.NODE_LOST, "node lost"
    a = Attempt(0, outcome, 75, hosts, "/l", first_failure=hosts[0] if lost else None)
    a.slices = [f"s{i}" for i in range(slices)]
    return a


@pytest.mark.parametrize("outcome,min_slices,whole,want", [
    (Outcome.LOST, 1, 1, policy.Action.SHRINK),  # 2 slices, one lost: go on with one
    (Outcome.PREEMPTED, 2, 2, policy.Action.SHRINK),  # 3 slices, one lost, 2 needed
    (Outcome.LOST, 2, 1, policy.Action.WAIT_FOR_SLICE),  # fewer left than --min-slices: wait for all
    (Outcome.LOST, 0, 1, policy.Action.WAIT_FOR_SLICE),  # not elastic
    (Outcome.LOST, 1, 0, policy.Action.WAIT_FOR_SLICE),  # every slice hit
    (Outcome.GROWN, 1, 2, policy.Action.GROW),
])
def test_policy_shrinks_counts_it_and_grows_for_free(outcome, min_slices, whole, want):
    n = 3 if whole == 2 else 2
    a = _attempt(outcome, n, lost=0 if outcome is Outcome.GROWN else 1)
    d = policy.decide(a, policy.Budgets(max_preemptions=2, min_slices=min_slices), policy.Spent(0, 1), whole)
    assert d.action is want
    assert d.spent.preemptions == (1 if want is policy.Action.GROW else 2)


def test_a_shrink_needs_the_preemption_budget():
    d = policy.decide(_attempt(Outcome.LOST, 2), policy.Budgets(max_preemptions=1, min_slices=1), policy.Spent(0, 1), 1)
    assert d.action is policy.Action.FINISH and "--max-preemptions 1 spent" in d.why


def test_a_spare_being_made_again_is_not_swapped_in():
    """A hung slice a spare replaced is on record as a spare at once, and alive in Ray until its
    replacement (in the background) takes it down: a swap meanwhile must not pick it (nor one busy,
    broken or of another shape)."""
    import threading

    from tpulaunch.discover.ray_labels import RaySlice
    from tpulaunch.run.recovery.elastic import Background
    from tpulaunch.run.recovery.resize import free_spares

    topo = T.resolve(topology="2x2x2", accelerator="v4")

    def sl(name, pod="v4-16", topology="2x2x2", alive=(True, True), busy=(False, False)):
        return RaySlice(name, pod, topology, tuple((w, f"10.0.0.{w}", alive[w], busy[w]) for w in range(2)))

    slices = [sl("hung"), sl("spare-0"), sl("busy", busy=(False, True)), sl("broken", alive=(True, False)),
              sl("small", "v4-8", "2x2x1")]
    names = ["hung", "busy", "broken", "small", "spare-0"]
    assert [s.name for s in free_spares(names, slices, topo)] == ["hung", "spare-0"]
    release = threading.Event()
    making = Background("slice(s) hung made again as spares", release.wait, lambda _line: None, slices=["hung"])
    assert making.healing() == {"hung"}
    assert [s.name for s in free_spares(names, slices, topo, making.healing())] == ["spare-0"]
    release.set()
    assert making.done.wait(5) and making.healing() == set()
