"""Who holds this host's TPU? (`/dev/accel*`, `/dev/vfio/*`, a stale `/tmp/libtpu_lockfile`.)

A run that died badly (Ctrl-C through gcloud ssh, a killed driver) can leave a process that still
has the chips open; the next run then fails inside libtpu with "TPU in use". This is MaxText's kill
script as a library: `scan()` reads a root dir and /proc (so tests point it at a tmp dir with fake
device files held open by a real child process); `clear()` acts on its report.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tpulaunch import procfs

LOCKFILE = "tmp/libtpu_lockfile"  # relative to the root


@dataclass
class Holder:
    pid: int
    cmdline: str
    paths: list[str]  # the TPU device files (or lockfile) it has open
    uid: int | None = None  # the user it runs as: only this user's processes are ever stopped


@dataclass
class HoldersReport:
    devices: list[str]  # TPU device files found under the root
    holders: list[Holder] = field(default_factory=list)
    lockfile: str | None = None  # set when the libtpu lockfile exists
    lockfile_stale: bool = False  # exists and nobody has it (or a device) open

    @property
    def clean(self) -> bool:
        return not self.holders and not self.lockfile_stale

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema"] = "tpulaunch.tpu-holders/v1"
        d["clean"] = self.clean
        return d


def tpu_devices(root: Path) -> list[str]:
    """`/dev/accel*` (not directories: NVIDIA 570+ makes /dev/accel/) and numbered `/dev/vfio/*` groups."""
    dev = root / "dev"
    found = [str(p) for p in sorted(dev.glob("accel*")) if not p.is_dir()]
    vfio = dev / "vfio"
    if vfio.is_dir():
        found += [str(p) for p in sorted(vfio.iterdir()) if p.name.isdigit()]
    return found


def scan(root: Path | str = "/") -> HoldersReport:
    """Which processes have a TPU device file (under `root`) or the libtpu lockfile open."""
    root = Path(root)
    devices = tpu_devices(root)
    lock = root / LOCKFILE
    watched = set(devices) | ({str(lock)} if lock.exists() else set())
    holders = []
    if watched:
        me = procfs.ancestors()
        for proc in procfs.processes():
            if proc.pid in me:
                continue
            paths = sorted(set(proc.open_files()) & watched)
            if paths:
                cmd = proc.cmdline().replace(b"\0", b" ").decode(errors="replace").strip()
                holders.append(Holder(pid=proc.pid, cmdline=cmd, paths=paths, uid=proc.uid()))
    held = any(h.paths for h in holders)
    return HoldersReport(devices=devices, holders=holders, lockfile=str(lock) if lock.exists() else None,
                         lockfile_stale=lock.exists() and not held)


def clear(report: HoldersReport, grace_s: float = 5.0) -> dict:
    """End the holders (SIGTERM, then SIGKILL after `grace_s`) and remove the lockfile if nobody holds it.

    Only this user's processes are stopped (another user's holder is reported, never signalled),
    and only a regular lockfile is removed (never what a symlink of that name points at).

    Returns {"killed": [...], "failed": {pid: reason}, "lockfile_removed": bool}.
    """
    killed, failed = [], {}
    pids = [h.pid for h in report.holders]
    for h in report.holders:
        if h.uid is not None and h.uid != os.getuid():
            failed[h.pid] = f"it runs as another user (uid {h.uid}): not ours to stop"
    for pid in pids:
        try:
            os.kill(pid, 0)
        except PermissionError as e:
            failed.setdefault(pid, f"not allowed to signal it ({e.strerror})")
        except ProcessLookupError:
            pass
    left = set(procfs.stop([p for p in pids if p not in failed], grace_s))
    for pid in pids:
        if pid in failed:
            continue
        if pid in left:
            failed[pid] = "still running after SIGKILL"
        else:
            killed.append(pid)
    removed = False
    if report.lockfile and not failed and Path(report.lockfile).is_file() and not Path(report.lockfile).is_symlink():
        try:
            os.unlink(report.lockfile)
            removed = True
        except FileNotFoundError:
            pass
    return {"killed": killed, "failed": failed, "lockfile_removed": removed}
