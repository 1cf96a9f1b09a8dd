"""The mesh's cost on real pods, by model: ICI hops per ring step, ours beside JAX's `mesh_utils`.

Pure, in-process, no TPU: every case is scored with `tpulaunch.plan.placement.ring_hops` from the
chips' coordinates, for tpulaunch's default placement (`auto`), the rule before it (`host`), and
`mesh_utils.create_device_mesh` given devices as the slice reports them (without and with
`allow_split_physical_axes`; "refuses" where it builds no mesh).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from mesh_utils_ref import jax_ids, no_worse  # noqa: E402

from tpulaunch.plan import placement as P  # noqa: E402
from tpulaunch.plan.mesh import plan_mesh  # noqa: E402
from tpulaunch.plan.topology import resolve  # noqa: E402

CASES = [  # slice, mesh (None: tpulaunch's default, hosts x devices per host)
    ("v6e-256", "data=16,model=16"), ("v6e-256", None), ("v6e-256", "data=32,fsdp=4,model=2"),
    ("v5litepod-64", "data=8,model=8"), ("v5litepod-16", None), ("v5litepod-16", "data=8,model=2"),
    ("v4-128", "data=4,model=16"), ("v4-128", "data=4,fsdp=4,model=4"), ("v4-128", None),
    ("v4-64", "data=4,model=8"), ("v4-32", None), ("v4-512", "data=8,fsdp=8,model=4"),
    ("v5p-128", "data=8,model=8"), ("v5p-256", "data=2,fsdp=8,model=8"), ("v5p-1024", "data=32,model=16"),
    ("v6e-16", None), ("v6e-8", None), ("v2-32", None), ("v3-64", "data=8,model=8"),
    ("tpu7x-16", None), ("tpu7x-128", "data=16,model=8"), ("tpu7x-128", "data=8,fsdp=4,model=4"),
    ("tpu7x-1024", "data=128,model=8"),
]


def _fmt(hops) -> str:
    return "refuses" if hops is None else " / ".join(f"{h:g}" for h in hops if h is not None)


def measure() -> list[dict]:
    rows = []
    for spec, mesh in CASES:
        t = resolve(spec)
        auto = plan_mesh(t, mesh)
        shape = auto.ici_shape
        refs = {}
        for key, kw in (("mesh_utils", {}), ("mesh_utils_split", {"allow_split_physical_axes": True})):
            ids = jax_ids(t, shape, **kw)
            refs[key] = None if ids is None else [round(h, 3) if h is not None else None for h in P.ring_hops(t, ids)]
        ours = [round(h, 3) if h is not None else None for h in auto.layout().hops]
        rows.append({
            "slice": f"{spec} ({t.topology})", "mesh": ",".join(f"{a}={n}" for a, n in zip(auto.axis_names, shape)),
            "auto": ours, "host": [round(h, 3) if h is not None else None for h in plan_mesh(t, mesh, placement="host").layout().hops],
            **refs, "host_rows": auto.layout().keeps_host_rows,
            "no_worse": all(r is None or no_worse(ours, r) for r in refs.values()),
        })
    return rows


def table(rows: list[dict]) -> str:
    out = ["| slice | mesh | tpulaunch (auto) | before (host) | mesh_utils | mesh_utils, split axes | hosts own rows |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['slice']} | {r['mesh']} | **{_fmt(r['auto'])}** | {_fmt(r['host'])} | {_fmt(r['mesh_utils'])}"
                   f" | {_fmt(r['mesh_utils_split'])} | {'yes' if r['host_rows'] else 'no'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(table(measure()))
