"""`tpulaunch topology`: what a slice is made of (chips, hosts, bounds, coordinates)."""

from __future__ import annotations

from typing import Optional

import typer

from tpulaunch.errors import TopologyError
from tpulaunch.plan import topology as topo_mod
from tpulaunch.plan.catalog import SHAPE_RE
from tpulaunch.cli import app
from tpulaunch.cli import render
from tpulaunch.cli.output import Output

TOPOLOGY_OPT = typer.Option(None, "--topology", "-t", help="Slice shape: 2x8 (2D) or 2x2x4 (3D).")
ACCEL_OPT = typer.Option(
    None, "--accelerator", "-a",
    help="Generation (v2 v3 v4 v5e v5p v6e v7x) or accelerator type (v4-32). A 2D shape alone means v6e.",
)
CHIPS_PER_HOST_OPT = typer.Option(
    None, "--chips-per-host", help="Override chips per VM (4 for a two-VM v5e/v6e 2x4, as on GKE)."
)
JSON_OPT = typer.Option(False, "--json", help="Print one JSON document on stdout.")


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
    spec: Optional[str] = typer.Argument(None, metavar="ACCELERATOR_OR_SHAPE", help="v4-32, v6e-8, tpu7x-16, or 2x8."),
    topology: Optional[str] = TOPOLOGY_OPT,
    accelerator: Optional[str] = ACCEL_OPT,
    chips_per_host: Optional[int] = CHIPS_PER_HOST_OPT,
    json_out: bool = JSON_OPT,
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
