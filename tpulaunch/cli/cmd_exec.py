"""`tpulaunch exec -- COMMAND ARGS...`: run one command on every host of the slice."""

from __future__ import annotations

from typing import List, Optional

import typer

from tpulaunch import run
from tpulaunch.cli import app
from tpulaunch.cli.cmd_mesh import NUM_SLICES_OPT
from tpulaunch.cli.cmd_run import FAULT_OPTIONS, run_request
from tpulaunch.cli.cmd_topology import ACCEL_OPT, CHIPS_PER_HOST_OPT, JSON_OPT, TOPOLOGY_OPT
from tpulaunch.cli.output import Output
from tpulaunch.cli.slices import SLICE_OPTIONS
from tpulaunch.errors import LaunchError


@app.command("exec")
def exec_cmd(
    command: List[str] = typer.Argument(..., help="The command and its arguments (after --)."),
    topology: Optional[str] = TOPOLOGY_OPT,
    accelerator: Optional[str] = ACCEL_OPT,
    chips_per_host: Optional[int] = CHIPS_PER_HOST_OPT,
    tpu: Optional[str] = SLICE_OPTIONS["tpu"],
    zone: Optional[str] = SLICE_OPTIONS["zone"],
    project: Optional[str] = SLICE_OPTIONS["project"],
    force: bool = SLICE_OPTIONS["force"],
    num_slices: Optional[int] = NUM_SLICES_OPT,
    env: Optional[List[str]] = typer.Option(None, "--env", "-e", help="Extra KEY=VALUE for every host (repeatable)."),
    address: Optional[str] = typer.Option(None, "--address", help="auto, HOST:PORT or ray://... (default: emulate)."),
    hosts: Optional[str] = typer.Option(None, "--hosts", help="Hosts whose output reaches the terminal."),
    log_dir: str = typer.Option("runs", "--log-dir", help="Where <run-id>/attempt-<k>/host-<i>.log and summary.json go."),
    workdir: str = typer.Option(".", "--workdir", help="Directory shipped to every host; the command runs there."),
    no_ship: bool = typer.Option(False, "--no-ship", help="Do not ship the working directory."),
    kill_stale: bool = typer.Option(
        False, "--kill-stale", help="On TPU hosts, kill leftover processes holding the chips (and a stale libtpu lockfile)."
    ),
    timeout: Optional[float] = FAULT_OPTIONS["timeout"],
    stall_timeout: Optional[float] = FAULT_OPTIONS["stall_timeout"],
    max_restarts: int = FAULT_OPTIONS["max_restarts"],
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and start nothing."),
    json_out: bool = JSON_OPT,
) -> None:
    """Run COMMAND on every host (e.g. `tpulaunch exec --address auto -- pip install -r requirements.txt`).

    Same prefixed output, per-host logs and exit-code rules as `run`; the command gets the same
    environment (TPU_WORKER_ID, RANK, ...). No framework is booted.
    """
    if not command:
        raise LaunchError("no command given", "write it after --, e.g. tpulaunch exec --topology 2x8 -- hostname")
    req = run.LaunchRequest(
        command=list(command), topology=topology, accelerator=accelerator, chips_per_host=chips_per_host,
        tpu=tpu, zone=zone, project=project, force=force, num_slices=num_slices, env=list(env or []),
        kill_stale=kill_stale, address=address, distributed=False, log_dir=log_dir, workdir=workdir, ship_workdir=not no_ship,
        timeout=timeout, stall_timeout=stall_timeout, max_restarts=max_restarts,
    )
    raise typer.Exit(run_request(Output(json_mode=json_out), req, hosts=hosts, dry_run=dry_run))
