"""Prepare a launch: from the request (flags) to the `LaunchPlan`, connecting nowhere.

Shared by `tpulaunch run` and `tpulaunch exec`. The CLI builds a `LaunchRequest` from flags;
`find_cluster()` says which cluster it goes to (from `--address`, `RAY_ADDRESS` and the local
record only); the launch step (`run.launch.Connection`) reads what that cluster holds, once; and
`prepare()` turns the request and those facts into the plan, which is all `--dry-run` prints.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tpulaunch import discover, settings
from tpulaunch.cluster.connect import connect_timeout, resolve_address
from tpulaunch.cluster.ports import free_port
from tpulaunch.cluster.record import ClusterInfo, load_record
from tpulaunch.cluster.worker_commands import DEFAULT_PYTHON
from tpulaunch.errors import LaunchError, StateError, TpulaunchError
from tpulaunch.host import frameworks
from tpulaunch.plan import torch_tpu
from tpulaunch.plan.frameworks import Framework
from tpulaunch.plan.frameworks import facts as fw_facts
from tpulaunch.plan.frameworks import ports as plan_ports
from tpulaunch.plan.launch import LaunchPlan, build_plan, default_compile_cache, new_run_id, parse_env
from tpulaunch.plan.mesh import plan_mesh
from tpulaunch.run.policy import Budgets
from tpulaunch.run.supervision import Lifecycle, Recovery, Supervision, Watching

WORKDIR_EXCLUDES = [".git", ".venv", "venv", "runs", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
                    ".ruff_cache", "node_modules"]


def read_env_file(path: str) -> str:
    """An `--env-file`: a regular file of at most 1 MiB, UTF-8; anything else is one line (exit 2)."""
    import stat

    from tpulaunch.plan.launch import MAX_ENV_FILE_BYTES

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise LaunchError(f"--env-file {path[:200]} is not a regular file", "give a dotenv file (NAME=value lines)")
        if st.st_size > MAX_ENV_FILE_BYTES:
            raise LaunchError(f"--env-file {path[:200]} is {st.st_size} bytes", "an env file is at most 1 MiB")
        with open(path, "rb") as f:
            return f.read(MAX_ENV_FILE_BYTES + 1).decode()
    except UnicodeDecodeError:
        raise LaunchError(f"--env-file {path[:200]} is not UTF-8 text", "write it as NAME=value lines") from None
    except OSError as e:
        raise LaunchError(f"--env-file {path[:200]}: {e.strerror}", "give a readable dotenv file") from None


def client_env(items: list[str] | tuple[str, ...] | None, files: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--env` / `--env-file` resolved on the client (its environment, its files)."""
    from tpulaunch.plan.launch import resolve_env

    return resolve_env(items, files, os.environ, read_env_file)


@dataclass(frozen=True)
class LaunchRequest:
    """What `run` / `exec` were asked to do, as given (checked by `prepare`)."""

    script: str = ""
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()  # exec: a command instead of a script
    slices: discover.SliceRequest = field(default_factory=discover.SliceRequest)
    mesh: str | None = None
    placement: str = "auto"  # how the mesh is laid onto the chips (`plan.placement`)
    framework: str = "auto"
    env: tuple[str, ...] = ()
    address: str | None = None
    distributed: bool = True
    log_dir: str = "runs"
    workdir: str = "."
    coordinator_port: int | None = None
    schedule_timeout: float = 120.0
    max_upload_mb: float = 100.0
    ship_workdir: bool = True
    kill_stale: bool = False
    keep_children: bool = False  # leave what a host's script started running after it exits
    preflight: bool = True  # check every host before any script starts (`run.preflight`)
    run_id: str | None = None
    # faults (see tpulaunch.run.policy)
    timeout: float | None = None  # wall clock for the whole run
    stall_timeout: float | None = None  # no output or heartbeat from any host for this long
    straggler_ratio: float = 0.7  # name a host whose step rate is below this x the median (0: never)
    max_restarts: int = 0  # relaunches after a host failed
    max_preemptions: int = 0  # relaunches after a host was lost or preempted
    preemption_wait: float = 600.0  # how long to wait for the slice to be whole again
    preemption_grace: float = 30.0  # a preempted script's time between SIGTERM and SIGKILL
    recreate: bool = False  # a preempted slice is made again through the Cloud TPU API (`run.recovery.recreate`)
    # a hang's culprit slices are replaced (a spare, re-created, or dropped) and the run restarts
    replace_hung: bool = False
    compile_cache: str | None = None  # persistent compilation cache dir; None: the default one
    no_compile_cache: bool = False
    python: str | None = None  # the interpreter each host runs the script with (its own environment)
    min_slices: int | None = None  # elastic: go on with at least this many slices after one is lost
    # elastic: grow back this long after the lost slices are back (None: at a checkpoint)
    grow_after: float | None = None
    cpu_devices: bool = False  # on a real cluster, CPU devices stand in for the chips (a CI cluster with no TPU)
    keep_cluster: bool = False  # leave an emulated cluster this run starts up for the next runs
    idle_timeout: float = 1800.0  # ... and stop it after this long unused
    # compile every program for the target TPU in one process here, instead of launching (`tpulaunch.rehearse`)
    rehearse: bool = False


@dataclass(frozen=True)
class Checked:
    """A request after `check`: its values judged once (exit 2 otherwise), its working directory and
    script found, its `--env` parsed, its supervision grouped. What every later step takes."""

    request: LaunchRequest
    workdir: Path
    script: str  # inside the working directory (the command's first word for `exec`)
    user_env: dict[str, str]
    supervision: Supervision


@dataclass(frozen=True)
class Prepared:
    """What `launch` needs, and all it reads: the plan, how to supervise it, the cluster."""

    plan: LaunchPlan
    resolved: discover.ResolvedSlices
    cluster: ClusterInfo | None  # an existing cluster to run on (None: start an emulated one)
    framework_reason: str
    supervision: Supervision
    runtime_env: dict | None  # the working directory Ray ships to every real host (checked for size)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """Which cluster a request goes to, decided from local facts only."""

    cluster: ClusterInfo | None
    notes: tuple[str, ...] = ()



def find_cluster(req: LaunchRequest) -> Target:
    """`--address` / `RAY_ADDRESS` / `auto`, or an emulated cluster of the same slices left up here."""
    cluster = resolve_address(req.address)
    if cluster is None and req.address is None:
        try:
            cluster = _warm_cluster_for(req)
        except StateError as e:  # no record to trust: this run starts a cluster of its own, and says why
            return Target(None, (f"{e.message}; starting a cluster of this run's own ({e.hint})",))
        if cluster is not None:
            return Target(cluster, (f"running on the emulated cluster already up at {cluster.address}"
                                    " (`tpulaunch cluster down` stops it)",))
    return Target(cluster)


def is_local(cluster: ClusterInfo) -> bool:
    """The cluster's head runs on this machine and was started from it (emulated, or `cluster up
    --head local` recorded here): a run supervised here lives as long as the head does. Any other
    cluster is remote: runs go to its head as jobs (`run.detached`)."""
    return cluster.emulated or bool(cluster.temp_dir)


def head_python(cluster: ClusterInfo) -> str:
    """The Python with tpulaunch on the cluster's head: the record's (a head off the slice), this
    one (a head here), or what a TPU VM's shell calls `python3`."""
    if cluster.remote and cluster.remote.head_python:
        return cluster.remote.head_python
    return sys.executable if is_local(cluster) else DEFAULT_PYTHON


def check(req: LaunchRequest | Checked) -> Checked:
    """The request checked once, before anything starts or is submitted (a `Checked` is returned as it is)."""
    if isinstance(req, Checked):
        return req
    user_env = validate(req)
    workdir = checked_workdir(req)
    script = req.script if req.command else check_script(req, workdir)
    return Checked(req, workdir, script, user_env, supervision_of(req))


def supervision_of(req: LaunchRequest) -> Supervision:
    """The request's supervision flags, grouped (their values checked by `validate`)."""
    return Supervision(
        Budgets(req.max_restarts, req.max_preemptions, req.kill_stale, req.min_slices or 0, req.replace_hung),
        Recovery(req.recreate, req.preemption_wait, req.preemption_grace, req.grow_after),
        Watching(req.schedule_timeout, req.timeout, req.stall_timeout, req.straggler_ratio, req.preflight),
        Lifecycle(req.keep_cluster, req.idle_timeout, req.keep_children),
    )


def check_script(req: LaunchRequest, workdir: Path | None = None) -> str:
    """The script's path inside the working directory (checked: it exists, it is inside)."""
    workdir = workdir or checked_workdir(req)
    path = Path(req.script)
    full = path if path.is_absolute() else (Path.cwd() / path)
    if not full.is_file():
        raise LaunchError(f"script {req.script} not found", "give the path of a Python file to run on every host")
    try:
        return str(full.resolve().relative_to(workdir))
    except ValueError:
        raise LaunchError(f"script {req.script} is outside the working directory {workdir}",
                          "run from the directory that holds it, or pass --workdir") from None


def _framework(req: LaunchRequest, workdir: Path) -> tuple[Framework, str]:
    if req.command:
        return Framework.TORCH_XLA, "exec runs a command, no framework boot"
    if req.framework != "auto":
        return fw_facts(req.framework).name, "--framework"
    return frameworks.detect((workdir / req.script).read_text(errors="replace"))


def checked_workdir(req: LaunchRequest) -> Path:
    """The working directory, after checking it exists."""
    workdir = Path(req.workdir).resolve()
    if not workdir.exists():
        raise LaunchError(f"working directory {req.workdir} does not exist", "pass an existing --workdir")
    if not workdir.is_dir():
        raise LaunchError(f"working directory {req.workdir} is a file, not a directory",
                          "pass a directory as --workdir")
    if not os.access(workdir, os.R_OK | os.X_OK):
        raise LaunchError(f"working directory {req.workdir} cannot be read by this user",
                          "pass a directory you can read")
    return workdir


def shipped_workdir(checked: LaunchRequest | Checked) -> dict | None:
    """The `runtime_env` that ships the working directory to real hosts, after its size check.

    Checked for emulated runs too, before anything starts: a rehearsal refuses what the slice would.
    """
    c = check(checked)
    req, workdir = c.request, c.workdir
    if not req.ship_workdir:
        return None
    from tpulaunch.cluster.record import state_dir

    # The run's own logs and tpulaunch's state (its token) never travel with the code: they change
    # every run, and Ray keys the shipped copy (and the hosts' warm agents) by its content.
    inside = [_relative(Path(req.log_dir), workdir), _relative(state_dir(), workdir)]
    return workdir_runtime_env(str(workdir), req.max_upload_mb, [p for p in inside if p])


def _relative(path: Path, root: Path) -> str | None:
    """`path` as a `/`-anchored pattern relative to `root`, if it lies inside it."""
    try:
        rel = (path if path.is_absolute() else Path.cwd() / path).resolve().relative_to(root.resolve())
    except ValueError:
        return None
    return "/" + rel.as_posix() if rel.parts else None


def prepare(checked: LaunchRequest | Checked, target: Target, seen: discover.ClusterSlices | None,
            runtime_env: dict | None) -> Prepared:
    """The request, what its cluster holds (`seen`) and the shipped working directory -> the plan,
    and the supervision checked against the cluster it goes to.

    Starts and connects nothing (discovery may ask the Cloud TPU API or the metadata server).
    """
    c = check(checked)
    req, workdir, script = c.request, c.workdir, c.script
    cluster = target.cluster
    resolved = discover.resolve(req.slices, seen)
    local = (resolved.emulated and cluster is None) or (cluster is not None and cluster.emulated)
    emulated = local or resolved.emulated or req.cpu_devices
    if req.cpu_devices and cluster is None:
        raise LaunchError("--cpu-devices is for a real cluster's hosts (--address); with none, the slice is emulated"
                          " on CPU devices anyway", "drop --cpu-devices, or pass --address")
    if local and cluster is None and not req.rehearse:  # a rehearsal is one process, whatever the hosts
        from tpulaunch.cluster.emulated import check_capacity

        check_capacity(resolved.topology.num_hosts * resolved.num_slices)  # this run starts the cluster
    if local:
        runtime_env = None  # emulated hosts share this filesystem: the script runs in place
    fw, reason = _framework(req, workdir)
    if req.python is not None:
        check_python(req.python, local)
    elif not req.command:  # with --python the framework is the hosts' interpreter's to have
        frameworks.require_installed(fw)
    mesh = plan_mesh(resolved.topology, req.mesh, req.slices.dcn, resolved.num_slices, req.placement)
    run_id = req.run_id or new_run_id()
    facts = fw_facts(fw)
    if facts.per_device:
        torch_tpu.check_generation(resolved.topology)
    ports = plan_ports(facts, local=local, emulated=emulated, command=bool(req.command), base=req.coordinator_port,
                       free=free_port)
    plan = build_plan(
        slices=list(resolved.slices), mesh=mesh, script=script, args=req.args, framework=fw,
        user_env=c.user_env, run_id=run_id, coordinator_port=ports.coordinator,
        group_port=ports.group,  # tpulaunch's own gloo group, apart from MASTER_PORT
        jax_coordinator_port=ports.jax, emulated=emulated,
        emulation_env=frameworks.get(fw).emulation_env(resolved.topology, resolved.num_slices),
        emulation_port=ports.emulation, local=local,
        exit_port=ports.exit,  # torch_xla's hosts leave in order (host/leave.py)
        # every real host is a TPU VM whose metadata server knows its slice (torus wraparound and
        # more than the plan holds): a queued resource's nodes too, however they were found
        metadata_server=not emulated, distributed=req.distributed and not req.command,
        log_dir=str((Path(req.log_dir) / run_id).resolve()), workdir=str(workdir), command=tuple(req.command),
        python=req.python, hang_s=req.stall_timeout,
        compile_cache=None if (req.no_compile_cache or req.command) else (
            req.compile_cache or default_compile_cache(fw, resolved.topology, resolved.num_slices, emulated)),
    )
    if req.min_slices is not None:
        from tpulaunch.run.recovery import elastic

        elastic.check(plan, req.min_slices)
        if not req.max_preemptions:
            raise LaunchError("--min-slices needs --max-preemptions: shrinking after a lost slice counts as one",
                              "add --max-preemptions N (how many lost slices the run may survive)")
    if req.grow_after is not None and (req.min_slices is None or not math.isfinite(req.grow_after)
                                       or req.grow_after < 0):
        raise LaunchError(f"--grow-after {req.grow_after:g} needs --min-slices and 0 or more seconds",
                          "e.g. --min-slices 1 --grow-after 60 (default: grow at the first checkpoint)")
    c.supervision.check(cluster, local)
    return Prepared(plan, resolved, cluster, reason, c.supervision, runtime_env, (*resolved.notes, *target.notes))


def check_python(python: str, emulated: bool) -> None:
    """`--python`: an absolute path (it names a file on every host); on an emulated slice the hosts
    are this machine, so it must be an executable here too."""
    if not python.startswith("/"):
        raise LaunchError(f"--python {python[:80]!r} is not an absolute path",
                          "give the interpreter of the hosts' environment, e.g. --python /opt/venv/bin/python")
    if emulated and not os.access(python, os.X_OK):
        raise LaunchError(f"--python {python[:80]} is not an executable on this machine",
                          "give the python of the environment the script needs (e.g. a venv's bin/python)")


def recorded_slices(cluster: ClusterInfo) -> discover.ClusterSlices:
    """The slices of an emulated cluster a run may have, as its record lists them (its spares not)."""
    from dataclasses import replace

    mine = [s for s in cluster.slices if s.name not in cluster.spares]
    return discover.ClusterSlices(True, tuple(replace(s, slice_index=i) for i, s in enumerate(mine)),
                                  spares=tuple(cluster.spares))


def _warm_cluster_for(req: LaunchRequest) -> ClusterInfo | None:
    """An emulated cluster tpulaunch left running here (`cluster up`, `run --keep-cluster`) that
    holds exactly the slices asked for: a run with no --address takes it instead of starting one."""
    if req.slices.tpu or req.slices.queued_resource:
        return None
    rec = load_record()
    if rec is None or not rec.emulated or not rec.running_here:
        return None
    try:
        discover.resolve(req.slices, recorded_slices(rec))
    except TpulaunchError:
        return None  # another slice: start a cluster of its own
    from tpulaunch.cluster import reaper

    assert rec.temp_dir is not None  # running_here: its temp dir carries its marker
    reaper.touch(rec.temp_dir)  # taken: its idle reaper waits again from now (the run marks it in use once connected)
    return rec


MAX_COUNT = 1_000_000  # restarts, preemptions
MAX_PATH = 4096  # PATH_MAX


def validate(req: LaunchRequest) -> dict[str, str]:
    """Values Typer parses but cannot judge, checked before anything else happens (exit 2); the
    parsed `--env`."""
    positive = [("--schedule-timeout", req.schedule_timeout, "seconds"), ("--max-upload-mb", req.max_upload_mb, "MiB"),
                ("--idle-timeout", req.idle_timeout, "seconds"),
                ("--timeout", req.timeout, "seconds"), ("--stall-timeout", req.stall_timeout, "seconds")]
    for flag, value, unit in positive:
        if value is not None and (not math.isfinite(value) or not value > 0):
            raise LaunchError(f"{flag} {value:g} is not a positive number", f"give it in {unit}, above 0")
    for flag, count in (("--max-restarts", req.max_restarts), ("--max-preemptions", req.max_preemptions)):
        if not 0 <= count <= MAX_COUNT:  # compared as ints: a 400-digit count is one line, not an overflow
            raise LaunchError(f"--{flag.lstrip('-')} {str(count)[:20]}{'...' if len(str(count)) > 20 else ''} is not"
                              f" a count from 0 to {MAX_COUNT}", f"use a count from 0 to {MAX_COUNT}")
    for flag, value in (("--preemption-wait", req.preemption_wait), ("--preemption-grace", req.preemption_grace)):
        if not math.isfinite(value) or value < 0:
            raise LaunchError(f"{flag} {value:g} is not a number of 0 or more", "use 0 or more")
    for flag, text in (("SCRIPT", req.script), ("--log-dir", req.log_dir), ("--workdir", req.workdir),
                       ("--compile-cache", req.compile_cache or ""), ("--python", req.python or "")):
        if len(text) > MAX_PATH:
            raise LaunchError(f"{flag} is {len(text)} characters long", f"a path has at most {MAX_PATH}")
    if not math.isfinite(req.straggler_ratio) or not 0 <= req.straggler_ratio < 1:
        raise LaunchError(f"--straggler-ratio {req.straggler_ratio:g} is not a fraction below 1",
                          "e.g. 0.7 (a host below 0.7x the median step rate is named); 0 turns it off")
    if req.coordinator_port is not None and not 0 < req.coordinator_port <= 65533:
        raise LaunchError(f"--coordinator-port {req.coordinator_port} is not a TCP port", "use 1-65533")
    if req.command and not any(w.strip() for w in req.command):
        raise LaunchError("the command to run is empty",
                          "write it after --, e.g. tpulaunch exec --topology 2x8 -- hostname")
    if not req.command and not req.script.strip():
        raise LaunchError("no script given", "tpulaunch run SCRIPT.py --topology 2x8")
    if req.rehearse and (req.address is not None or req.python is not None):
        raise LaunchError(f"--rehearse compiles here, in one process of this Python, and starts no cluster: it goes"
                          f" without {'--address' if req.address is not None else '--python'}",
                          "name the slice with --topology/--accelerator (or --tpu)")
    discover.request_num_slices(req.slices)  # --num-slices / --dcn bounded before any slice is planned
    check_log_dir(req.log_dir)
    if req.compile_cache and "://" not in req.compile_cache:  # a local cache dir (gs:// is the framework's)
        check_log_dir(req.compile_cache, "--compile-cache")
    connect_timeout()  # read now: a bad value must not surface after a cluster was started
    user_env = parse_env(list(req.env))
    for name, default in settings.HOST_SECONDS.items():
        settings.seconds(name, default, user_env.get(name, os.environ.get(name, "")))
    return user_env


_PSEUDO_FS = ("/proc", "/sys", "/dev")


def check_log_dir(log_dir: str, flag: str = "--log-dir") -> Path:
    """`--log-dir` (or `flag`) must be (or be creatable as) a directory this user can write, on a real
    filesystem. Nothing is created here (a dry run leaves no trace): the nearest existing ancestor is checked."""
    path = Path(log_dir).expanduser().resolve()
    if any(path == Path(fs) or Path(fs) in path.parents for fs in _PSEUDO_FS):
        raise LaunchError(f"{flag} {log_dir} is under {path.parts[0]}{path.parts[1]}, which holds no files",
                          f"give a directory on a real filesystem, e.g. {flag} runs")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise LaunchError(f"{flag} {log_dir}: {existing} is a file, not a directory", "give a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LaunchError(f"{flag} {log_dir}: {existing} is not writable by this user",
                          "give a directory you can write")
    return path


def workdir_runtime_env(workdir: str, max_mb: float, also_exclude: list[str] | None = None) -> dict:
    """Ray `runtime_env` shipping the user's directory to every host, after a size check.
    `also_exclude`: `/`-anchored paths inside it (gitignore style, as Ray reads `excludes`)."""
    root = Path(workdir)
    total = 0
    skip = {e for e in WORKDIR_EXCLUDES if "*" not in e}
    anchored = {root / p.lstrip("/") for p in also_exclude or ()}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and Path(dirpath, d) not in anchored]
        for name in filenames:
            if name.endswith(".pyc"):
                continue
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    if total > max_mb * 1024 * 1024:
        raise LaunchError(
            f"the working directory {workdir} is {total / 2**20:.1f} MiB, over the {max_mb:g} MiB limit for shipping"
            " to hosts",
            "run from a smaller directory, move data out of it, or raise --max-upload-mb",
        )
    return {"working_dir": str(root), "excludes": [*WORKDIR_EXCLUDES, *(also_exclude or ())]}
