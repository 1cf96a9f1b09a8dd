"""torch_xla (PJRT) SPMD adapter.

One process per TPU host drives all of the host's chips. The runtime must not be touched
before `xr.use_spmd()`, and the `Mesh` is only built here, in the training process, from the
pickled MeshPlan (building it anywhere else would initialize PJRT and hold the chips).

Emulation: several CPU processes cannot form one XLA runtime, so each emulated host holds as
many CPU devices as the whole launch (`CPU_NUM_DEVICES`) and runs the full SPMD program; the
global mesh validates exactly as on the TPU, and `torch_xla_emulation` makes the runtime answer
as host `i` of `N` would. The gloo process group across hosts is real (`torch_dist`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from tpulaunch.errors import MeshMismatchError

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState
    from tpulaunch.plan.mesh import MeshPlan
    from tpulaunch.plan.topology import Topology


class TorchXLA:
    name = "torch_xla"

    def emulation_env(self, topology: Topology, num_slices: int) -> dict[str, str]:
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(topology.devices * num_slices)}

    def preload(self) -> None:
        import torch.distributed  # noqa: F401 - preload: importing is the point
        import torch_xla
        import torch_xla.core.xla_model
        import torch_xla.distributed.parallel_loader
        import torch_xla.distributed.spmd
        import torch_xla.experimental.distributed_checkpoint
        import torch_xla.runtime  # noqa: F401 - preload: importing is the point

    def boot(self, state: HostState) -> None:
        import torch_xla  # noqa: F401 - registers the XLA device
        import torch_xla.runtime as xr

        from tpulaunch.host.frameworks import torch_dist

        xr.use_spmd()
        xr.use_spmd = _spmd_already_on(xr.use_spmd)
        _save_each_local_shard_once()
        _checkpoint_plans_wait_for_the_step_in_flight()
        _async_checkpoints_copy_host_tensors()
        if state.job.compile_cache:
            # Only when asked for (`--compile-cache DIR`): torch_xla 2.9 cannot load what it caches
            # (pytorch/xla#9094), so there is no default; a fixed torch_xla gets it from the flag.
            path = os.path.expanduser(state.job.compile_cache)
            os.makedirs(path, exist_ok=True)
            xr.initialize_cache(path)
        if state.emulated:
            from tpulaunch.host.frameworks import torch_xla_emulation

            torch_xla_emulation.install(state)
        elif xr.process_count() != state.num_processes or xr.process_index() != state.process_index:
            # On a real slice libtpu forms one runtime over all hosts; its view must be ours.
            raise MeshMismatchError(
                f"torch_xla runtime reports process {xr.process_index()} of {xr.process_count()},"
                f" but tpulaunch launched process {state.process_index} of {state.num_processes}",
                "the slice tpulaunch planned is not the slice libtpu sees; check --tpu/--topology",
            )
        if state.job.distributed:
            torch_dist.init_slice_group(state)

    def build_mesh(self, plan: MeshPlan, state: HostState) -> Any:
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        from tpulaunch.host.frameworks import check_size

        check_size("the runtime", xr.global_runtime_device_count(), "devices", plan)
        ids = runtime_device_ids(plan, xr.global_runtime_device_attributes())
        mesh = xs.Mesh(np.array(ids), plan.shape, plan.axis_names)
        xs.set_global_mesh(mesh)
        return mesh

    def shutdown(self) -> None:
        from tpulaunch.host.frameworks import torch_dist

        torch_dist.shutdown()


def _save_each_local_shard_once() -> None:
    """Distributed checkpoints keep every shard, also when a host holds several replicas of one.

    torch_xla's `SPMDSavePlanner` lists one write item per local device; replicas of a shard get
    equal `MetadataIndex`es (its shard number is not compared), and torch's `dedup_tensors` then
    drops *every* copy of such a key from that host's plan, the first one too: the shard is not
    saved at all. That happens on a TPU host holding two replicas of a shard (a `(None, ...)` axis
    inside the host), and always on an emulated host, which holds every device of the slice.
    Keeping the first of equal items in the local plan saves each shard once, as intended.
    """
    import dataclasses
    import functools

    import torch_xla.experimental.distributed_checkpoint.planners as planners

    original = planners.SPMDSavePlanner.create_local_plan
    if getattr(original, "__tpulaunch__", False):
        return

    @functools.wraps(original)
    def create_local_plan(self: Any) -> Any:
        plan = original(self)
        seen: set = set()
        items = []
        for item in plan.items:
            if item.index not in seen:
                seen.add(item.index)
                items.append(item)
        return dataclasses.replace(plan, items=items)

    create_local_plan.__tpulaunch__ = True  # type: ignore[attr-defined]  # our mark: patched once
    planners.SPMDSavePlanner.create_local_plan = create_local_plan  # type: ignore[method-assign]  # patched on purpose


def _checkpoint_plans_wait_for_the_step_in_flight() -> None:
    """`dist_cp.save` / `dist_cp.load` with the SPMD planners wait for the step in flight first.

    A torch_xla bug (2.9 and master), not the emulation's (its shared devices, the dedup above, the
    preemption sync): it fails directly on CPU with no tpulaunch (one `PJRT_DEVICE=CPU` process,
    `CheckpointManager(..., chkpt_on_preemption=False)`: `restore` right after a training step's
    sync failed 14 of 60 times; the guide's plain `dist_cp.save` / `dist_cp.load` 9 and 13 of 30),
    and never with `XLA_SYNC_WAIT=1` or `xm.wait_device_ops()` before the restore (0 of 60 each).
    More devices per process widen the window (an emulated host holds the whole slice's): on the
    emulated v5e 2x8, 8 of 8 such restores failed. (On a TPU the window is the time the step takes
    to be dispatched: shorter, not measured here.)

    `torch_xla.sync()` only schedules the step: each live tensor's data becomes a *placeholder*
    (torch_xla v2.9.0 `csrc/xla_graph_executor.cpp` 1066 `CreateDataPlaceholder`, 1038 set as the
    tensor's handle) that a thread-pool thread fills when the execution call returns
    (`ScheduleSyncTensorsGraph`: 1170 `Assign`, 1192 `thread::Schedule`). Reads through a tensor
    wait for it by taking the device lock (`tensor.cpp` 518 `ToTensor`, 677 `ApplyPendingGraph`:
    `DeviceBarrier`). The planners' reads do not: `create_local_plan` asks
    `_get_local_shard_replica_and_indices` (`experimental/distributed_checkpoint/planners.py` 326
    for a save, 383 for a load), whose binding calls `GetXlaData()` with no barrier
    (`init_python_bindings.cpp` 2879; `_get_local_shards`, behind `local_shards`, at 2820/2826
    likewise), and `GetXlaData` fails on a placeholder not filled yet (`tensor.cpp` 224: "Trying to
    access XLA data for tensor with ID ... while an async operation is in flight").
    `CheckpointManager.save` and `save_async` wait first (`manager.py` 212-214 `_wait_for_data`,
    called at 277 and 306: pytorch/xla PR #5770); `restore` (316-335) and the guide's plain
    `dist_cp.save` / `dist_cp.load` do not, so a restore right after a training step, or a plain
    save right after one, fails now and then.

    So before a planner reads a state dict holding XLA tensors, wait for the executions in flight:
    `xm.wait_device_ops()` takes the SPMD device's lock (`xla_graph_executor.cpp` 466-488), which
    the scheduled execution holds until it has filled its placeholders. Nothing is synced that the
    script did not sync (tensors with pending IR are computed by `GetXlaData` itself, waiting). A
    state dict already on the CPU (`save_async`'s, written on the manager's thread) does not wait.
    """
    import functools

    import torch_xla.experimental.distributed_checkpoint.planners as planners

    def holds_device_data(*state_dicts: Any) -> bool:
        import torch

        return any(isinstance(v, torch.Tensor) and v.device.type == "xla"
                   for sd in state_dicts if sd for v in sd.values())

    for cls in (planners.SPMDSavePlanner, planners.SPMDLoadPlanner):
        original = cls.create_local_plan
        if getattr(original, "__tpulaunch_waits__", False):
            continue

        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def create_local_plan(self: Any) -> Any:
                if holds_device_data(self.sharded_state_dict, self.unsharded_state_dict):
                    import torch_xla.core.xla_model as xm

                    xm.wait_device_ops()
                return original(self)

            create_local_plan.__tpulaunch_waits__ = True  # type: ignore[attr-defined]  # our mark: patched once
            return create_local_plan

        cls.create_local_plan = wrap(original)  # type: ignore[method-assign]  # patched on purpose


def _async_checkpoints_copy_host_tensors() -> None:
    """`CheckpointManager.save_async` writes the state dict's CPU tensors as they were at the call.

    A torch_xla bug too (directly on CPU, no tpulaunch: in 10 of 10 `save_async` checkpoints of a
    loop that saves every other step, Adam's step counter was the next step's; 0 of 10 with this
    copy). `save_async` moves the state dict
    to the CPU (`manager.py` 308, `_helpers.py` 244-277) and writes it on the manager's thread
    (`manager.py` 310). XLA tensors are copied; a tensor already on the CPU is not: it goes
    through `_xla_get_cpu_tensors` (`_helpers.py` 264; `aten_xla_bridge.cpp` 236-241 passes a
    non-XLA tensor back as it is), so the thread later writes the live tensor. Adam keeps `step` on
    the CPU (torch `optim/adam.py` 174) and `optimizer.step()` adds 1 to it in place (406, 673),
    usually before the thread gets to it: a restore then resumes with the next step's bias
    correction. Each CPU tensor is copied here, at the call, as the XLA ones are.
    """
    import functools

    import torch_xla.experimental.distributed_checkpoint.manager as manager

    original = manager._sharded_cpu_state_dict  # the name `save_async` calls (manager.py 22, 308)
    if getattr(original, "__tpulaunch__", False):
        return

    @functools.wraps(original)
    def _sharded_cpu_state_dict(state_dict: Any) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten

        out = original(state_dict)
        given, _ = tree_flatten(state_dict)
        leaves, spec = tree_flatten(out)
        if len(given) != len(leaves):  # not the one-to-one map torch_xla 2.9 makes: leave it
            return out
        return tree_unflatten([v.clone() if isinstance(g, torch.Tensor) and g.device.type == "cpu"
                               and isinstance(v, torch.Tensor) else v
                               for g, v in zip(given, leaves, strict=True)], spec)

    _sharded_cpu_state_dict.__tpulaunch__ = True  # type: ignore[attr-defined]  # our mark: patched once
    manager._sharded_cpu_state_dict = _sharded_cpu_state_dict


def _spmd_already_on(original: Any) -> Any:
    """The script's own `xr.use_spmd()` finds SPMD on (tpulaunch turned it on first): say nothing.

    Without this, torch_xla would warn that `XLA_USE_SPMD` is deprecated, because the first call
    set that variable; on the slice the script's call is the first and says nothing.
    """
    import functools

    @functools.wraps(original)
    def use_spmd(auto: bool | None = False) -> None:
        import torch_xla.runtime as xr

        if xr.is_spmd() and not auto:
            return None
        return original(auto)

    return use_spmd


def runtime_device_ids(plan: MeshPlan, attributes: list[dict]) -> list[int]:
    """Map plan device ids (row-major mesh order) to runtime device ordinals.

    TPU devices report `coords`, `core_on_chip` and, on multislice, `slice_index`; we match on
    those, so the mesh is right whatever order PJRT numbered the devices in. CPU devices carry
    no coordinates: in emulation the ordinal *is* the plan id.
    """
    if not attributes or "coords" not in attributes[0]:
        return plan.device_ids()
    return plan.match_physical(attributes, "the runtime")


ADAPTER = TorchXLA()
