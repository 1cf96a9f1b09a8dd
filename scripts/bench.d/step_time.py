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
    from tpulaunch.host.frameworks.torch_xla import ADAPTER
    from tpulaunch.plan import topology
    from tpulaunch.plan.launch import build_plan
    from tpulaunch.plan.mesh import plan_mesh
    from tpulaunch.plan.slicespec import SliceSpec

    xr.use_spmd()
    topo = topology.resolve(topology=os.environ.get("BENCH_TOPOLOGY", "2x4"))
    plan = build_plan(slices=[SliceSpec.emulated_from(topo, "direct")], mesh=plan_mesh(topo), script=recipe,
                      framework="torch_xla", run_id="direct", coordinator_port=1, emulated=True, log_dir="/tmp",
                      workdir=os.getcwd())
    mesh = ADAPTER.build_mesh(plan.mesh, plan.state(0))
    runcontext._install(runcontext.RunContext(plan.state(0)), mesh)
sys.argv = [recipe, *sys.argv[1:]]
runpy.run_path(recipe, run_name="__main__")
steps = [b - a for a, b in zip(_times, _times[1:])][5:]  # drop compile/warm-up steps
print("STEP_TIME " + json.dumps({"mean_s": sum(steps) / len(steps), "steps_s": steps}), flush=True)
