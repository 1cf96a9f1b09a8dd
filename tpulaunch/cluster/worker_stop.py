"""tpulaunch-stop: end the processes of one cluster on this host, by pid. Prints one marked JSON line.

Those started with the cluster's id (`TPULAUNCH_CLUSTER_ID` in their environment), and, when its
temp dir DIR is marked for it, this user's processes holding files in that dir (Ray's agents
rename themselves, which hides their environment). Runs on a TPU worker over gcloud ssh, sent as
its own source with `python -c` (`cluster/remote.py`), so the worker needs no tpulaunch: the
standard library only; tests import it and run it as a program.
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
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def in_dir(pid: str, d: str) -> bool:
    inside = d.rstrip("/") + "/"
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
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


def members(cid: str, d: str, marked: bool) -> list[int]:
    entry = ("TPULAUNCH_CLUSTER_ID=" + cid).encode()
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit() or int(e) == os.getpid() or not alive(e):
            continue
        try:
            env = open(f"/proc/{e}/environ", "rb").read().split(b"\0")
        except OSError:
            env = []
        if entry in env or (marked and in_dir(e, d)):
            out.append(int(e))
    return out


def gcs(pid: int) -> bool:
    try:
        return b"gcs_server" in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def stop(temp_dir: str, cid: str) -> dict:
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
    if not left and marked:
        shutil.rmtree(d, ignore_errors=True)
    return {"stopped": len(found), "left": left, "removed": bool(not left and marked)}


if __name__ == "__main__":
    print(JSON_MARK + json.dumps(stop(sys.argv[1], sys.argv[2])), flush=True)
