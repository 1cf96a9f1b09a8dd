"""Framework adapters: boot the runtime, build the mesh from a MeshPlan, shut down.

Each adapter is one module exposing the `Framework` interface; what the driver knows of a
framework (its ports, processes per host, extra, adapter module) is its row in
`plan.frameworks.FACTS`. Adding a framework is a new adapter module plus that row; nothing else in
the tree changes. Adapter modules import their framework lazily, so the driver never loads torch or jax.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, Protocol

from tpulaunch.errors import LaunchError
from tpulaunch.plan.frameworks import FACTS, facts
from tpulaunch.plan.frameworks import Framework as Name

if TYPE_CHECKING:
    from tpulaunch.plan.contract import HostState
    from tpulaunch.plan.mesh import MeshPlan
    from tpulaunch.plan.topology import Topology

class Framework(Protocol):
    name: str

    def emulation_env(self, topology: Topology, num_slices: int) -> dict[str, str]:
        """Env a host process needs to emulate its TPU host on CPU (pure, driver side)."""

    def preload(self) -> None:
        """Import the framework without starting its runtime (a spare host process waits so)."""

    def boot(self, state: HostState) -> None:
        """Start the runtime in the host process, before any user code touches it."""

    def build_mesh(self, plan: MeshPlan, state: HostState) -> Any:
        """Turn the plan into the framework's mesh, after checking it against the runtime."""

    def shutdown(self) -> None:
        """Leave cleanly (bounded in time)."""

    # Optional: `leaving_after_failure()`, called when the script failed, before its exit handlers
    # run: let go of what would wait at exit for the other hosts (JAX's atexit barrier).


def check_size(where: str, have: int, unit: str, plan: MeshPlan) -> None:
    """What the runtime counts (`have` devices, or processes: one per device) must be the planned
    mesh's device count."""
    if have != plan.num_devices:
        from tpulaunch.errors import MeshMismatchError

        raise MeshMismatchError(
            f"{where} has {have} {unit} but the planned mesh"
            f" {dict(zip(plan.axis_names, plan.shape, strict=True))} needs {plan.num_devices}",
            "the slice does not match --topology/--num-slices",
        )


def names() -> list[str]:
    return [n.value for n in FACTS]


def get(name: str | Name) -> Framework:
    """A framework's host adapter (its module imported; the framework itself is not)."""
    adapter: Framework = importlib.import_module(facts(name).adapter).ADAPTER
    return adapter


def require_installed(name: str | Name) -> None:
    """Fail early and clearly on the driver when the framework is not importable."""
    fw = facts(name)
    if fw.import_name and importlib.util.find_spec(fw.import_name) is None:
        raise LaunchError(
            f"--framework {name} needs {fw.import_name}, which is not installed",
            f"pip install 'tpulaunch[{fw.extra}]'",
        )


def detect(script_text: str) -> tuple[Name, str]:
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
        return Name.TORCH_XLA, "the script does not parse; defaulting to torch_xla"
    if "torch_tpu" in roots or ("torch_xla" not in roots and "tpu_dist" in script_text):
        return Name.TORCH_TPU, "the script uses torch_tpu (PyTorch's TPU backend)"
    if "jax" in roots and "torch_xla" not in roots:
        return Name.JAX, "the script imports jax"
    if "torch_xla" in roots:
        return Name.TORCH_XLA, "the script imports torch_xla"
    return Name.TORCH_XLA, "the script imports neither jax nor torch_xla; defaulting to torch_xla"
