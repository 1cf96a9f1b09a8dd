"""torch_xla (PJRT) SPMD adapter.

One process per TPU host drives all of the host's chips. The runtime must not be touched
before `xr.use_spmd()`, and the `Mesh` is only built here, in the training process, from the
pickled MeshPlan (building it anywhere else would initialize PJRT and hold the chips).

Emulation: several CPU processes cannot form one XLA runtime, so each emulated host holds as
many CPU devices as the whole launch (`CPU_NUM_DEVICES`) and runs the full SPMD program; the
global mesh validates exactly as on the TPU. The gloo process group across hosts is real.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any

from tpulaunch.errors import MeshMismatchError

if TYPE_CHECKING:
    from tpulaunch.plan.launch import HostState
    from tpulaunch.plan.mesh import MeshPlan
    from tpulaunch.plan.topology import Topology


class TorchXLA:
    name = "torch_xla"
    extra = "tpu"
    import_name = "torch_xla"

    def emulation_env(self, topology: "Topology", num_slices: int) -> dict[str, str]:
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(topology.devices * num_slices)}

    def boot(self, state: "HostState") -> None:
        import torch_xla  # noqa: F401  (registers the XLA device)
        import torch_xla.runtime as xr

        xr.use_spmd()
        if not state.emulated:
            # On a real slice libtpu forms one runtime over all hosts; its view must be ours.
            if xr.process_count() != state.num_processes or xr.process_index() != state.process_index:
                raise MeshMismatchError(
                    f"torch_xla runtime reports process {xr.process_index()} of {xr.process_count()},"
                    f" but tpulaunch launched process {state.process_index} of {state.num_processes}",
                    "the slice tpulaunch planned is not the slice libtpu sees; check --tpu/--topology",
                )
        if state.distributed:
            self._init_process_group(state)

    def _init_process_group(self, state: "HostState") -> None:
        import torch.distributed as dist

        addr = state.coordinator_address
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{addr}",
            rank=state.process_index,
            world_size=state.num_processes,
            timeout=datetime.timedelta(seconds=float(os.environ.get("TPULAUNCH_DIST_TIMEOUT", "300"))),
        )

    def build_mesh(self, plan: "MeshPlan", state: "HostState") -> Any:
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        n = xr.global_runtime_device_count()
        if n != plan.num_devices:
            raise MeshMismatchError(
                f"the runtime has {n} devices but the planned mesh {dict(zip(plan.axis_names, plan.shape))}"
                f" needs {plan.num_devices}",
                "the slice does not match --topology/--num-slices",
            )
        ids = runtime_device_ids(plan, xr.global_runtime_device_attributes())
        mesh = xs.Mesh(np.array(ids), plan.shape, plan.axis_names)
        xs.set_global_mesh(mesh)
        return mesh

    def shutdown(self) -> None:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


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
