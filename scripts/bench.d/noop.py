"""The no-op the launch benchmarks run: import torch_xla, get the mesh, exit.

Under tpulaunch it reads the mesh tpulaunch built; run directly (the floor) it plans and builds
the same mesh itself, so both do the same work.
"""

import os
import time

t0 = time.time()
import torch_xla  # noqa: E402,F401
import torch_xla.runtime as xr  # noqa: E402

import tpulaunch  # noqa: E402

try:
    mesh = tpulaunch.get_mesh()
except Exception:  # noqa: BLE001 - not launched: build the same mesh by hand
    from tpulaunch.plan import topology
    from tpulaunch.host.frameworks.torch_xla import ADAPTER
    from tpulaunch.plan.mesh import plan_mesh

    xr.use_spmd()
    plan = plan_mesh(topology.resolve(os.environ.get("BENCH_TOPOLOGY", "2x8")))  # a shape or an accelerator type
    mesh = ADAPTER.build_mesh(plan, None)
print(f"noop mesh {tuple(mesh.mesh_shape)} in {time.time() - t0:.2f}s", flush=True)
