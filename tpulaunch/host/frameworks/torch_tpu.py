"""TorchTPU (torch-tpu, PyTorch's native TPU backend) adapter: one process per TPU device.

The host process does not boot anything itself: `host/ranks.py` starts one child per device with
the contract `plan/torch_tpu.py` computed, and each child boots here: the default process group
over every rank of the job (`tpu_dist` on a TPU, `env://` from `MASTER_ADDR`/`MASTER_PORT`), then
the mesh, a `torch.distributed.device_mesh.DeviceMesh` over the ranks laid out by the plan.

Emulation: each child is a CPU process; the group is gloo and the mesh `DeviceMesh("cpu", ...)`
of the same shape, names and ranks. A script's own `init_process_group("tpu_dist")` (written for
the slice) is handed that group, so device-agnostic FSDP2 / DTensor code runs as it would on the
slice. What differs: no `tpu` device (tensors live on the CPU), no compiled collectives.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from tpulaunch.errors import LaunchError

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState
    from tpulaunch.plan.mesh import MeshPlan
    from tpulaunch.plan.topology import Topology

TPU_BACKENDS = ("tpu_dist", "tpu", "cpu:gloo,tpu:tpu_dist")  # what scripts for the slice ask for
AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"  # torch's switch for loading device backends at import
_DEFERRED = [False]  # torch was imported here with its backends held back: boot loads them


def device_type(state: HostState) -> str:
    return "cpu" if state.emulated else "tpu"


class TorchTPU:
    name = "torch_tpu"

    def emulation_env(self, topology: Topology, num_slices: int) -> dict[str, str]:
        # several processes share an emulated host's cores: one thread each, as torchrun sets
        return {"OMP_NUM_THREADS": "1", "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu"}

    def preload(self) -> None:
        """torch, without its device backends: with torch-tpu installed, `import torch` would load it
        (the `torch.backends` entry point), and it sets up the `tpu` device when it finds chips.
        This import is shared (a spare's, the host process's that forks one process per device):
        each device's process loads the backend itself, in its own environment (`boot`).

        Also what every FSDP2 / DTensor training process imports on its way: `fully_shard`, DCP,
        and torch._dynamo, which an optimizer's first `step()` imports (1.5 CPU-s here): once per
        host, not once per device (8 on a v7x host)."""
        if "torch" in sys.modules:
            return
        was = os.environ.get(AUTOLOAD)
        os.environ[AUTOLOAD] = "0"
        try:
            import torch
            import torch.distributed
            import torch.distributed.device_mesh  # noqa: F401 - a head start: importing is the point

            for head_start in ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint"):
                try:
                    importlib.import_module(head_start)
                except Exception:  # only a head start: a process that needs it says why
                    pass
        finally:
            if was is None:
                os.environ.pop(AUTOLOAD, None)
            else:
                os.environ[AUTOLOAD] = was
        _DEFERRED[0] = True

    def boot(self, state: HostState) -> None:
        import torch

        from tpulaunch.host.frameworks import torch_dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if _DEFERRED[0] and torch._is_device_backend_autoload_enabled():
            torch._import_device_backends()  # what `import torch` would have done in a fresh process
            _DEFERRED[0] = False
        if state.emulated:
            torch_dist.init_group("gloo", "env://", rank, world, also_satisfies=TPU_BACKENDS)
            return
        tpu = getattr(torch, "tpu", None)
        if tpu is None or not tpu.is_available():
            raise LaunchError(
                "torch has no usable 'tpu' device on this host (torch-tpu not installed, or no TPU found)",
                "pip install 'tpulaunch[torch_tpu]' in the hosts' environment (torch >= 2.11),"
                " or emulate with --topology",
            )
        torch_dist.init_group("tpu_dist", "env://", rank, world, also_satisfies=TPU_BACKENDS)

    def build_mesh(self, plan: MeshPlan, state: HostState) -> Any:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        from tpulaunch.host.frameworks import check_size

        check_size("the job", dist.get_world_size(), "processes", plan)
        # a rank is a device id of the plan (host-major, then local index): the grid is the mesh
        ranks = torch.tensor(plan.grid(), dtype=torch.int)
        return DeviceMesh(device_type(state), ranks, mesh_dim_names=tuple(plan.axis_names))

    def shutdown(self) -> None:
        from tpulaunch.host.frameworks import torch_dist

        torch_dist.shutdown()


ADAPTER = TorchTPU()
