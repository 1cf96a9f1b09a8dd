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
    extra = "torch_xla"
    import_name = "torch_xla"

    def emulation_env(self, topology: "Topology", num_slices: int) -> dict[str, str]:
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(topology.devices * num_slices)}

    def preload(self) -> None:
        import torch.distributed  # noqa: F401
        import torch_xla  # noqa: F401
        import torch_xla.core.xla_model  # noqa: F401
        import torch_xla.distributed.parallel_loader  # noqa: F401
        import torch_xla.distributed.spmd  # noqa: F401
        import torch_xla.experimental.distributed_checkpoint  # noqa: F401
        import torch_xla.runtime  # noqa: F401

    def boot(self, state: "HostState") -> None:
        import torch_xla  # noqa: F401  (registers the XLA device)
        import torch_xla.runtime as xr

        from tpulaunch.host.frameworks import torch_dist

        xr.use_spmd()
        xr.use_spmd = _spmd_already_on(xr.use_spmd)
        _save_each_local_shard_once()
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

    def build_mesh(self, plan: "MeshPlan", state: "HostState") -> Any:
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

    create_local_plan.__tpulaunch__ = True  # type: ignore[attr-defined]
    planners.SPMDSavePlanner.create_local_plan = create_local_plan


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


def runtime_device_ids(plan: "MeshPlan", attributes: list[dict]) -> list[int]:
    """Map plan device ids (row-major mesh order) to runtime device ordinals.

    TPU devices report `coords`, `core_on_chip` and, on multislice, `slice_index`; we match on
    those, so the mesh is right whatever order PJRT numbered the devices in. CPU devices carry
    no coordinates: in emulation the ordinal *is* the plan id.
    """
    if not attributes or "coords" not in attributes[0]:
        return plan.device_ids()
    return plan.match_physical(attributes, "the runtime")


ADAPTER = TorchXLA()
