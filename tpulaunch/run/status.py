"""Where a run is, as data: what `tpulaunch status` shows and the terminal's status line reads.

The supervision hands a `RunView` to its sink every few seconds and at every change of phase; a
detached run's supervisor writes it to `status.json` beside the host logs (atomically), which
`tpulaunch status` / `runs` read back from the head. Pure data, no I/O but `write`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path


class RunState(str, Enum):
    PENDING = "pending"  # submitted, the supervisor not yet running the first attempt
    RUNNING = "running"
    RESTARTING = "restarting"  # between attempts: relaunching, or waiting for the slice to be whole
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # `tpulaunch stop`, or a signal to the supervisor
    LOST = "lost"  # the supervisor itself is gone (its head restarted): the run's end is unknown
    UNKNOWN = "unknown"  # the cluster does not say

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.STOPPED, RunState.LOST)


class HostPhase(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class HostView:
    process_index: int
    slice_index: int
    worker_id: int
    phase: HostPhase
    exit_code: int | None = None
    last_activity: float | None = None  # time.time() of its last line or heartbeat
    last_line: str = ""
    reason: str | None = None
    step: int | None = None  # the last step it reported (tpulaunch.heartbeat(step=N))
    step_rate: float | None = None  # steps per second, recent


@dataclass(frozen=True)
class RunView:
    run_id: str
    state: RunState
    attempt: int
    hosts: tuple[HostView, ...] = ()
    attempts: tuple[dict, ...] = ()  # earlier attempts: {"index", "outcome", "exit_code", "who"}
    script: str = ""
    started: float = 0.0
    updated: float = field(default_factory=time.time)
    exit_code: int | None = None
    note: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema"] = "tpulaunch.status/v1"
        return d

    @staticmethod
    def from_dict(d: dict) -> RunView:
        hosts = tuple(HostView(**{**h, "phase": HostPhase(h["phase"])}) for h in d.get("hosts", ()))
        return RunView(run_id=d["run_id"], state=RunState(d["state"]), attempt=int(d.get("attempt", 0)), hosts=hosts,
                       attempts=tuple(d.get("attempts", ())), script=d.get("script", ""),
                       started=float(d.get("started") or 0.0), updated=float(d.get("updated") or 0.0),
                       exit_code=d.get("exit_code"), note=d.get("note"))


def write(path: Path, view: RunView) -> None:
    """`status.json`, whole or not at all (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(view.to_dict(), indent=1))
    os.replace(tmp, path)
