"""Framework adapters: boot the runtime, build the mesh from a MeshPlan, shut down.

Each adapter is one module exposing the `Framework` interface. Adding a framework (say
TorchTPU) is a new module plus one line in `_ADAPTERS`; nothing else in the tree changes.
Adapter modules import their framework lazily, so the driver never loads torch or jax.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, Protocol

from tpulaunch.errors import LaunchError

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState
    from tpulaunch.plan.mesh import MeshPlan
    from tpulaunch.plan.topology import Topology

_ADAPTERS = {
    "torch_xla": "tpulaunch.host.frameworks.torch_xla",
    "jax": "tpulaunch.host.frameworks.jax",
    "torch_tpu": "tpulaunch.host.frameworks.torch_tpu",
    "none": "tpulaunch.host.frameworks.none",
}


class Framework(Protocol):
    name: str
    extra: str  # pip extra that installs it
    import_name: str  # top-level module whose presence means "installed"

    def emulation_env(self, topology: "Topology", num_slices: int) -> dict[str, str]:
        """Env a host process needs to emulate its TPU host on CPU (pure, driver side)."""

    def preload(self) -> None:
        """Import the framework without starting its runtime (a spare host process waits so)."""

    def boot(self, state: "HostState") -> None:
        """Start the runtime in the host process, before any user code touches it."""

    def build_mesh(self, plan: "MeshPlan", state: "HostState") -> Any:
        """Turn the plan into the framework's mesh, after checking it against the runtime."""

    def shutdown(self) -> None:
        """Leave cleanly (bounded in time)."""

    # Optional: `leaving_after_failure()`, called when the script failed, before its exit handlers
    # run: let go of what would wait at exit for the other hosts (JAX's atexit barrier).


def check_size(where: str, have: int, unit: str, plan: "MeshPlan") -> None:
    """What the runtime counts (`have` devices, or processes: one per device) must be the planned
    mesh's device count."""
    if have != plan.num_devices:
        from tpulaunch.errors import MeshMismatchError

        raise MeshMismatchError(
            f"{where} has {have} {unit} but the planned mesh"
            f" {dict(zip(plan.axis_names, plan.shape))} needs {plan.num_devices}",
            "the slice does not match --topology/--num-slices",
        )


def names() -> list[str]:
    return list(_ADAPTERS)


def get(name: str) -> Framework:
    if name not in _ADAPTERS:
        raise LaunchError(f"unknown framework '{name}'", f"choose one of {', '.join(_ADAPTERS)}, or auto")
    return importlib.import_module(_ADAPTERS[name]).ADAPTER  # type: ignore[no-any-return]


def require_installed(name: str) -> None:
    """Fail early and clearly on the driver when the framework is not importable."""
    fw = get(name)
    if fw.import_name and importlib.util.find_spec(fw.import_name) is None:
        raise LaunchError(
            f"--framework {name} needs {fw.import_name}, which is not installed",
            f"pip install 'tpulaunch[{fw.extra}]'",
        )


def detect(script_text: str) -> tuple[str, str]:
    """Pick a framework from what a script imports. Returns (name, reason)."""
    import ast

    roots: set[str] = set()
    try:
        for node in ast.walk(ast.parse(script_text)):
            if isinstance(node, ast.Import):
                roots.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                roots.add(node.module.split(".")[0])
    except SyntaxError:
        return "torch_xla", "the script does not parse; defaulting to torch_xla"
    if "torch_tpu" in roots or ("torch_xla" not in roots and "tpu_dist" in script_text):
        return "torch_tpu", "the script uses torch_tpu (PyTorch's TPU backend)"
    if "jax" in roots and "torch_xla" not in roots:
        return "jax", "the script imports jax"
    if "torch_xla" in roots:
        return "torch_xla", "the script imports torch_xla"
    return "torch_xla", "the script imports neither jax nor torch_xla; defaulting to torch_xla"
