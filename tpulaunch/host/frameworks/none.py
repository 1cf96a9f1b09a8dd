"""No framework: the host process boots nothing (`--framework none`).

For scripts that bring their own runtime or need none (data preparation, a launcher's own
plumbing, tests of the launcher itself): the environment and `tpulaunch.context()` are pushed
as for any run, and `tpulaunch.get_mesh()` returns the planned `MeshPlan` itself, since there is
no framework to build a mesh in. No gloo group is opened (that needs torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState
    from tpulaunch.plan.mesh import MeshPlan
    from tpulaunch.plan.topology import Topology


class NoFramework:
    name = "none"

    def emulation_env(self, topology: Topology, num_slices: int) -> dict[str, str]:
        # An emulated host has no TPU: a framework the script imports by itself must not look for one.
        return {"PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu"}

    def preload(self) -> None:
        return None

    def boot(self, state: HostState) -> None:
        return None

    def build_mesh(self, plan: MeshPlan, state: HostState) -> Any:
        return plan

    def shutdown(self) -> None:
        return None


ADAPTER = NoFramework()
