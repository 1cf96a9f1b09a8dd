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
"""

from tpulaunch.client import Client, Run, RunStatus, WaitTimeout, launch
from tpulaunch.host.context import context, get_mesh, get_mesh_plan, heartbeat

__all__ = ["Client", "Run", "RunStatus", "WaitTimeout", "context", "get_mesh", "get_mesh_plan", "heartbeat", "launch"]
__version__ = "0.1.0"
