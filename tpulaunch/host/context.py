"""What a launched script sees: `tpulaunch.get_mesh()`, `tpulaunch.context()`, `tpulaunch.heartbeat()`.

The host bootstrap (`tpulaunch/bootstrap.py`) installs these before the user's script runs.
Outside a launch they raise a clear error instead of returning something half-right.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpulaunch.errors import LaunchError
from tpulaunch.plan.mesh import MeshPlan

if TYPE_CHECKING:
    from tpulaunch.plan.launch import HostState


@dataclass(frozen=True)
class RunContext:
    """Facts about this process's place in the launch. Pure data."""

    run_id: str
    process_index: int  # = slice_index * hosts_per_slice + worker_id
    num_processes: int
    worker_id: int  # TPU worker id within the slice
    slice_index: int
    num_slices: int
    slice_name: str
    accelerator_type: str
    topology: str
    coordinator_address: str  # host:port of process 0 (torch.distributed / gloo)
    framework: str
    emulated: bool
    log_dir: str
    mesh_plan: MeshPlan
    restart_count: int = 0  # 0 on the first attempt; resume from your checkpoint when > 0

    @staticmethod
    def from_state(state: "HostState") -> "RunContext":
        """The context of the host a HostState describes."""
        return RunContext(
            run_id=state.run_id, process_index=state.process_index, num_processes=state.num_processes,
            worker_id=state.worker_id, slice_index=state.slice_index, num_slices=state.num_slices,
            slice_name=state.slice_name, accelerator_type=state.accelerator_type, topology=state.topology,
            coordinator_address=state.coordinator_address, framework=state.framework, emulated=state.emulated,
            log_dir=state.log_dir, mesh_plan=state.mesh, restart_count=state.restart_count,
        )

    @property
    def is_coordinator(self) -> bool:
        """True on process 0: the one that should log, save, and report."""
        return self.process_index == 0

    @property
    def rank(self) -> int:
        """torch.distributed's word for `process_index` (the rank in the slice's gloo group)."""
        return self.process_index

    @property
    def world_size(self) -> int:
        """torch.distributed's word for `num_processes` (one process per TPU host)."""
        return self.num_processes


_STATE: dict[str, Any] = {"ctx": None, "mesh": None}
HEARTBEAT_ENV = "TPULAUNCH_HEARTBEAT_FILE"  # the agent watches this file's mtime

_OUTSIDE = (
    "not running under tpulaunch",
    "launch the script with `tpulaunch run SCRIPT --topology ...` (or use"
    " tpulaunch.plan.mesh.plan_mesh() yourself)",
)


def _install(ctx: RunContext, mesh: Any) -> None:
    _STATE["ctx"] = ctx
    _STATE["mesh"] = mesh


def context() -> RunContext:
    """This process's RunContext. Raises LaunchError outside a tpulaunch launch."""
    if _STATE["ctx"] is None:
        raise LaunchError(*_OUTSIDE)
    return _STATE["ctx"]


def get_mesh() -> Any:
    """The framework mesh built from the launch's MeshPlan (torch_xla `Mesh` or `jax.sharding.Mesh`)."""
    if _STATE["mesh"] is None:
        raise LaunchError(*_OUTSIDE)
    return _STATE["mesh"]


def get_mesh_plan() -> MeshPlan:
    """The pure MeshPlan the driver planned (device placement, sharding strings)."""
    return context().mesh_plan


def heartbeat() -> None:
    """Say "this host is making progress" without printing a line (`--stall-timeout` counts it).

    Cheap (one `utime`), safe to call every step, and a no-op outside a launch.
    """
    path = os.environ.get(HEARTBEAT_ENV)
    if path:
        try:
            os.utime(path)
        except OSError:
            pass
