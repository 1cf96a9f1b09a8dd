"""`ClusterInfo`: a Ray cluster tpulaunch knows about, and the record `cluster up` leaves behind.

The record (`$TPULAUNCH_HOME/cluster.json`, default `~/.cache/tpulaunch`) is how `--address auto`
finds the warm cluster. Plain data and a JSON file; no Ray import.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tpulaunch.cluster.processes import cluster_pids


def state_dir() -> Path:
    """Where tpulaunch keeps cluster records and tokens (`TPULAUNCH_HOME`, default ~/.cache/tpulaunch)."""
    d = Path(os.environ.get("TPULAUNCH_HOME") or Path.home() / ".cache" / "tpulaunch")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d



# Ray's background work on an emulated cluster, where every node shares this machine's cores with
# the hosts' training: no metrics pipeline, task events and state dumps rarely (Ray's C++ config,
# read from RAY_<name> by every Ray process: nodes, workers and the driver).
QUIET_RAY = {
    "RAY_enable_metrics_collection": "0",
    "RAY_task_events_report_interval_ms": "10000",
    "RAY_debug_dump_period_ms": "600000",
    "RAY_event_stats_print_interval_ms": "600000",
}


@dataclass
class ClusterInfo:
    """A Ray cluster tpulaunch knows about. Persisted as JSON by `cluster up`."""

    address: str
    temp_dir: str | None  # set when tpulaunch started it on this machine (emulated)
    token_path: str | None
    emulated: bool
    slices: list[dict] = field(default_factory=list)  # SliceSpec.to_dict() of emulated slices
    created: float = field(default_factory=time.time)
    # A cluster on a real slice (`cluster up --tpu`): where it runs, for status/down over gcloud ssh
    # ({"tpu", "zone", "project", "port", "temp_dir", "python"}; see `cluster/remote.py`). None otherwise.
    remote: dict | None = None
    kept: bool = False  # left up by `run --keep-cluster` (stopped after `idle_timeout` s unused)
    idle_timeout: float | None = None
    log_monitor: bool = False  # its nodes forward worker output to drivers (`cluster up`: yes)

    @property
    def running_here(self) -> bool:
        """True when this is a cluster tpulaunch started on this machine and it still runs."""
        return bool(self.temp_dir) and bool(cluster_pids(self.temp_dir))  # type: ignore[arg-type]

    def ray_env(self) -> dict[str, str]:
        """Environment a process needs to talk to this cluster (on an emulated one, also QUIET_RAY)."""
        env = {"RAY_USAGE_STATS_ENABLED": "0"}
        if self.token_path:
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN_PATH"] = self.token_path
        if self.emulated:
            env.update(QUIET_RAY)
        return env


def _record_path() -> Path:
    return state_dir() / "cluster.json"


def save_record(info: ClusterInfo) -> None:
    p = _record_path()
    p.write_text(json.dumps(asdict(info), indent=2))
    p.chmod(0o600)


def load_record() -> ClusterInfo | None:
    p = _record_path()
    if not p.exists():
        return None
    try:
        return ClusterInfo(**json.loads(p.read_text()))
    except (ValueError, TypeError):
        return None


def clear_record() -> None:
    _record_path().unlink(missing_ok=True)
