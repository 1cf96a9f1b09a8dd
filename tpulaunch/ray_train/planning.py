"""A Ray Train worker group planned as the slice it runs on: what each worker reports of its node
(`WorkerFacts`) and the plan made from that (`plan_for_workers`). Pure, and imports no Ray: the
backends (`backends.py`) ask the workers in Ray Train's controller and call it; the unit tier
tests it as it is."""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass

from tpulaunch.discover.ray_labels import POD_TYPE, SLICE, WORKER
from tpulaunch.errors import LaunchError
from tpulaunch.host import frameworks
from tpulaunch.plan.contract import HostState
from tpulaunch.plan.frameworks import facts as fw_facts
from tpulaunch.plan.launch import LaunchPlan, build_plan, default_compile_cache
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

_ONE_PER_DEVICE = ("torch_tpu runs one process per TPU device: set resources_per_worker={'TPU': 1} and"
                   " num_workers = devices of every slice")
_ONE_PER_HOST = ("tpulaunch runs one process per TPU host: set resources_per_worker={'TPU': <chips per host>}"
                 " and num_workers = hosts x slices")


@dataclass(frozen=True)
class WorkerFacts:
    """Where one Ray Train worker runs, as its node's labels say."""

    rank: int  # Ray Train's world rank: placement order, used only to address the worker
    ip: str
    slice_name: str | None
    worker_id: int | None
    pod_type: str | None  # e.g. v6e-16
    topology: str | None  # e.g. 2x8
    tpu_devices: bool  # the node has TPU device files: a real TPU host


def plan_for_workers(
    facts: list[WorkerFacts], *, framework: str, mesh: str | None, dcn: str | None, run_id: str,
    ports: list[int], attempt: int = 0, compile_cache: str | bool = True, log_dir: str = "", placement: str = "auto",
) -> tuple[LaunchPlan, dict[int, HostState]]:
    """Plan the launch for a worker group: the LaunchPlan and each rank's HostState. Pure.

    `ports` are three free ports on the process-0 worker's node (gloo, JAX coordinator, the
    emulated hosts' store). Raises LaunchError when the workers are not one per host of whole slices.
    """
    if not facts:
        raise LaunchError("the Ray Train worker group is empty", "set ScalingConfig(num_workers=...)")
    for f in facts:
        if f.slice_name is None or f.worker_id is None:
            raise LaunchError(
                f"Ray Train worker {f.rank} runs on node {f.ip}, which has no TPU labels ({SLICE}, {WORKER})",
                "use ScalingConfig(use_tpu=True, topology=..., accelerator_type=...) on a TPU cluster"
                " (`tpulaunch cluster up --topology 2x8` emulates one)")
    names = sorted({f.slice_name for f in facts if f.slice_name})  # Ray Train's slice order too
    kinds = {(f.pod_type, f.topology) for f in facts}
    if len(kinds) != 1:
        raise LaunchError(f"the workers run on different kinds of slices: {sorted(map(str, kinds))}",
                          "train on slices of one accelerator type and topology")
    pod_type, topo_text = kinds.pop()
    if not pod_type:
        raise LaunchError(f"the TPU hosts carry no {POD_TYPE} label", "start Ray on the TPU hosts with their TPU env")
    fw = frameworks.get(framework)
    per_device = fw_facts(framework).per_device
    slices = []
    for index, name in enumerate(names):
        mine = sorted((f for f in facts if f.slice_name == name), key=lambda f: f.worker_id or 0)
        if per_device:  # a host's workers are its devices: one endpoint per host
            endpoints = tuple(WorkerEndpoint(w, ip) for w, ip in {f.worker_id or 0: f.ip for f in mine}.items())
        else:
            endpoints = tuple(WorkerEndpoint(f.worker_id or 0, f.ip) for f in mine)
        slices.append(SliceSpec(
            name=name, accelerator_type=pod_type, topology=topo_text or "", source="ray",
            workers=endpoints, slice_index=index, emulated=not any(f.tpu_devices for f in facts)))
    topology = slices[0].to_topology()
    for s in slices:
        ids = [w.worker_id for w in s.workers]
        if ids != list(range(topology.num_hosts)):
            raise LaunchError(
                f"slice {s.name} ({topology.accelerator_type}, {topology.num_hosts} hosts) has Ray Train workers"
                f" on TPU workers {ids}", _ONE_PER_DEVICE if per_device else _ONE_PER_HOST)
    if per_device:
        counts = collections.Counter((f.slice_name, f.worker_id) for f in facts)
        for (slice_name, wid), n in sorted(counts.items()):
            if n != topology.devices_per_host:
                raise LaunchError(f"TPU worker {wid} of slice {slice_name} has {n} Ray Train workers, not one per"
                                  f" device ({topology.devices_per_host})", _ONE_PER_DEVICE)
    emulated = slices[0].emulated
    plan = build_plan(
        slices=slices, mesh=plan_mesh(topology, mesh, dcn, len(slices), placement), script="<ray-train>",
        framework=framework, run_id=run_id, coordinator_port=ports[0],
        jax_coordinator_port=ports[1] if fw_facts(framework).jax_coordinator else None,
        emulated=emulated, emulation_env=fw.emulation_env(topology, len(slices)),
        emulation_port=ports[2] if emulated else None, metadata_server=not emulated,
        log_dir=log_dir, workdir=os.getcwd(),
        compile_cache=(default_compile_cache(framework, topology, len(slices), emulated) if compile_cache is True
                       else compile_cache or None),
    ).for_attempt(attempt)
    by_host: dict[tuple[str | None, int | None], int] = {(h.slice_name, h.worker_id): h.process_index
                                                         for h in plan.hosts}
    states = {f.rank: plan.state(by_host[(f.slice_name, f.worker_id)]) for f in facts}
    return plan, states


def local_indices(facts: list[WorkerFacts]) -> dict[int, int]:
    """One process per device (torch_tpu): each worker's device on its host, its place among the
    host's workers in Ray's rank order. Pure."""
    by_host: dict[tuple, list[int]] = {}
    for f in sorted(facts, key=lambda f: f.rank):
        by_host.setdefault((f.slice_name, f.worker_id), []).append(f.rank)
    return {rank: i for ranks in by_host.values() for i, rank in enumerate(ranks)}
