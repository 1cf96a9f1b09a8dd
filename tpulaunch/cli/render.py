"""Pure rendering of library objects: rich renderables for terminals, plain lines for pipes.

No logic lives here beyond layout; every number comes from the Topology / MeshPlan / plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tpulaunch.cli.output import host_color
from tpulaunch.plan.launch import LaunchPlan
from tpulaunch.plan.mesh import MeshPlan
from tpulaunch.plan.sharding import ShardingPlan
from tpulaunch.plan.topology import Topology

MAX_ROWS = 64  # tables longer than this are cut (the JSON form is never cut)


def _coords(chips: Iterable[tuple[int, ...]], dims: int) -> str:
    return " ".join("(" + ",".join(str(v) for v in c[:dims]) + ")" for c in chips)


def topology_lines(t: Topology) -> list[str]:
    g = t.generation
    lines = [
        f"accelerator_type: {t.accelerator_type}",
        f"generation: {g.name}",
        f"topology: {t.topology}",
        f"torus: {g.torus_dims}D",
        f"tensorcores_per_chip: {g.tensorcores_per_chip}",
        f"devices_per_chip: {g.devices_per_chip}",
        f"suffix_counts: {g.suffix_counts}",
        f"chips: {t.chips}",
        f"devices: {t.devices}",
        f"hosts: {t.num_hosts}",
        f"chips_per_host: {t.chips_per_host}",
        f"TPU_HOST_BOUNDS: {t.bounds_str(t.host_bounds)}",
        f"TPU_CHIPS_PER_HOST_BOUNDS: {t.bounds_str(t.chips_per_host_bounds)}",
    ]
    for h in t.hosts[:MAX_ROWS]:
        lines.append(f"host {h.worker_id}: grid {','.join(map(str, h.grid[:g.torus_dims]))}"
                     f" chips {_coords(h.chips, g.torus_dims)}")
    if t.num_hosts > MAX_ROWS:
        lines.append(f"... {t.num_hosts - MAX_ROWS} more hosts (use --json for all)")
    lines += [f"note: {n}" for n in t.notes]
    return lines


def topology_rich(t: Topology) -> Group:
    g = t.generation
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    rows = [
        ("accelerator type", t.accelerator_type),
        ("generation", f"{g.name}  ({g.tensorcores_per_chip} TensorCore(s)/chip, {g.devices_per_chip} device(s)/chip,"
                       f" {g.torus_dims}D torus, suffix counts {g.suffix_counts})"),
        ("topology", t.topology),
        ("chips / devices", f"{t.chips} / {t.devices}"),
        ("hosts", f"{t.num_hosts} x {t.chips_per_host} chips"),
        ("TPU_HOST_BOUNDS", t.bounds_str(t.host_bounds)),
        ("TPU_CHIPS_PER_HOST_BOUNDS", t.bounds_str(t.chips_per_host_bounds)),
    ]
    for k, v in rows:
        head.add_row(k, v)
    hosts = Table(title="hosts", title_justify="left")
    hosts.add_column("worker", justify="right")
    hosts.add_column("grid")
    hosts.add_column("chips (x,y,z)" if g.torus_dims == 3 else "chips (x,y)")
    for h in t.hosts[:MAX_ROWS]:
        hosts.add_row(
            Text(str(h.worker_id), style=host_color(h.worker_id)),
            ",".join(map(str, h.grid[:g.torus_dims])),
            _coords(h.chips, g.torus_dims),
        )
    parts: list = [head, hosts]
    if t.num_hosts > MAX_ROWS:
        parts.append(Text(f"... {t.num_hosts - MAX_ROWS} more hosts (use --json for all)", style="dim"))
    parts += [Text(f"note: {n}", style="yellow") for n in t.notes]
    return Group(*parts)


# -- mesh -----------------------------------------------------------------------------------------


def _grid_rows(plan: MeshPlan) -> tuple[list[str], list[list[int]]]:
    """Flatten an N-D mesh to rows (all axes but the last) x columns (the last axis)."""
    shape = plan.shape
    cols = shape[-1]
    flat = plan.device_ids()
    labels, rows = [], []
    lead = shape[:-1]
    for r in range(math.prod(lead) if lead else 1):
        idx, rem = [], r
        for n in reversed(lead):
            rem, i = divmod(rem, n)
            idx.append(i)
        idx.reverse()
        labels.append(",".join(f"{a}={i}" for a, i in zip(plan.axis_names[:-1], idx, strict=True)) or "-")
        rows.append(flat[r * cols:(r + 1) * cols])
    return labels, rows


def mesh_header(plan: MeshPlan) -> str:
    axes = ", ".join(f"{a}={n}" for a, n in zip(plan.axis_names, plan.shape, strict=True))
    dcn = ""
    if plan.num_slices > 1:
        dcn = "  (ICI " + "x".join(map(str, plan.ici_shape)) + " x DCN " + "x".join(map(str, plan.dcn_shape)) + ")"
    t = plan.topology
    slices = f"{plan.num_slices} x " if plan.num_slices > 1 else ""
    return f"mesh {axes}{dcn} over {slices}{t.accelerator_type} ({t.topology}), {plan.num_devices} devices"


def _hops(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def placement_line(plan: MeshPlan) -> str:
    """Which placement, and whether per-host input loads one share per host."""
    if plan.layout().keeps_host_rows:
        rows = f"each host holds whole rows of {plan.axis_names[0]} (per-host input: one share per host)"
    else:
        rows = f"hosts share rows of {plan.axis_names[0]} (per-host input must load the same rows on those hosts)"
    return f"placement {plan.placement}: {rows}"


def cost_lines(plan: MeshPlan) -> list[str]:
    """ICI hops per ring step of every axis, with the best any layout gives it."""
    parts = []
    for c in plan.cost():
        if c["hops"] is None:
            parts.append(f"{c['axis']} -" + (f" (DCN x{c['dcn']})" if c["dcn"] > 1 else ""))
        else:
            dcn = f", DCN x{c['dcn']}" if c["dcn"] > 1 else ""
            parts.append(f"{c['axis']} {_hops(c['hops'])} (ideal {_hops(c['ideal'])}{dcn})")
    return ["ICI hops per ring step: " + ", ".join(parts), placement_line(plan)]


def cost_table(plan: MeshPlan) -> Table:
    table = Table(title="ICI hops per ring step", title_justify="left")
    for col in ("axis", "size", "ICI", "DCN", "hops/step", "ideal"):
        table.add_column(col, justify="left" if col == "axis" else "right")
    for c in plan.cost():
        worse = c["hops"] is not None and c["ideal"] is not None and c["hops"] > c["ideal"] + 1e-9
        table.add_row(c["axis"], str(c["size"]), str(c["ici"]), str(c["dcn"]),
                      Text(_hops(c["hops"]), style="yellow" if worse else "green"), _hops(c["ideal"]))
    return table


def mesh_rich(plan: MeshPlan) -> Group:
    labels, rows = _grid_rows(plan)
    proc_of = {d: plan.device(d).process for d in plan.device_ids()}
    last = plan.axis_names[-1]
    grid = Table(title=mesh_header(plan), title_justify="left", show_lines=False)
    grid.add_column(", ".join(plan.axis_names[:-1]) or "", style="bold")
    for c in range(plan.shape[-1]):
        grid.add_column(f"{last}={c}", justify="right")
    for label, row in list(zip(labels, rows, strict=True))[:MAX_ROWS]:
        grid.add_row(label, *[Text(str(d), style=host_color(proc_of[d])) for d in row])
    parts: list = [grid]
    if len(rows) > MAX_ROWS:
        parts.append(Text(f"... {len(rows) - MAX_ROWS} more rows (use --json for all)", style="dim"))
    parts.append(Text("cells: device id, colored by host", style="dim"))
    parts.append(cost_table(plan))
    parts.append(Text("1 = every step to a neighbouring chip; " + placement_line(plan), style="dim"))
    parts.append(hosts_table(plan))
    return Group(*parts)


def hosts_table(plan: MeshPlan) -> Table:
    t = plan.topology
    dims = t.generation.torus_dims
    table = Table(title="hosts", title_justify="left")
    for col in ("process", "slice", "worker", "devices", "chips"):
        table.add_column(col, justify="right" if col != "chips" else "left")
    for p in range(min(plan.num_processes, MAX_ROWS)):
        ids = plan.process_device_ids(p)
        w = p % t.num_hosts
        table.add_row(
            Text(str(p), style=host_color(p)), str(p // t.num_hosts), str(w),
            _ranges(ids), _coords(t.host_chips(w), dims),
        )
    if plan.num_processes > MAX_ROWS:
        table.caption = f"... {plan.num_processes - MAX_ROWS} more hosts (use --json for all)"
    return table


def mesh_lines(plan: MeshPlan) -> list[str]:
    labels, rows = _grid_rows(plan)
    out = [mesh_header(plan)]
    for label, row in zip(labels[:MAX_ROWS], rows[:MAX_ROWS], strict=True):
        if len(plan.shape) == 1:
            label = plan.axis_names[0]  # 1D: one row, the whole axis (not "-")
        out.append(f"{label}: " + " ".join(str(d) for d in row))
    if len(rows) > MAX_ROWS:
        out.append(f"... {len(rows) - MAX_ROWS} more rows (use --json for all)")
    out.extend(cost_lines(plan))
    t = plan.topology
    for p in range(min(plan.num_processes, MAX_ROWS)):
        out.append(
            f"host {p}: slice {p // t.num_hosts} worker {p % t.num_hosts} devices {_ranges(plan.process_device_ids(p))}"
        )
    if plan.num_processes > MAX_ROWS:
        out.append(f"... {plan.num_processes - MAX_ROWS} more hosts (use --json for all)")
    return out


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def sharding_lines(s: ShardingPlan) -> list[str]:
    shape = "x".join(map(str, s.tensor_shape))
    spec = ",".join("+".join(e) if isinstance(e, tuple) else str(e) for e in s.spec)
    out = [
        f"tensor {shape} spec ({spec})",
        f"shard shape: {'x'.join(map(str, s.shard_shape))} ({math.prod(s.tile_shape)} shards,"
        f" {s.replicate} replica(s) each)",
        f"hlo sharding: {s.hlo}",
    ]
    for ranges, devs in s.blocks()[:MAX_ROWS]:
        out.append("block " + " ".join(f"[{a}:{b}]" for a, b in ranges) + " on devices " + ",".join(map(str, devs)))
    if len(s.blocks()) > MAX_ROWS:
        out.append(f"... {len(s.blocks()) - MAX_ROWS} more blocks (use --json for all)")
    return out


def sharding_rich(s: ShardingPlan) -> Group:
    lines = sharding_lines(s)
    table = Table(title=lines[0], title_justify="left")
    table.add_column("block (rows:cols...)")
    table.add_column("devices")
    for ranges, devs in s.blocks()[:MAX_ROWS]:
        table.add_row(" ".join(f"[{a}:{b}]" for a, b in ranges), ",".join(map(str, devs)))
    return Group(table, Text(lines[1]), Text(lines[2], overflow="fold"))


HIDDEN = "<hidden: from --env; --show-env prints it>"


def hide_user_env(plan: LaunchPlan, env: dict[str, str]) -> dict[str, str]:
    """A host's environment with the values the user gave (`--env`, `--env-file`) masked."""
    return {k: HIDDEN if k in plan.job.user_env else v for k, v in env.items()}


def env_lines(plan: LaunchPlan, show_user_env: bool = False) -> list[str]:
    """Every host's environment, as `--dry-run` prints it (user values masked unless asked)."""
    out = []
    for h in plan.hosts:
        out.append(f"host {h.process_index} (slice {h.slice_index} worker {h.worker_id}, {h.ip}):")
        env = plan.env(h.process_index)
        env = env if show_user_env else hide_user_env(plan, env)
        out.extend(f"  {k}={v}" for k, v in sorted(env.items()))
    return out
