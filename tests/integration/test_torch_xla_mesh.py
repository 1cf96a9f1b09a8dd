"""Materializing a MeshPlan as a real torch_xla SPMD Mesh (CPU PJRT), and the TPU id mapping.

torch_xla is imported only in two subprocesses (16 and 8 CPU devices), started together by a
module fixture; each runs many checks and reports them as one JSON document.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tpulaunch.plan import mesh as M
from tpulaunch.plan.sharding import shard
from tpulaunch.plan import topology as T

# (case id, topology kwargs, mesh, dcn, num_slices, tensor shape, partition spec)
CASES_16 = [
    ("2d-full", dict(topology="2x8"), None, None, None, (8, 8), ("data", "model")),
    ("2d-data-only", dict(topology="2x8"), None, None, None, (8, 8), ("data", None)),
    ("2d-model-only", dict(topology="2x8"), None, None, None, (8, 8), (None, "model")),
    ("replicated", dict(topology="2x8"), None, None, None, (8, 8), (None, None)),
    ("tuple-on-one-dim", dict(topology="2x8"), None, None, None, (16, 4), (("data", "model"), None)),
    ("tuple-reversed", dict(topology="2x8"), None, None, None, (16, 4), (("model", "data"), None)),
    ("3-axis-mesh", dict(spec="v4-32"), "a=2,b=2,c=4", None, None, (4, 4, 4), ("c", None, "a")),
    ("3-axis-all", dict(spec="v4-32"), "a=2,b=2,c=4", None, None, (4, 4, 8), ("a", "b", "c")),
    ("3-axis-one", dict(spec="v4-32"), "a=2,b=2,c=4", None, None, (4, 4), ("b", None)),
    ("3-axis-tuple", dict(spec="v4-32"), "a=2,b=2,c=4", None, None, (8, 4), (("a", "c"), "b")),
    ("tpu7x-two-cores", dict(spec="tpu7x-16"), None, None, None, (4, 16), ("data", "model")),
    ("tpu7x-model-rows", dict(spec="tpu7x-16"), None, None, None, (16, 4), ("model", None)),
    ("multislice-dcn", dict(spec="v4-16"), "data=2,model=4", "data=2", None, (8, 8), ("data", "model")),
    ("multislice-dcn-model", dict(spec="v4-16"), "data=2,model=4", "model=2", None, (8, 8), ("model", None)),
    ("multislice-new-axis", dict(spec="v6e-8"), "data=4,model=2", "replica=2", None, (8, 8, 2),
     ("replica", "data", "model")),
    ("padded", dict(topology="2x8"), None, None, None, (10, 6), ("data", "model")),
]
CASES_8 = [
    ("1d-one-host", dict(spec="v6e-8"), None, None, None, (16, 4), ("data", None)),
    ("tpu7x-8-2d", dict(spec="tpu7x-8"), "data=2,model=4", None, None, (8, 8), ("data", "model")),
    ("two-vm-2x4", dict(topology="2x4", accelerator="v5e", chips_per_host=4), None, None, None, (8, 8),
     (None, "model")),
    ("multislice-2x2", dict(spec="v6e-4"), "data=2,model=2", "data=2", None, (8, 8), ("data", "model")),
    ("v2-two-cores", dict(spec="v2-8"), "x=2,y=4", None, None, (8, 8), ("y", "x")),
    ("4-axis", dict(spec="v6e-8"), "a=2,b=1,c=2,d=2", None, None, (4, 4), (("a", "d"), "c")),
]
# plans whose device count is not the runtime's
MISMATCH_16 = [dict(spec="v4-64"), dict(spec="v6e-8")]
MISMATCH_8 = [dict(spec="tpu7x-16"), dict(spec="v6e-4")]


def _plan(topo_kw, mesh=None, dcn=None, num_slices=None) -> M.MeshPlan:
    kw = dict(topo_kw)
    spec = kw.pop("spec", None)
    return M.plan_mesh(T.resolve(spec, **kw), mesh, dcn, num_slices)


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs

    xr.use_spmd()
    from tpulaunch.plan import mesh as M, topology as T
    from tpulaunch.errors import MeshMismatchError
    from tpulaunch.host.frameworks.torch_xla import ADAPTER

    job = json.loads(sys.argv[1])
    out = {"device_count": xr.global_runtime_device_count(), "cases": {}, "mismatch": [], "compute": None}

    def plan_of(kw, mesh=None, dcn=None, num_slices=None):
        kw = dict(kw)
        spec = kw.pop("spec", None)
        return M.plan_mesh(T.resolve(spec, **kw), mesh, dcn, num_slices)

    for cid, kw, mesh_s, dcn, ns, shape, spec in job["cases"]:
        plan = plan_of(kw, mesh_s, dcn, ns)
        mesh = ADAPTER.build_mesh(plan, state=None)
        spec = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
        t = torch.zeros(shape, device=torch_xla.device())
        xs.mark_sharding(t, mesh, spec)
        out["cases"][cid] = {
            "hlo": torch_xla._XLAC._get_xla_sharding_spec(t),
            "mesh_ids": [int(i) for i in np.asarray(mesh.device_ids).reshape(-1)],
            "mesh_shape": list(mesh.mesh_shape),
            "axis_names": list(mesh.axis_names),
            "is_global": xs.get_global_mesh() is mesh,
        }

    for kw in job["mismatch"]:
        plan = plan_of(kw)
        try:
            ADAPTER.build_mesh(plan, state=None)
            out["mismatch"].append({"raised": None, "needs": plan.num_devices})
        except MeshMismatchError as e:
            out["mismatch"].append({"raised": "MeshMismatchError", "line": e.line(), "needs": plan.num_devices})

    # the mesh is usable: a sharded matmul computes the same numbers as on the host
    plan = plan_of(job["compute"][0], job["compute"][1])
    mesh = ADAPTER.build_mesh(plan, state=None)
    a = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)
    b = torch.ones(16, 8)
    xa, xb = a.to(torch_xla.device()), b.to(torch_xla.device())
    xs.mark_sharding(xa, mesh, tuple(job["compute"][2]))
    y = (xa @ xb).cpu()
    out["compute"] = {"ok": bool(torch.allclose(y, a @ b)), "hlo": torch_xla._XLAC._get_xla_sharding_spec(xa)}
    print("RESULT " + json.dumps(out))
    """
)


def _job(cases, mismatch, compute):
    return json.dumps({"cases": cases, "mismatch": mismatch, "compute": compute})


@pytest.fixture(scope="module")
def xla_runs(tmp_path_factory):
    """Run the script on 16 and on 8 CPU devices, concurrently; return {n: result dict}."""
    script = tmp_path_factory.mktemp("xla") / "materialize.py"
    script.write_text(SCRIPT)
    jobs = {
        16: _job(CASES_16, MISMATCH_16, [dict(topology="2x8"), None, ["data", "model"]]),
        8: _job(CASES_8, MISMATCH_8, [dict(spec="tpu7x-8"), "data=2,model=4", ["model", "data"]]),
    }
    procs = {}
    for n, job in jobs.items():
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n), TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("XLA_USE_SPMD", None)
        procs[n] = subprocess.Popen(
            [sys.executable, str(script), job], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    results = {}
    for n, p in procs.items():
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        line = [l for l in stdout.splitlines() if l.startswith("RESULT ")][-1]
        results[n] = json.loads(line[len("RESULT "):])
    return results


def _case_params():
    return [pytest.param(16, c, id=f"16-{c[0]}") for c in CASES_16] + [
        pytest.param(8, c, id=f"8-{c[0]}") for c in CASES_8
    ]


def test_runtimes_have_the_requested_devices(xla_runs):
    assert xla_runs[16]["device_count"] == 16
    assert xla_runs[8]["device_count"] == 8


@pytest.mark.parametrize("n, case", _case_params())
def test_mark_sharding_matches_the_planned_hlo(xla_runs, n, case):
    cid, topo_kw, mesh, dcn, ns, shape, spec = case
    plan = _plan(topo_kw, mesh, dcn, ns)
    assert plan.num_devices == n
    got = xla_runs[n]["cases"][cid]
    # the torch_xla Mesh is exactly the plan
    assert got["mesh_ids"] == plan.device_ids()
    assert tuple(got["mesh_shape"]) == plan.shape
    assert tuple(got["axis_names"]) == plan.axis_names
    assert got["is_global"]
    # and torch_xla shards the tensor exactly as the plan says
    assert got["hlo"] == shard(plan, shape, spec).hlo


def test_specs_cover_the_interesting_hlo_forms(xla_runs):
    hlos = [c["hlo"] for r in xla_runs.values() for c in r["cases"].values()]
    assert "{replicated}" in hlos
    assert any(h.endswith("last_tile_dim_replicate}") for h in hlos)
    assert any(h.startswith("{devices=[4,4]") and "replicate" not in h for h in hlos)
    assert any(h.startswith("{devices=[2,2,") for h in hlos)  # 3D tensor fully tiled


@pytest.mark.parametrize("n", [16, 8])
def test_device_count_mismatch_raises_clearly(xla_runs, n):
    for res in xla_runs[n]["mismatch"]:
        assert res["raised"] == "MeshMismatchError", res
        line = res["line"]
        assert f"the runtime has {n} devices" in line
        assert f"needs {res['needs']}" in line


@pytest.mark.parametrize("n", [16, 8])
def test_sharded_compute_is_correct(xla_runs, n):
    assert xla_runs[n]["compute"]["ok"]
    assert xla_runs[n]["compute"]["hlo"].startswith("{devices=[")


# -- runtime_device_ids with TPU-style attributes (no runtime needed) ------------------------------


