"""Leave every host of a cluster with a spare process ready, before any run (`cluster up`).

After each run on a cluster that stays up, the host agents start spares themselves. Right after
`cluster up` there has been no run yet: this starts the agents and their spares with the
environment a plain `tpulaunch run SCRIPT` of that slice gets, so the first run is warm too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from tpulaunch.cluster.connect import connect, disconnect
from tpulaunch.cluster.ports import free_port
from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.host import frameworks
from tpulaunch.host.agent import agent_for
from tpulaunch.plan.frameworks import facts as fw_facts
from tpulaunch.plan.frameworks import ports as plan_ports
from tpulaunch.plan.launch import LaunchPlan, build_plan
from tpulaunch.plan.mesh import plan_mesh

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from tpulaunch.host.agent import HostAgent


def spare_plan(info: ClusterInfo, framework: str = "torch_xla") -> LaunchPlan:
    """The plan a plain `tpulaunch run SCRIPT` on this cluster gets, as far as a spare's environment
    goes: planned as `prepare` plans it (its ports by the same rule), so the spares `cluster up`
    starts are the ones the first run's hosts take."""
    slices = list(info.slices)
    topo = slices[0].to_topology()
    fw = frameworks.get(framework)
    ports = plan_ports(fw_facts(framework), local=info.emulated, emulated=info.emulated, command=False, base=None,
                       free=free_port)
    return build_plan(
        slices=slices, mesh=plan_mesh(topo, num_slices=len(slices)), script="-", framework=framework, run_id="-",
        coordinator_port=ports.coordinator, group_port=ports.group, jax_coordinator_port=ports.jax,
        emulated=info.emulated, emulation_env=fw.emulation_env(topo, len(slices)), emulation_port=ports.emulation,
        exit_port=ports.exit, local=info.emulated, metadata_server=not info.emulated, log_dir="-", workdir="-",
    )


def prewarm_cluster(info: ClusterInfo, framework: str = "torch_xla", timeout_s: float = 60.0) -> int:
    """Start every host's agent with a spare importing `framework`; returns how many hosts."""
    plan = spare_plan(info, framework)
    connect(info)  # before importing Ray: it reads its auth settings from the environment
    import ray

    try:
        refs = [cast("ActorHandle[HostAgent]", agent_for(h.slice_name, h.worker_id)).prewarm.remote(state)
                for h, state in zip(plan.hosts, plan.states(), strict=True)]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    finally:
        disconnect()
    return len(plan.hosts)
