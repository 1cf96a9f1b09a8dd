"""`tpulaunch topology`: what a slice is made of (chips, hosts, bounds, coordinates)."""

from __future__ import annotations

import typer

from tpulaunch.cli import app, render
from tpulaunch.cli import options as opt
from tpulaunch.cli.output import Output
from tpulaunch.errors import TopologyError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.catalog import SHAPE_RE


def split_spec(spec: str | None, topology: str | None, accelerator: str | None) -> tuple[str | None, str | None]:
    """A positional ACCELERATOR_OR_SHAPE as (--topology, --accelerator); contradictions are errors."""
    if not spec:
        return topology, accelerator
    is_shape = bool(SHAPE_RE.match(spec.strip().lower()))
    given = topology if is_shape else accelerator
    if given and given != spec:
        flag = "--topology" if is_shape else "--accelerator"
        raise TopologyError(f"two slices given: '{spec}' and {flag} '{given}'", "give one")
    return (spec, accelerator) if is_shape else (topology, spec)


@app.command("topology")
def topology_cmd(
    spec: str | None = typer.Argument(None, metavar="ACCELERATOR_OR_SHAPE", help="v4-32, v6e-8, tpu7x-16, or 2x8."),
    topology: str | None = opt.TOPOLOGY,
    accelerator: str | None = opt.ACCELERATOR,
    chips_per_host: int | None = opt.CHIPS_PER_HOST,
    json_out: bool = opt.JSON,
) -> None:
    """Show a slice's chips, hosts, bounds and chip coordinates.

    Examples: `tpulaunch topology v4-32`, `tpulaunch topology --topology 2x2x4 --accelerator v4`.
    """
    t = topo_mod.resolve(spec, topology=topology, accelerator=accelerator, chips_per_host=chips_per_host)
    out = Output(json_mode=json_out)
    if json_out:
        out.json(t.to_dict())
    elif out.rich:
        out.result(render.topology_rich(t))
    else:
        for line in render.topology_lines(t):
            out.line(line)
