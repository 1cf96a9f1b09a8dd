"""Who holds this host's TPU? (`/dev/accel*`, `/dev/vfio/*`, a stale `/tmp/libtpu_lockfile`.)

A run that died badly (Ctrl-C through gcloud ssh, a killed driver) can leave a process that still
has the chips open; the next run then fails inside libtpu with "TPU in use". This is MaxText's kill
script as a library: `scan()` is a pure read of a root dir and a /proc dir (so tests point it at a
tmp dir with fake device files held open by a real child process); `clear()` acts on its report.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOCKFILE = "tmp/libtpu_lockfile"  # relative to the root


@dataclass
class Holder:
    pid: int
    cmdline: str
    paths: list[str]  # the TPU device files (or lockfile) it has open


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


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def scan(root: Path | str = "/", proc: Path | str = "/proc") -> HoldersReport:
    """Which processes (under `proc`) have a TPU device file (under `root`) or the lockfile open."""
    root, proc = Path(root), Path(proc)
    devices = tpu_devices(root)
    lock = root / LOCKFILE
    watched = set(devices) | ({str(lock)} if lock.exists() else set())
    holders = []
    me = _ancestors() if proc == Path("/proc") else set()
    if watched:
        for entry in sorted(proc.iterdir(), key=lambda p: p.name) if proc.is_dir() else []:
            if not entry.name.isdigit() or int(entry.name) in me:
                continue
            paths = set()
            try:
                fds = list((entry / "fd").iterdir())
            except OSError:
                continue  # gone, or another user's process we may not look into
            for fd in fds:
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target in watched:
                    paths.add(target)
            if paths:
                try:
                    cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = ""
                holders.append(Holder(pid=int(entry.name), cmdline=cmd, paths=sorted(paths)))
    held = any(h.paths for h in holders)
    return HoldersReport(devices=devices, holders=holders, lockfile=str(lock) if lock.exists() else None,
                         lockfile_stale=lock.exists() and not held)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def clear(report: HoldersReport, grace_s: float = 5.0) -> dict:
    """End the holders (SIGTERM, then SIGKILL after `grace_s`) and remove the lockfile if nobody holds it.

    Returns {"killed": [...], "failed": {pid: reason}, "lockfile_removed": bool}.
    """
    killed, failed = [], {}
    pids = [h.pid for h in report.holders]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [p for p in pids if _alive(p)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError as e:
                failed[pid] = f"not allowed to signal it ({e.strerror})"
        end = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < end and any(_alive(p) for p in pids if p not in failed):
            time.sleep(0.05)
    for pid in pids:
        if pid in failed:
            continue
        if _alive(pid):
            failed[pid] = "still running after SIGKILL"
        else:
            killed.append(pid)
    removed = False
    if report.lockfile and not failed:
        try:
            os.unlink(report.lockfile)
            removed = True
        except FileNotFoundError:
            pass
    return {"killed": killed, "failed": failed, "lockfile_removed": removed}
