"""tpulaunch: gang-launch SPMD training on every host of a Cloud TPU slice, through Ray.

Inside a launched script::

    import tpulaunch
    mesh = tpulaunch.get_mesh()      # torch_xla Mesh or jax.sharding.Mesh, built from the plan
    ctx = tpulaunch.context()        # process index, world size, coordinator, slice, run id, ...
    tpulaunch.heartbeat()            # progress without printing (for --stall-timeout)
    tpulaunch.heartbeat(step=n)      # ... and where it is (step rates, stragglers named)

From anywhere else (a notebook, CI, a driver program)::

    client = tpulaunch.Client("auto")
    run = client.submit("train.py", topology="2x4", env={"WANDB_API_KEY": key})
    run.wait(); tpulaunch.launch("train.py", topology="2x4")

Errors are `tpulaunch.errors`' classes (exported here too), each with the exit code the CLI gives.
"""

import importlib
from typing import Any

from tpulaunch.errors import (
    ClusterError,
    DiscoveryError,
    ExitCode,
    LaunchError,
    SliceNotReadyError,
    StateError,
    TpulaunchError,
    WaitTimeout,
)
from tpulaunch.host.context import context, get_mesh, get_mesh_plan, heartbeat

# The client side, loaded on first use: a launched script's `import tpulaunch` stays as light as
# the context it needs (tests/unit/test_layout.py holds it to that).
_LAZY = {
    "AttemptStatus": "client", "Client": "client", "HostStatus": "client", "Run": "client", "RunSpec": "client",
    "RunStatus": "client", "launch": "client", "HostPhase": "run.status", "RunState": "run.status",
    "RunSummary": "run.summary",
}

__all__ = ["AttemptStatus", "Client", "ClusterError", "DiscoveryError", "ExitCode", "HostPhase", "HostStatus",
           "LaunchError", "Run", "RunSpec", "RunState", "RunStatus", "RunSummary", "SliceNotReadyError", "StateError",
           "TpulaunchError", "WaitTimeout", "context", "get_mesh", "get_mesh_plan", "heartbeat", "launch"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tpulaunch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tpulaunch.{_LAZY[name]}"), name)
