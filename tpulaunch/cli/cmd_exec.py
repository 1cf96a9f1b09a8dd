"""`tpulaunch exec -- COMMAND ARGS...`: run one command on every host of the slice."""

from __future__ import annotations

import typer

from tpulaunch import discover, run
from tpulaunch.cli import app
from tpulaunch.cli import options as opt
from tpulaunch.cli.cmd_run import run_request
from tpulaunch.cli.output import Output
from tpulaunch.errors import LaunchError


@app.command("exec")
def exec_cmd(
    command: list[str] = typer.Argument(..., help="The command and its arguments (after --)."),
    topology: str | None = opt.TOPOLOGY,
    accelerator: str | None = opt.ACCELERATOR,
    chips_per_host: int | None = opt.CHIPS_PER_HOST,
    tpu: str | None = opt.TPU,
    zone: str | None = opt.ZONE,
    project: str | None = opt.PROJECT,
    force: bool = opt.FORCE,
    num_slices: int | None = opt.NUM_SLICES,
    env: list[str] | None = opt.ENV,
    env_file: list[str] | None = opt.ENV_FILE,
    show_env: bool = opt.SHOW_ENV,
    address: str | None = typer.Option(None, "--address", help="auto, HOST:PORT or ray://... (default: emulate)."),
    hosts: str | None = opt.HOSTS,
    log_dir: str = typer.Option("runs", "--log-dir",
                                help="Where <run-id>/attempt-<k>/host-<i>.log and summary.json go."),
    workdir: str = typer.Option(".", "--workdir", help="Directory shipped to every host; the command runs there."),
    no_ship: bool = typer.Option(False, "--no-ship", help="Do not ship the working directory."),
    kill_stale: bool = opt.KILL_STALE,
    keep_children: bool = opt.KEEP_CHILDREN,
    no_preflight: bool = opt.NO_PREFLIGHT,
    straggler_ratio: float = opt.STRAGGLER_RATIO,
    coordinator_port: int | None = opt.COORDINATOR_PORT,
    timeout: float | None = opt.TIMEOUT,
    stall_timeout: float | None = opt.STALL_TIMEOUT,
    max_restarts: int = opt.MAX_RESTARTS,
    dry_run: bool = opt.DRY_RUN,
    json_out: bool = opt.JSON,
) -> None:
    """Run COMMAND on every host (e.g. `tpulaunch exec --address auto -- pip install -r requirements.txt`).

    Same prefixed output, per-host logs and exit-code rules as `run`; the command gets the same
    environment (TPU_WORKER_ID, RANK, ...). No framework is booted.
    """
    if not command:
        raise LaunchError("no command given", "write it after --, e.g. tpulaunch exec --topology 2x8 -- hostname")
    req = run.LaunchRequest(
        command=tuple(command),
        slices=discover.SliceRequest(topology=topology, accelerator=accelerator, chips_per_host=chips_per_host,
                                     tpu=tpu, zone=zone, project=project, force=force, num_slices=num_slices),
        env=run.client_env(env, env_file), kill_stale=kill_stale, keep_children=keep_children,
        preflight=not no_preflight, straggler_ratio=straggler_ratio, address=address,
        coordinator_port=coordinator_port, distributed=False, log_dir=log_dir,
        workdir=workdir, ship_workdir=not no_ship, timeout=timeout, stall_timeout=stall_timeout,
        max_restarts=max_restarts,
    )
    raise typer.Exit(run_request(Output(json_mode=json_out), req, hosts=hosts, dry_run=dry_run, show_env=show_env))
