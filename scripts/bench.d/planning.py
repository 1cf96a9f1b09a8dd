"""Planning time vs slice size: catalog -> Topology -> MeshPlan (every device placed) -> LaunchPlan.

Pure, in-process, no Ray: what `mesh inspect` and `--dry-run` cost before printing, for v7x slices
of 16, 256, 4096 and 9216 chips (the last one a whole Ironwood pod). The 16-chip slice is the
baseline of the same run.
"""

from __future__ import annotations

import statistics
import time

from tpulaunch.plan import placement
from tpulaunch.plan.launch import build_plan
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
from tpulaunch.plan.topology import resolve

SLICES = (("tpu7x-32", 16), ("tpu7x-512", 256), ("tpu7x-8192", 4096), ("tpu7x-18432", 9216))


def plan_once(acc: str) -> dict[str, float]:
    for cached in (placement.layout, placement._search, placement._best_walk):
        cached.cache_clear()  # every run plans from scratch, placement search included
    t0 = time.perf_counter()
    topo = resolve(acc)
    mesh = plan_mesh(topo)
    mesh.device_ids()  # every mesh position placed on a chip
    t1 = time.perf_counter()
    spec = SliceSpec(name="s", accelerator_type=topo.accelerator_type, topology=topo.topology, source="bench",
                     workers=tuple(WorkerEndpoint(w, f"10.0.{w // 250}.{w % 250}") for w in range(topo.num_hosts)))
    build_plan(slices=[spec], mesh=mesh, script="train.py", run_id="bench", coordinator_port=8476,
               emulated=False, log_dir="/tmp/bench", workdir="/tmp")
    t2 = time.perf_counter()
    return {"mesh_s": t1 - t0, "launch_plan_s": t2 - t1}


def measure(repeat: int = 5) -> list[dict]:
    rows = []
    for acc, chips in SLICES:
        runs = [plan_once(acc) for _ in range(repeat)]
        rows.append({
            "accelerator": acc, "chips": chips, "hosts": resolve(acc).num_hosts,
            "mesh_s": statistics.median(r["mesh_s"] for r in runs),
            "launch_plan_s": statistics.median(r["launch_plan_s"] for r in runs),
        })
    return rows


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=2))
