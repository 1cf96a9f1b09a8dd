"""tpulaunch: gang-launch SPMD training on every host of a Cloud TPU slice, through Ray.

Inside a launched script::

    import tpulaunch
    mesh = tpulaunch.get_mesh()      # torch_xla Mesh or jax.sharding.Mesh, built from the plan
    ctx = tpulaunch.context()        # process index, world size, coordinator, slice, run id, ...
    tpulaunch.heartbeat()            # progress without printing (for --stall-timeout)
    tpulaunch.heartbeat(step=n)      # ... and where it is (step rates, stragglers named)
"""

from tpulaunch.host.context import context, get_mesh, get_mesh_plan, heartbeat

__all__ = ["context", "get_mesh", "get_mesh_plan", "heartbeat"]
__version__ = "0.1.0"
