"""Step time of the 2D transformer recipe: each step's seconds after warm-up, printed as JSON."""

import json
import os
import runpy
import sys
import time

# Wrap torch_xla.sync so each recipe step's wall time is recorded without editing the recipe.
import torch_xla

_times = []
_orig = torch_xla.sync


def _timed_sync(*a, **k):  # noqa: ANN002, ANN003, ANN202
    r = _orig(*a, **k)
    _times.append(time.perf_counter())
    return r


torch_xla.sync = _timed_sync
recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "transformer_2d.py")
try:
    import tpulaunch

    tpulaunch.get_mesh()
except Exception:  # noqa: BLE001 - direct run: build the mesh like tpulaunch would
    import torch_xla.runtime as xr

    from tpulaunch.host import context as runcontext
    from tpulaunch.plan import topology
    from tpulaunch.host.frameworks.torch_xla import ADAPTER
    from tpulaunch.plan.mesh import plan_mesh

    xr.use_spmd()
    plan = plan_mesh(topology.resolve(topology=os.environ.get("BENCH_TOPOLOGY", "2x4")))
    mesh = ADAPTER.build_mesh(plan, None)
    runcontext._install(runcontext.RunContext("direct", 0, 1, 0, 0, 1, "direct", "", "", "", "torch_xla", True, "", plan), mesh)
sys.argv = [recipe, *sys.argv[1:]]
runpy.run_path(recipe, run_name="__main__")
steps = [b - a for a, b in zip(_times, _times[1:])][5:]  # drop compile/warm-up steps
print("STEP_TIME " + json.dumps({"mean_s": sum(steps) / len(steps), "steps_s": steps}), flush=True)
