"""`tpulaunch mesh inspect`: the mesh tpulaunch would build, and how a tensor would be split."""

from __future__ import annotations

import typer

from tpulaunch import discover
from tpulaunch.cli import app, render
from tpulaunch.cli import options as opt
from tpulaunch.cli.cmd_topology import split_spec
from tpulaunch.cli.output import Output
from tpulaunch.errors import MeshError
from tpulaunch.plan import mesh as mesh_mod
from tpulaunch.plan import sharding as sharding_mod

mesh_app = typer.Typer(help="Plan and inspect device meshes.", no_args_is_help=True)
app.add_typer(mesh_app, name="mesh")



@mesh_app.command("inspect")
def inspect(
    slice_spec: str | None = typer.Argument(None, metavar="[ACCELERATOR_OR_SHAPE]", help="v4-32, tpu7x-18432, or 2x8."),
    topology: str | None = opt.TOPOLOGY,
    accelerator: str | None = opt.ACCELERATOR,
    chips_per_host: int | None = opt.CHIPS_PER_HOST,
    mesh: str | None = opt.MESH,
    dcn: str | None = opt.DCN,
    placement: str = opt.PLACEMENT,
    num_slices: int | None = opt.NUM_SLICES,
    tpu: str | None = opt.TPU,
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    shard: str | None = typer.Option(None, "--shard", help="A tensor shape to split, e.g. 1024x4096."),
    spec: str | None = typer.Option(
        None, "--spec", help="Partition spec for --shard: one mesh axis per dim, None to replicate, a+b for several."
    ),
    json_out: bool = opt.JSON,
) -> None:
    """Draw the mesh as a grid of device ids colored by host, then the hosts.

    Works with no TPU and no network (unless --tpu asks the Cloud TPU API).
    Examples: `tpulaunch mesh inspect v4-32`,
    `tpulaunch mesh inspect --topology 2x8 --shard 1024x4096 --spec data,model`.
    """
    out = Output(json_mode=json_out)
    topology, accelerator = split_spec(slice_spec, topology, accelerator)
    req = discover.SliceRequest(topology=topology, accelerator=accelerator, chips_per_host=chips_per_host,
                                tpu=tpu, zone=zone, project=project, num_slices=num_slices, dcn=dcn)
    wanted = discover.request_num_slices(req)  # checked before anything is built per slice
    asked = f"--dcn {dcn[:40]} ({wanted} slices)" if num_slices is None and dcn else None  # (else --num-slices)
    mesh_mod.check_slice_count(wanted, asked)
    if tpu:
        with out.status("asking the Cloud TPU API ..."):
            resolved = discover.resolve(req)
    else:
        resolved = discover.resolve(req)
    plan = mesh_mod.plan_mesh(resolved.topology, mesh, dcn, resolved.num_slices, placement)
    sharding = None
    if shard or spec:
        if not (shard and spec):
            raise MeshError("--shard and --spec go together", "e.g. --shard 1024x4096 --spec data,model")
        sharding = sharding_mod.shard(plan, sharding_mod.parse_tensor_shape(shard), sharding_mod.parse_spec(spec))
    if json_out:
        doc = plan.to_dict()
        if sharding is not None:
            doc["sharding"] = sharding.to_dict()
        out.json(doc)
        return
    for note in resolved.topology.notes:
        out.info(f"note: {note}")
    if out.rich:
        out.result(render.mesh_rich(plan))
        if sharding is not None:
            out.result(render.sharding_rich(sharding))
    else:
        for line in render.mesh_lines(plan) + (render.sharding_lines(sharding) if sharding else []):
            out.line(line)
