"""`tpulaunch cluster up --tpu`, `cluster join`, `cluster doctor`, and `down`/`status` of real slices.

Thin: `tpulaunch.cluster.remote` (and `.join`) does the work over gcloud ssh, `tpulaunch.host.tpu_holders` looks at the
TPU devices; this module parses and renders (a live per-host status on a terminal, one plain
line per host state change in a pipe, `--json`).
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tpulaunch.cli import options as opt
from tpulaunch.cli.output import Output
from tpulaunch.cluster.record import ClusterInfo, load_record, save_record, state_dir
from tpulaunch.cluster.worker_commands import DEFAULT_PORT as RAY_PORT_DEFAULT  # the flags' defaults are the cluster's
from tpulaunch.errors import ClusterError, DiscoveryError, ExitCode, TpulaunchError
from tpulaunch.host import tpu_holders

if TYPE_CHECKING:
    from tpulaunch.cluster.remote import Progress
    from tpulaunch.plan.slicespec import SliceSpec


class HostProgress:
    """Each host's state: a rich status line listing all hosts on a terminal, plain lines piped.

    `workers`: each slice's name and worker count. One slice's hosts are `w0`, `w1` (`worker 0`
    piped); a cluster of several slices names each host with its slice. `for_slice` gives the
    callback of one slice's hosts."""

    def __init__(self, out: Output, status, workers: dict[str, int]) -> None:
        self.out, self.st = out, status
        self.many = len(workers) > 1
        self.states: dict[str, str] = {self._short(name, w): "waiting" for name, n in workers.items() for w in range(n)}
        self.lock = threading.Lock()

    def _short(self, slice_name: str, worker: int) -> str:
        from tpulaunch.cluster.remote import HEAD

        return "head" if worker == HEAD else (f"{slice_name}/w{worker}" if self.many else f"w{worker}")

    def update(self, slice_name: str, worker: int, state: str) -> None:
        """`worker` HEAD (-1) is a head off the slice (`--head local`)."""
        from tpulaunch.cluster.remote import HEAD

        with self.lock:
            self.states[self._short(slice_name, worker)] = state
            if self.st is not None:
                self.st.update("  ".join(f"{k}: {v}" for k, v in self.states.items()))
            else:
                long = "head" if worker == HEAD else (f"{slice_name} worker {worker}" if self.many
                                                      else f"worker {worker}")
                self.out.info(f"{long}: {state}")

    def for_slice(self, name: str) -> Progress:
        """The progress callback of one slice's hosts."""
        return lambda worker, state: self.update(name, worker, state)

    # a providers.base.Progress
    def host(self, slice_name: str, worker: int, state: str) -> None:
        self.update(slice_name, worker, state)

    def note(self, text: str) -> None:
        if self.st is not None:
            self.st.update(text)
        if self.st is None or not self.out.interactive:
            self.out.info(text)


def setup_text(command: str | None, script: Path | None) -> str | None:
    """--setup CMD or --setup-script FILE (read here, sent to every worker's `bash -s`)."""
    if command is not None and script is not None:
        raise TpulaunchError("--setup and --setup-script both given", "give the command, or a file with it")
    if script is not None:
        try:
            text = script.read_text()
        except OSError as e:
            raise TpulaunchError(f"--setup-script {script} cannot be read: {e.strerror}",
                                 "give a readable file") from None
        return text
    if command is not None and not command.strip():
        raise TpulaunchError("--setup is empty", "give a command, e.g. --setup 'pip install -r requirements.txt'")
    return command


def up_remote(out: Output, tpus: list[str], zone: str | None, project: str | None, *, port: int, python: str,
              temp_dir: str | None, dashboard: bool, topology: str | None, accelerator: str | None,
              json_out: bool, head: str = "worker-0", head_ip: str | None = None, setup: str | None = None,
              spare_slices: int = 0) -> None:
    """Ray on the workers of one TPU or several (a multislice cluster: one head off the slices,
    every slice's workers joined to it)."""
    from tpulaunch import discover
    from tpulaunch.cluster.ports import free_port
    from tpulaunch.cluster.remote import LocalHead, RemoteCluster, route_ip

    if head not in ("worker-0", "local"):
        raise TpulaunchError(f"--head {head} is neither worker-0 nor local", "--head local puts the Ray head here")
    if len(set(tpus)) != len(tpus):
        raise TpulaunchError(f"--tpu names a TPU twice ({', '.join(tpus)})", "give each slice once")
    if len(tpus) > 1 and head != "local":
        raise TpulaunchError(f"{len(tpus)} TPUs with the Ray head on worker 0 of {tpus[0]}: a preemption of that one"
                             " slice would end the cluster of all of them",
                             "add --head local (the head here, off the slices)")
    rec = load_record()
    if rec is not None and rec.emulated and rec.running_here:
        raise ClusterError(f"an emulated cluster is up at {rec.address}", "stop it first with `tpulaunch cluster down`")
    specs = [discover.describe_node(t, zone=zone, project=project) for t in tpus]
    for spec in specs:
        discover.check_matches(spec, topology, accelerator)
        discover.check_ready(spec, force=False)
    if spare_slices and head != "local":
        raise TpulaunchError("--spare-slices with the Ray head on worker 0: a spare steps in when a slice is lost, and"
                             " the head would be lost with its slice", "add --head local")
    spares, made = _spare_slices(out, specs[0], spare_slices, rec)
    if rec is not None and rec.remote and (list(rec.remote.tpus), rec.remote.zone, rec.remote.project) != (
            [s.name for s in specs], specs[0].zone, specs[0].project):
        raise ClusterError(f"a cluster on TPU {', '.join(rec.remote.tpus)} is recorded as up",
                           "stop it first with `tpulaunch cluster down`")
    local = None
    if head == "local":
        if rec is not None and rec.remote is not None and rec.remote.head_here and rec.running_here:
            r = rec.remote
            local = LocalHead(ip=r.head_ip or "", temp_dir=rec.temp_dir or "",  # (running_here: it has one)
                              dashboard_port=r.dashboard_port or 0, python=r.head_python or sys.executable)
        else:
            ip = head_ip or route_ip(specs[0].workers[0].ip)
            local = LocalHead(ip=ip, temp_dir="", dashboard_port=free_port(), python=sys.executable)
    setup = setup if setup is not None else (rec.remote.setup if rec and rec.remote else None)
    cluster = RemoteCluster.new([*specs, *spares], port=port, temp_dir=temp_dir, python=python, dashboard=dashboard,
                                head=local, setup=setup, home=state_dir())
    everything = [*specs, *spares]
    n = sum(len(s.workers) for s in everything)
    with out.status(f"bringing up Ray on {n} host(s) of {', '.join(s.name for s in everything)} ...") as st:
        progress = HostProgress(out, st, {s.name: len(s.workers) for s in everything})
        info = cluster.up(progress.for_slice, before=rec)
    from dataclasses import replace as _replace

    assert info.remote is not None
    info.remote = _replace(info.remote, made=tuple(made))
    info.spares = [s.name for s in spares] if spares else (list(rec.spares) if rec is not None and rec.remote else [])
    save_record(info)
    if json_out:
        out.json({"schema": "tpulaunch.cluster/v1", "address": info.address, "emulated": False,
                  "slices": [s.to_dict() for s in info.slices], "token_path": info.token_path,
                  "remote": info.remote.to_dict(), "spares": list(info.spares)})
    else:
        where = "the head here (off the slice)" if local else "the head on worker 0"
        what = ", ".join(f"{s.name} ({s.accelerator_type}, {len(s.workers)} hosts)" for s in specs)
        out.line(f"cluster up at {info.address} on TPU {what}; {where}; token auth on; token in {info.token_path}")


def _spare_slices(out: Output, like: SliceSpec, k: int,
                  rec: ClusterInfo | None) -> tuple[list[SliceSpec], list[str]]:
    """K slices of `like`'s shape made through queued resources (`<first>-spare-<i>`, the same tier and
    runtime), waited for until ACTIVE: (their specs, the queued resources made). Spares a record of
    this cluster already has are kept, not made again."""
    if not k:
        return [], list(rec.remote.made) if rec is not None and rec.remote else []
    from tpulaunch import discover
    from tpulaunch.provision import capacity

    have = list(rec.spares) if rec is not None and rec.remote else []
    made = list(rec.remote.made) if rec is not None and rec.remote else []
    specs: list[SliceSpec] = []
    for i in range(k):
        name = f"{like.name}-spare-{i}"
        if name not in have:
            order = capacity.check_order(capacity.SliceOrder(
                name=name, project=like.project or "", zone=like.zone or "", accelerator_type=like.accelerator_type,
                tier="spot" if like.spot else "on-demand", runtime_version=like.runtime_version))
            with out.status(f"making spare slice {name} ({order.accelerator_type}, {order.tier}) ..."):
                capacity.create(order)
                made.append(name)
                capacity.wait_active(order.project, order.zone, name, 1800.0)
        specs.append(discover.describe_node(name, zone=like.zone, project=like.project))
    return specs, made


def register(cluster_app: typer.Typer) -> None:
    @cluster_app.command("join")
    def join(
        port: int = typer.Option(RAY_PORT_DEFAULT, "--port", min=1, max=65535,
                                 help="The Ray head's GCS port on worker 0."),
        timeout: float = typer.Option(300.0, "--timeout", metavar="S", help="Give up after S seconds without a head."),
        token_file: Path | None = typer.Option(None, "--token-file",
                                               help="The cluster's Ray auth token (default ~/.tpulaunch/ray_token)."),
        token_stdin: bool = typer.Option(False, "--token-stdin",
                                         help="Read the token from stdin and store it owner-only in --token-file."),
        ray_temp_dir: str | None = typer.Option(None, "--ray-temp-dir",
                                                help="Ray's temp dir (default /tmp/tpl-<hash>)."),
        json_out: bool = opt.JSON,
    ) -> None:
        """On a TPU VM: start the Ray head (worker 0) or join it (other workers), from the metadata server.

        Run it on every worker, e.g. `gcloud compute tpus tpu-vm ssh NAME --worker=all
        --command 'tpulaunch cluster join --token-stdin' < token`.
        """
        from tpulaunch import discover
        from tpulaunch.cluster.join import join_local

        out = Output(json_mode=json_out)
        if not math.isfinite(timeout) or timeout <= 0:
            raise TpulaunchError(f"--timeout {timeout:g} is not a positive number of seconds", "e.g. --timeout 300")
        local = discover.local_host()
        if local is None:
            raise DiscoveryError("this is not a TPU VM (no TPU devices, no TPU metadata)",
                                 "run `tpulaunch cluster join` on the TPU VMs, or `cluster up --tpu NAME` from"
                                 " elsewhere")
        tok = token_file or Path.home() / ".tpulaunch" / "ray_token"
        if token_stdin:
            text = sys.stdin.read().strip()
            if not text:
                raise ClusterError("--token-stdin: stdin was empty", "pipe the cluster's token in")
            tok.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tok, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tok, 0o600)
        if not tok.exists():
            raise ClusterError(f"no Ray auth token at {tok}",
                               "every worker needs the same token: pass --token-stdin (or --token-file)")
        addr = join_local(local.spec, local.worker_id, str(tok), port=port, temp_dir=ray_temp_dir, timeout=timeout,
                          progress=out.info)
        if json_out:
            out.json({"schema": "tpulaunch.cluster-join/v1", "address": addr, "worker_id": local.worker_id,
                      "head": local.worker_id == 0})
        else:
            out.line(f"worker {local.worker_id} of {local.spec.name}: "
                     + ("Ray head up at " if local.worker_id == 0 else "joined ") + addr)

    @cluster_app.command("doctor")
    def doctor(
        kill_stale: bool = typer.Option(False, "--kill-stale",
                                        help="End the processes holding the TPU and remove a stale libtpu lockfile."),
        root: Path = typer.Option(Path("/"), "--root", hidden=True, help="Look for dev/ and tmp/ under ROOT (tests)."),
        json_out: bool = opt.JSON,
    ) -> None:
        """Is this host's TPU free? Lists processes holding /dev/accel* or /dev/vfio/*, and a stale lockfile."""
        out = Output(json_mode=json_out)
        rep = tpu_holders.scan(root)
        doc = rep.to_dict()
        if kill_stale and not rep.clean:
            doc["cleared"] = tpu_holders.clear(rep)
            after = tpu_holders.scan(root)
            doc["clean_after"] = after.clean
        if json_out:
            out.json(doc)
        else:
            out.line(f"TPU devices: {', '.join(rep.devices) or 'none'}")
            for h in rep.holders:
                out.line(f"held by pid {h.pid} ({', '.join(h.paths)}): {h.cmdline}")
            if rep.lockfile_stale:
                out.line(f"stale lockfile: {rep.lockfile}")
            if "cleared" in doc:
                c = doc["cleared"]
                out.line(f"killed: {', '.join(map(str, c['killed'])) or 'none'}; lockfile removed: "
                         f"{'yes' if c['lockfile_removed'] else 'no'}"
                         + (f"; failed: {c['failed']}" if c["failed"] else ""))
            elif rep.clean:
                out.line("TPU is free")
        if not rep.clean and not doc.get("clean_after"):
            if not json_out:
                out.error("the TPU is held"
                          + ("" if kill_stale else "; `tpulaunch cluster doctor --kill-stale` clears it"))
            raise typer.Exit(ExitCode.CLUSTER)
