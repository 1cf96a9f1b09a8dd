"""tpulaunch-stop: end the processes of one cluster on this host, by pid. Prints one marked JSON line.

Those started with the cluster's id (`TPULAUNCH_CLUSTER_ID` in their environment) and every process
below them; its temp dir DIR is removed only when it is marked for the cluster (never with
`--keep-dir`). Runs on a TPU worker over gcloud ssh, sent as its own source with `python -c`
(`cluster/remote.py`), so the worker needs no tpulaunch: the standard library only; tests import
it and run it as a program.
"""

import json
import os
import shutil
import signal
import sys
import time

JSON_MARK = "TPULAUNCH-JSON:"
MARKER = "tpulaunch-cluster"  # = tpulaunch.cluster.ownership.MARKER (a test holds them equal)


def alive(pid: int | str) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except Exception:  # gone, or not ours to read
        return False


def below(roots: list[int], kids: dict[int, list[int]]) -> list[int]:
    """`roots` and every process under them, given ppid -> children (shared with `ownership`)."""
    out, todo = set(roots), list(roots)
    while todo:
        for child in kids.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return sorted(out)


def is_rays(cmdline: bytes) -> bool:
    """One of Ray's own processes, by its command line (its agents and workers retitle themselves
    `ray::...`; the raylet and the GCS are binaries of those names). Shared with `ownership`."""
    first = cmdline.split(b"\0", 1)[0]
    return first.startswith(b"ray::") or first.endswith((b"/raylet", b"/gcs_server"))


def holds_inside(pid: str, d: str) -> bool:
    """`pid` holds a file open inside `d`, or names it as an argument."""
    inside = d.rstrip("/") + "/"
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        if any(a == d or a.startswith(inside) for a in args):
            return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(inside):
                    return True
            except OSError:
                continue
    except OSError:
        pass
    return False


def members(cid: str, d: str = "", marked: bool = False) -> list[int]:
    """The processes started with the cluster's id, Ray's own processes holding files in the
    marked dir `d` (its agents rename themselves, which can wipe their environment in /proc, and
    are orphans once their raylet dies), and every process below those. Never another process
    just because it holds a file of the cluster open (a user's `tail -f`)."""
    entry = ("TPULAUNCH_CLUSTER_ID=" + cid).encode()
    carriers: list[int] = []
    kids: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if not e.isdigit() or int(e) == os.getpid() or not alive(e):
            continue
        try:
            env = open(f"/proc/{e}/environ", "rb").read().split(b"\0")
        except OSError:
            env = []
        if entry in env:
            carriers.append(int(e))
        elif marked and _mine(e) and is_rays(_cmdline(e)) and holds_inside(e, d):  # a renamed agent, orphaned
            carriers.append(int(e))
        try:
            ppid = int(open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(e))
    return below(carriers, kids)


def _mine(pid: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _cmdline(pid: str) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def gcs(pid: int) -> bool:
    try:
        return b"gcs_server" in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def stop(temp_dir: str, cid: str, keep_dir: bool = False) -> dict:
    """`keep_dir`: the processes only, the dir kept (Ray's logs of a `ray start` that failed)."""
    d = os.path.realpath(temp_dir)
    try:
        marked = json.load(open(os.path.join(d, MARKER))).get("cluster_id") == cid and not os.path.islink(d)
    except (OSError, ValueError, AttributeError):
        marked = False
    found = members(cid, d, marked)
    # the node's processes first, the GCS (on the head) last: a GCS told to stop together with the
    # processes that report to it outlived SIGTERM for the whole grace (down took 10.5 s, now 0.9 s)
    for sig, wait, which in ((signal.SIGTERM, 10.0, lambda p: not gcs(p)), (signal.SIGTERM, 10.0, gcs),
                             (signal.SIGKILL, 5.0, lambda p: True)):
        for pid in [p for p in members(cid, d, marked) if which(p)]:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and [p for p in members(cid, d, marked) if which(p)]:
            time.sleep(0.2)
    left = members(cid, d, marked)
    removed = not left and marked and not keep_dir
    if removed:
        shutil.rmtree(d, ignore_errors=True)
    return {"stopped": len(found), "left": left, "removed": removed}


if __name__ == "__main__":
    print(JSON_MARK + json.dumps(stop(sys.argv[1], sys.argv[2], keep_dir="--keep-dir" in sys.argv[3:])), flush=True)
