"""`ClusterInfo`: a Ray cluster tpulaunch knows about, and the record `cluster up` leaves behind.

The record (`$TPULAUNCH_HOME/cluster.json`, default `~/.cache/tpulaunch`) is how `--address auto`
finds the warm cluster. Typed data and a versioned JSON file (`"schema": "tpulaunch.cluster/v2"`);
no Ray import. A record of the tpulaunch before the schema (v1: the same fields, no `schema`) is
read as it was; a record of a newer tpulaunch is refused in one line naming both versions.

State that cannot be used is said to be so, in one line naming the file (`StateError`, exit 6):
a record that is corrupt, a directory, or holds fields of the wrong type; a state directory that
others may write to; a token file others may read (refused, as ssh refuses such a key) or that
holds no token. Nothing is guessed from such a file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tpulaunch.cluster import ownership
from tpulaunch.errors import StateError, TpulaunchError
from tpulaunch.plan.slicespec import SliceSpec

HOME_ENV = "TPULAUNCH_HOME"
# A detached run's supervisor on a GKE head learns its cluster from this (name, namespace, group).
GKE_ENV = "TPULAUNCH_GKE_CLUSTER"
CLUSTER_SCHEMA = "tpulaunch.cluster/v2"
V1 = "tpulaunch.cluster/v1"  # what a record without a schema field is (tpulaunch before the schema)
_FORCE_HINT = "the cluster it described may still be running: `tpulaunch cluster down --force` finds and stops it"


def state_dir() -> Path:
    """Where tpulaunch keeps cluster records and tokens (`TPULAUNCH_HOME`, default ~/.cache/tpulaunch)."""
    raw = os.environ.get(HOME_ENV)
    d = Path(raw) if raw else Path.home() / ".cache" / "tpulaunch"
    if raw is not None and not raw.strip():
        raise TpulaunchError(f"{HOME_ENV} is set but empty", "unset it, or set it to a directory of yours")
    try:
        if d.exists() and not d.is_dir():
            raise TpulaunchError(f"{HOME_ENV}={d} is a file, not a directory", "point it at a directory (or unset it)")
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # a bad value, not broken state: say so, and how long it was
            shown = str(d)[:40] + ("..." if len(str(d)) > 40 else "")
            raise TpulaunchError(f"{HOME_ENV} {shown!r} ({len(str(d))} characters) is too long a path for this system",
                                 "set it to a shorter directory (or unset it)") from None
        raise StateError(f"tpulaunch's state directory {d} cannot be used: {e.strerror}",
                         f"set {HOME_ENV} to a directory you can write") from None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateError(f"tpulaunch's state directory {d} can be written by others"
                         f" (mode {stat.S_IMODE(st.st_mode):04o}): anyone could plant a cluster record there",
                         f"chmod 700 {d}")
    return d


def writable_state_dir() -> Path:
    """`state_dir()`, proven writable by writing in it (a mode bit says nothing to root, nor of a
    read-only mount or an immutable directory). Commands that will write a record or a token ask
    this before they start anything: a cluster that could not be recorded would be left behind."""
    d = state_dir()
    try:
        fd, probe = tempfile.mkstemp(prefix=".tpl-write-check-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise StateError(f"tpulaunch's state directory {d} cannot be written ({e.strerror})",
                         f"make it writable, or set {HOME_ENV} to a directory you can write") from None
    return d


# Ray's background work on an emulated cluster, where every node shares this machine's cores with
# the hosts' training: no metrics pipeline, task events and state dumps rarely (Ray's C++ config,
# read from RAY_<name> by every Ray process: nodes, workers and the driver). Each node's work that
# looks at every other node (dumps, the dashboard agent's reporter walking the processes) costs
# N x N on one machine, where a real slice spreads it over N machines.
QUIET_RAY = {
    "RAY_enable_metrics_collection": "0",
    "RAY_task_events_report_interval_ms": "10000",
    "RAY_debug_dump_period_milliseconds": "600000",  # Ray 2.60's name (a `_ms` spelling is ignored)
    "RAY_event_stats_print_interval_ms": "600000",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",  # the dashboard agent's psutil report (default every 5 s)
    # each node's two agents learn that their raylet died from a pipe, not by polling it 2.5 times a second
    "RAY_enable_pipe_based_agent_to_parent_health_check": "1",
    # the log monitor (a `cluster up` cluster's nodes) looks for new log files every 0.5 s, not on each
    # 0.1 s pass: its idle CPU halves (0.66 -> 0.32 CPU-s per 40 s for two nodes); a new worker's
    # first lines reach its driver up to 0.5 s later
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}

# An emulated cluster listens on loopback only: its nodes' address is 127.0.0.1, the one address
# for which Ray 2.60 binds its servers (GCS, raylets, workers, agents, the dashboard's and the
# autoscaler's metrics) to 127.0.0.1 instead of every interface. Ray's Python otherwise rewrites
# 127.0.0.1 in a cluster address to this machine's outward IP (`services.resolve_ip_for_localhost`),
# where nothing of the cluster listens; this setting (Ray's own, for single-machine clusters on
# macOS and Windows: `ray_constants.ENABLE_RAY_CLUSTER`) keeps it, in every process of the cluster
# and every driver of it. Read when `ray` is imported: set before that (`connect` does).
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def on_loopback(address: str) -> bool:
    """A cluster address Ray would rewrite to this machine's outward IP (`is_localhost`)."""
    return address.removeprefix("ray://").rpartition(":")[0] in ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class RemoteSpec:
    """Where a cluster on real TPU slices runs (`cluster up --tpu A [--tpu B ...]`), for status, down
    and re-creation over gcloud ssh (`cluster/remote.py`)."""

    tpus: tuple[str, ...]  # the TPUs it spans, in order: the first holds (or first joined) the head
    zone: str
    project: str
    port: int  # the head's GCS port
    temp_dir: str  # Ray's temp dir on the workers
    python: str  # the workers' interpreter
    head: str = "worker-0"  # "worker-0": on the first TPU's worker 0; "local": on this machine, off the slices
    setup: str | None = None  # what every worker runs before it joins (`cluster up --setup`)
    head_ip: str | None = None  # head "local": its address, as the workers reach it
    dashboard_port: int | None = None  # head "local": its job API
    head_python: str | None = None  # head "local": the interpreter its supervisors run with
    made: tuple[str, ...] = ()  # the queued resources `cluster up` made (spare slices): `cluster down` deletes them

    @property
    def tpu(self) -> str:
        return self.tpus[0]

    @property
    def head_here(self) -> bool:
        return self.head == "local"

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["tpus"] = list(self.tpus)
        doc["tpu"] = self.tpu  # what records and `--json` before the schema named the first TPU
        doc["made"] = list(self.made)
        return doc

    @staticmethod
    def from_dict(d: dict) -> RemoteSpec:
        """From a record (v2, or v1: "tpu" with "tpus" only on records of several). KeyError,
        TypeError or ValueError on anything that is not one."""
        tpus = d.get("tpus") or [d["tpu"]]
        if not isinstance(tpus, list) or not tpus or not all(isinstance(t, str) and t for t in tpus):
            raise ValueError("tpus")
        head = d.get("head", "worker-0")
        if head not in ("worker-0", "local"):
            raise ValueError("head")
        spec = RemoteSpec(tuple(tpus), _str(d["zone"]), _str(d["project"]), _int(d["port"]), _str(d["temp_dir"]),
                          _str(d["python"]), head, _opt_str(d.get("setup")), _opt_str(d.get("head_ip")),
                          _opt_int(d.get("dashboard_port")), _opt_str(d.get("head_python")),
                          tuple(_str(m) for m in d.get("made") or ()))
        if spec.head_here and (spec.head_ip is None or spec.dashboard_port is None):
            raise ValueError("a local head with no address")
        return spec


@dataclass(frozen=True)
class GkeSpec:
    """A cluster on GKE: a KubeRay RayCluster that `cluster up --gke` made (`owned`), or one it
    joined (`--join`, left standing by `cluster down`), and how this machine reaches the API."""

    name: str  # the RayCluster
    namespace: str
    context: str | None = None  # the kubeconfig context (None: the current one, or in-cluster)
    kubeconfig: str | None = None  # None: KUBECONFIG or ~/.kube/config, as kubectl reads them
    owned: bool = True
    group: str = "tpu"  # its TPU worker group (slices are `<group>-<replica>`)
    objects: tuple[str, ...] = ()  # "Kind/name" of everything tpulaunch made for it, deleted by `cluster down`

    @property
    def head_service(self) -> str:
        return f"{self.name}-head-svc"

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["objects"] = list(self.objects)
        return doc

    @staticmethod
    def from_dict(d: dict) -> GkeSpec:
        """From a record; KeyError, TypeError or ValueError on anything that is not one."""
        objects = d.get("objects") or []
        if not isinstance(objects, list) or not all(isinstance(o, str) and "/" in o for o in objects):
            raise ValueError("objects")
        owned = d.get("owned", True)
        if not isinstance(owned, bool):
            raise TypeError("owned")
        return GkeSpec(_str(d["name"]), _str(d["namespace"]), _opt_str(d.get("context")), _opt_str(d.get("kubeconfig")),
                       owned, _str(d.get("group", "tpu")), tuple(objects))


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{v!r} is not a string")
    return v


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _opt_str(v: object) -> str | None:
    return None if v is None else _str(v)


def _opt_int(v: object) -> int | None:
    return None if v is None else _int(v)


@dataclass
class ClusterInfo:
    """A Ray cluster tpulaunch knows about. Persisted as JSON by `cluster up` (`save_record`)."""

    address: str
    temp_dir: str | None  # set when tpulaunch started it on this machine (emulated)
    token_path: str | None
    emulated: bool
    slices: list[SliceSpec] = field(default_factory=list)  # its slices (emulated, or the TPUs it spans)
    created: float = field(default_factory=time.time)
    remote: RemoteSpec | None = None  # a cluster on real slices: where it runs; None otherwise
    kept: bool = False  # left up by `run --keep-cluster` (stopped after `idle_timeout` s unused)
    idle_timeout: float | None = None
    log_monitor: bool = False  # its nodes forward worker output to drivers (`cluster up`: yes)
    cluster_id: str | None = None  # the id its temp dir's marker and its processes carry (`ownership`)
    dashboard: str | None = None  # host:port of its dashboard (the job API), if it runs one
    gke: GkeSpec | None = None  # a cluster on GKE (KubeRay): where it is; None otherwise
    spares: list[str] = field(default_factory=list)  # slices held in reserve: never a run's capacity until one is lost

    @property
    def running_here(self) -> bool:
        """True when this is a cluster tpulaunch started on this machine (its temp dir carries its
        marker) and it still runs."""
        if not self.cluster_id or not self.temp_dir:
            return False
        try:
            ownership.check_temp_dir(self.temp_dir, self.cluster_id, "")
        except StateError:
            return False
        return ownership.cluster_running(self.cluster_id)

    def to_dict(self) -> dict:
        """The record's JSON form (schema `tpulaunch.cluster/v2`)."""
        doc = {"schema": CLUSTER_SCHEMA, **{f.name: getattr(self, f.name) for f in fields(self)}}
        doc["slices"] = [s.to_dict() for s in self.slices]
        doc["remote"] = self.remote.to_dict() if self.remote else None
        doc["gke"] = self.gke.to_dict() if self.gke else None
        return doc

    def ray_env(self) -> dict[str, str]:
        """Environment a process needs to talk to this cluster (on an emulated one, also QUIET_RAY; on
        one at 127.0.0.1, LOOPBACK_RAY)."""
        env = {"RAY_USAGE_STATS_ENABLED": "0"}
        if self.token_path:
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN_PATH"] = self.token_path
        if self.emulated:
            env.update(QUIET_RAY)
        if on_loopback(self.address):
            env.update(LOOPBACK_RAY)
        return env


# What each field of a record may hold (JSON types); anything else is a record we cannot trust.
_TYPES: dict[str, tuple[type, ...]] = {
    "address": (str,), "temp_dir": (str, type(None)), "token_path": (str, type(None)), "emulated": (bool,),
    "slices": (list,), "created": (int, float), "remote": (dict, type(None)), "kept": (bool,),
    "idle_timeout": (int, float, type(None)), "log_monitor": (bool,), "cluster_id": (str, type(None)),
    "dashboard": (str, type(None)), "gke": (dict, type(None)), "spares": (list,),
}


# The state directory's files (and an emulated cluster's token), named here only.
EMULATED_TOKEN = "auth_token"  # inside an emulated cluster's temp dir


def record_path() -> Path:
    return state_dir() / "cluster.json"


def driver_log_path() -> Path:
    """Where Ray's own output goes when no run's `ray.log` takes it (`RaysStderr`, the CLI's exit):
    a file that is there or can be made; a link to one (or to /dev/null, to drop Ray's messages).

    Anything else (a directory, a FIFO, whose open would block, a link to nothing) is broken state,
    said in one line naming it (StateError), before Ray is asked anything. Not written elsewhere
    instead: Ray's messages are what explains a failure, and the next command would not find them."""
    p = state_dir() / "ray-driver.log"
    try:
        st = p.stat()
    except FileNotFoundError:
        if not p.is_symlink():
            return p
        raise StateError(f"tpulaunch's log of Ray's own messages {p} is a symbolic link to nothing",
                         f"remove it (rm {p}); tpulaunch makes it again") from None
    except OSError as e:
        raise StateError(f"tpulaunch's log of Ray's own messages {p} cannot be used: {e.strerror}",
                         f"remove it (rm -r {p}); tpulaunch makes it again") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a file"
        raise StateError(f"tpulaunch's log of Ray's own messages {p} is {what}",
                         f"remove it (rm -r {p}); tpulaunch makes it again")
    return p


def emulated_token_path(temp_dir: str) -> str:
    return os.path.join(temp_dir, EMULATED_TOKEN)


def save_record(info: ClusterInfo, path: Path | None = None) -> None:
    """Write the record (this machine's, or a copy at `path`: a run's `cluster.json`)."""
    p = path or record_path()
    tmp = p.with_name(p.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info.to_dict(), f, indent=2)
        os.replace(tmp, p)  # whole or not at all: a killed writer never leaves half a record
    except OSError as e:
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink()
        raise StateError(f"the cluster record {p} cannot be written: {e.strerror} ({tmp})",
                         f"remove what is in the way, or set {HOME_ENV} to a directory you can write") from None


def load_record(path: Path | None = None) -> ClusterInfo | None:
    """The record (or the copy at `path`), None if there is none; StateError if it cannot be read
    or trusted."""
    p = path or record_path()
    if not p.exists() and not p.is_symlink():
        return None
    if p.is_dir():
        raise StateError(f"cluster record {p} is a directory, not a file", f"remove it (rm -r {p}); {_FORCE_HINT}")
    text = read_state_file(p, "cluster record")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise StateError(f"cluster record {p} is corrupt (nested too deep)", _FORCE_HINT) from None
    except ValueError as e:
        where = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise StateError(f"cluster record {p} is corrupt ({where})", _FORCE_HINT) from None
    if not isinstance(doc, dict):
        raise StateError(f"cluster record {p} is corrupt (a {type(doc).__name__}, not an object)", _FORCE_HINT)
    schema = doc.get("schema", V1)
    if schema not in (V1, CLUSTER_SCHEMA):
        raise StateError(f"cluster record {p} is {str(schema)[:60]!r}, from another tpulaunch; this one reads"
                         f" {CLUSTER_SCHEMA} (and {V1})", "use that tpulaunch, or " + _FORCE_HINT)
    known = {f.name for f in fields(ClusterInfo)}
    for name, value in doc.items():
        if name in _TYPES and not isinstance(value, _TYPES[name]):
            raise StateError(f"cluster record {p}: field '{name}' is {value!r}, not a {_TYPES[name][0].__name__}",
                             _FORCE_HINT)
    for name in ("address", "temp_dir", "token_path", "emulated"):
        if name not in doc:
            raise StateError(f"cluster record {p} has no '{name}'", _FORCE_HINT)
    fields_ = {k: v for k, v in doc.items() if k in known}
    try:
        fields_["slices"] = [SliceSpec.from_dict(s) for s in doc.get("slices", [])]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise StateError(f"cluster record {p}: field 'slices' holds something other than slices", _FORCE_HINT) from None
    try:
        fields_["remote"] = RemoteSpec.from_dict(doc["remote"]) if doc.get("remote") is not None else None
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"cluster record {p}: field 'remote' is not a cluster on TPUs ({type(e).__name__}: {e})"[:300],
                         _FORCE_HINT) from None
    try:
        fields_["gke"] = GkeSpec.from_dict(doc["gke"]) if doc.get("gke") is not None else None
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"cluster record {p}: field 'gke' is not a cluster on GKE ({type(e).__name__}: {e})"[:300],
                         _FORCE_HINT) from None
    if not all(isinstance(x, str) for x in fields_.get("spares", [])):
        raise StateError(f"cluster record {p}: field 'spares' holds something other than slice names", _FORCE_HINT)
    if fields_["remote"] is not None and not fields_["slices"]:
        raise StateError(f"cluster record {p}: a cluster on TPUs with no slices", _FORCE_HINT)
    return ClusterInfo(**fields_)


MAX_STATE_FILE = 1 << 20  # a record, a status file: a few KiB; anything past 1 MiB is not one


def read_state_file(p: Path, what: str) -> str:
    """A state file's text: only a regular file (never through a symlink, never a FIFO that would
    hang the read) of at most 1 MiB, in UTF-8; anything else is one line (StateError, exit 6)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        why = "a symbolic link (not followed)" if p.is_symlink() else e.strerror
        raise StateError(f"{what} {p} cannot be read: {why}", _FORCE_HINT) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{what} {p} is not a regular file", f"remove it; {_FORCE_HINT}")
        data = f.read(MAX_STATE_FILE + 1)
    if len(data) > MAX_STATE_FILE:
        raise StateError(f"{what} {p} is larger than {MAX_STATE_FILE} bytes: not one tpulaunch wrote", _FORCE_HINT)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise StateError(f"{what} {p} is not UTF-8 text (corrupt)", _FORCE_HINT) from None


def clear_record() -> None:
    p = record_path()
    if p.is_dir() and not p.is_symlink():
        return  # not ours to remove: load_record says what it is
    p.unlink(missing_ok=True)


def check_token_file(path: str, source: str = "token file") -> str:
    """The token in `path`, after checking it is ours to use: a file only its owner can read,
    holding one token. StateError otherwise (as ssh refuses a private key others can read)."""
    p = Path(path)
    try:
        st = p.lstat()
    except OSError as e:
        raise StateError(f"{source} {p} cannot be read: {e.strerror}",
                         "is the cluster up? (`tpulaunch cluster status`)") from None
    if stat.S_ISLNK(st.st_mode):  # its target's content would be sent as the token to whatever the record names
        raise StateError(f"{source} {p} is a symbolic link: a token is never read through one",
                         "bring the cluster up again (its token is a file of its own)")
    if not stat.S_ISREG(st.st_mode):
        raise StateError(f"{source} {p} is not a file",
                         "point RAY_AUTH_TOKEN_PATH (or the record) at the cluster's token")
    if st.st_mode & 0o077:
        raise StateError(f"{source} {p} can be read by others (mode {stat.S_IMODE(st.st_mode):04o}): anyone on this"
                         " machine could use the cluster", f"chmod 600 {p}")
    try:
        token = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise StateError(f"{source} {p} does not hold a token ({e})", "restore it from the cluster's head") from None
    if not token or any(c.isspace() for c in token) or not token.isprintable():
        raise StateError(f"{source} {p} does not hold a token (expected one word of printable characters)",
                         "restore it from the cluster's head, or bring the cluster up again")
    return token
