"""What the driver knows of each framework, in one registry: the facts that shape a plan.

Pure data, read on the driver without importing any framework. Each framework's host side (boot,
mesh, shutdown) is its adapter module (`host.frameworks.<name>`), named here too: adding a framework
is its adapter and one `Facts` row, nothing else.

`ports` is the one rule for a run's ports: `run.prepare` plans a run with it, and `run.warm` plans
a cluster's spares with it, so the two cannot drift (a spare whose environment differs from its
run's would start the run cold without a word).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from tpulaunch.errors import LaunchError


class Framework(str, Enum):
    TORCH_XLA = "torch_xla"
    JAX = "jax"
    TORCH_TPU = "torch_tpu"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Facts:
    name: Framework
    adapter: str  # its host adapter's module (imports the framework lazily)
    extra: str  # the pip extra that installs it
    import_name: str  # the top-level module whose presence means "installed" ("" for none)
    slice_port: int  # MASTER_PORT on a real slice (the framework's usual one)
    jax_coordinator: bool = False  # JAX's coordinator service (jax.distributed) on MASTER_PORT + 1
    ordered_exit: bool = False  # hosts leave in order through tpulaunch's service on MASTER_PORT + 1 (host/leave.py)
    compile_cache: bool = False  # a persistent compilation cache by default (`plan.launch.default_compile_cache`)
    per_device: bool = False  # one process per device (torch_tpu's ranks), not one per host
    device: str = ""  # the torch device type a host computes on ("xla", "tpu"; "" for JAX and none)
    emulated_device: str = ""  # ... on an emulated host


TPU_MASTER_PORT = 8476  # MASTER_PORT on a slice for torch_xla and JAX: their usual one
TORCH_TPU_MASTER_PORT = 29500  # torch_tpu's own: set_tpu_launch_env's (plan/torch_tpu.py)

FACTS: dict[Framework, Facts] = {f.name: f for f in (
    Facts(Framework.TORCH_XLA, "tpulaunch.host.frameworks.torch_xla", "torch_xla", "torch_xla", TPU_MASTER_PORT,
          ordered_exit=True, device="xla", emulated_device="xla"),
    Facts(Framework.JAX, "tpulaunch.host.frameworks.jax", "jax", "jax", TPU_MASTER_PORT, jax_coordinator=True,
          compile_cache=True),
    # the driver needs torch, not torch_tpu: the hosts do (and an emulated host needs none)
    Facts(Framework.TORCH_TPU, "tpulaunch.host.frameworks.torch_tpu", "torch_tpu", "torch", TORCH_TPU_MASTER_PORT,
          per_device=True, device="tpu", emulated_device="cpu"),
    Facts(Framework.NONE, "tpulaunch.host.frameworks.none", "", "", TPU_MASTER_PORT),
)}


def facts(name: str | Framework) -> Facts:
    """The facts of a framework by name; one line (exit 2) for an unknown one."""
    try:
        return FACTS[Framework(name)]
    except ValueError:
        raise LaunchError(f"unknown framework '{name}'",
                          f"choose one of {', '.join(f.value for f in Framework)}, or auto") from None


@dataclass(frozen=True)
class Ports:
    """A run's ports: MASTER_PORT, tpulaunch's own gloo group, JAX's coordinator, the emulation's
    device service, the ordered exit's service (None: the run has no such service)."""

    coordinator: int
    group: int
    jax: int | None
    emulation: int | None
    exit: int | None


def ports(fw: Facts, *, local: bool, emulated: bool, command: bool, base: int | None,
          free: Callable[[], int]) -> Ports:
    """The rule: on one machine (`local`) every port is a free one; on a slice they are
    `base` (default the framework's MASTER_PORT) and the next three, the same on every host."""
    if local:
        return Ports(base or free(), free(), free() if fw.jax_coordinator else None, free() if emulated else None,
                     free() if fw.ordered_exit and not command else None)
    port = base or fw.slice_port
    return Ports(port, port + 2, port + 1 if fw.jax_coordinator else None, port + 3 if emulated else None,
                 port + 1 if fw.ordered_exit and not command else None)
