"""What tpulaunch may stop or delete on this machine: only what it can prove it created.

A cluster tpulaunch starts here gets a random id. Three pieces of evidence carry it, and nothing
is stopped or deleted without them:

* its temp dir is `/tmp/tpl-*` (tpulaunch's own naming), a real directory (no symlink) owned by
  this user, holding the marker file `tpulaunch-cluster` with the id;
* every process of the cluster (Ray's and the host processes under it) is started with
  `TPULAUNCH_CLUSTER_ID=<id>` in its environment, an exact entry, not a substring of some argument.
  Ray's agents and workers rename themselves (setproctitle), which can wipe what /proc shows of
  their environment; they are known by the files they hold open inside the verified temp dir;
* the cluster record (`cluster.json`) names the id.

A record whose temp dir fails the check is refused with one line saying which field is wrong and
how to clean up by hand: `cluster down` never trusts a path just because a file names it.
`find_orphans()` finds clusters by their markers alone, for `cluster down --force` when the
record is gone or unreadable.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tpulaunch import procfs
from tpulaunch.cluster.processes import names_dir
from tpulaunch.cluster.worker_stop import below, is_rays
from tpulaunch.errors import StateError

MARKER = "tpulaunch-cluster"  # the file inside a cluster's temp dir that says it is ours
ID_ENV = "TPULAUNCH_CLUSTER_ID"  # in the environment of every process of the cluster
PREFIX = "tpl-"


def new_cluster_id() -> str:
    return secrets.token_hex(8)


def temp_root() -> Path:
    return Path(tempfile.gettempdir())


def make_temp_dir(cluster_id: str, home: Path) -> str:
    """A new `/tmp/tpl-*` dir (short: Ray's socket paths must fit 107 bytes) with the marker in it,
    naming the cluster and the state directory (`TPULAUNCH_HOME`) that started it."""
    path = tempfile.mkdtemp(prefix=PREFIX, dir=str(temp_root()))
    fd = os.open(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"cluster_id": cluster_id, "home": str(home.resolve()), "created": time.time(),
                   "pid": os.getpid()}, f)
    return path


def _marker(temp_dir: str) -> dict | None:
    path = Path(temp_dir, MARKER)
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    cid = doc.get("cluster_id") if isinstance(doc, dict) else None
    return doc if isinstance(cid, str) and cid else None


def marker_id(temp_dir: str) -> str | None:
    """The id in the marker of `temp_dir`, or None when there is no readable marker of ours."""
    doc = _marker(temp_dir)
    return doc["cluster_id"] if doc else None


def _started_elsewhere(doc: dict, home: Path) -> bool:
    """The marker names another state directory that still exists: another TPULAUNCH_HOME's cluster
    (a parallel CI job's), not one this home lost track of."""
    other = doc.get("home")
    return isinstance(other, str) and Path(other) != home.resolve() and Path(other).is_dir()


def check_temp_dir(temp_dir: object, cluster_id: object, record: str, home: Path | None = None) -> str:
    """`temp_dir` if it is a cluster dir tpulaunch made for `cluster_id` (and, given `home`, started
    from that state directory: a record copied into another home stops nothing); else StateError."""
    where = f"cluster record {record}"
    fix = (f"it is not one tpulaunch made, so nothing was stopped or deleted; remove the record (rm {record})"
           " and stop that cluster's processes yourself, or `tpulaunch cluster down --force` to find ours by marker")
    if not isinstance(temp_dir, str) or not temp_dir:
        raise StateError(f"{where}: field 'temp_dir' is {temp_dir!r}, not a path", fix)
    p = Path(temp_dir)
    if not p.is_absolute() or p.parent != temp_root() or not p.name.startswith(PREFIX):
        raise StateError(f"{where}: field 'temp_dir' is {temp_dir}, not a {temp_root()}/{PREFIX}* directory", fix)
    try:
        st = p.lstat()
    except FileNotFoundError:
        return temp_dir  # already gone: nothing to delete, its processes are found by id
    except OSError as e:
        raise StateError(f"{where}: field 'temp_dir' ({temp_dir}) cannot be read: {e.strerror}", fix) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise StateError(f"{where}: field 'temp_dir' ({temp_dir}) is not a directory of this user", fix)
    if not isinstance(cluster_id, str) or not cluster_id:
        raise StateError(f"{where} has no 'cluster_id' (written by an older tpulaunch?)", fix)
    found = marker_id(temp_dir)
    if found != cluster_id:
        what = "has no tpulaunch marker" if found is None else f"is marked for cluster {found}"
        raise StateError(f"{where}: field 'temp_dir' ({temp_dir}) {what}, not for cluster {cluster_id}", fix)
    doc = _marker(temp_dir) or {}
    if home is not None and _started_elsewhere(doc, home):
        raise StateError(f"{where} is a copy: cluster {cluster_id} was started from TPULAUNCH_HOME={doc['home']}",
                         f"stop it from there (TPULAUNCH_HOME={doc['home']} tpulaunch cluster down); nothing was"
                         " stopped or deleted")
    return temp_dir


def cluster_running(cluster_id: str) -> bool:
    """Does any live process carry the cluster's id? (The first one answers: no walk below it.)"""
    entry = f"{ID_ENV}={cluster_id}".encode()
    return any(procfs.alive(p.pid) and entry in p.environ().split(b"\0") for p in procfs.processes())


def cluster_pids(cluster_id: str, temp_dir: str | None = None) -> list[int]:
    """Live processes of the cluster: started with `TPULAUNCH_CLUSTER_ID=<cluster_id>`, every process
    below one of those, and (given its verified `temp_dir`) Ray's own processes of this user holding
    a file open inside it. Ray's agents rename themselves (`ray::DashboardAgent`), which can wipe what
    /proc shows of their environment, and when their raylet dies they are nobody's children any
    more. A process that merely holds a file there (a user's `tail -f` of a Ray log) is not the
    cluster's."""
    entry = f"{ID_ENV}={cluster_id}".encode()
    me = os.getuid()
    carriers = []
    for p in procfs.processes():
        if not procfs.alive(p.pid):
            continue
        if entry in p.environ().split(b"\0"):
            carriers.append(p.pid)
        elif temp_dir and p.uid() == me and is_rays(p.cmdline()) and names_dir(p, temp_dir):
            carriers.append(p.pid)
    return below(carriers, procfs.children_map()) if carriers else []


@dataclass(frozen=True)
class Orphan:
    """A cluster tpulaunch started on this machine, found by its markers."""

    cluster_id: str
    temp_dir: str | None  # None: its dir is gone, only processes remain
    pids: tuple[int, ...]


def find_orphans(home: Path | None = None) -> list[Orphan]:
    """The clusters of ours on this machine: marked temp dirs, and processes carrying a cluster id.

    With `home`, not those whose marker names another state directory that still exists (every
    TPULAUNCH_HOME's are found with None). A cluster whose temp dir is gone is always found: its
    processes say nothing of where it was started, and nothing can use it any more."""
    by_id: dict[str, str | None] = {}
    elsewhere: set[str] = set()
    for d in sorted(temp_root().glob(f"{PREFIX}*")):
        doc = _marker(str(d))
        if doc is None or d.is_symlink():
            continue
        if home is not None and _started_elsewhere(doc, home):
            elsewhere.add(doc["cluster_id"])
        else:
            by_id[doc["cluster_id"]] = str(d)
    prefix = f"{ID_ENV}=".encode()
    pids: dict[str, list[int]] = {}
    for proc in procfs.processes():
        for item in proc.environ().split(b"\0"):
            if item.startswith(prefix) and procfs.alive(proc.pid):
                cid = item[len(prefix):].decode(errors="replace")
                if cid not in elsewhere:
                    pids.setdefault(cid, []).append(proc.pid)
                    by_id.setdefault(cid, None)
                break
    return [Orphan(cid, d, tuple(pids.get(cid, ()))) for cid, d in sorted(by_id.items())]
