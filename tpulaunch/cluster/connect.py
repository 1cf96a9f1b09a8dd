"""Find the Ray cluster a run asks for (`--address`), and connect to it.

The only module that calls `ray.init`.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from tpulaunch.cluster.processes import cluster_pids
from tpulaunch.cluster.record import ClusterInfo, load_record
from tpulaunch.errors import ClusterError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_address(address: str | None) -> ClusterInfo | None:
    """`--address`: None (nothing asked), `auto`, `HOST:PORT`, `ray://...`.

    `auto` means: `RAY_ADDRESS`, else the cluster `tpulaunch cluster up` left running.
    """
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
        if address is None:
            return None
    if address == "auto":
        if os.environ.get("RAY_ADDRESS"):
            return ClusterInfo(address=os.environ["RAY_ADDRESS"], temp_dir=None,
                               token_path=os.environ.get("RAY_AUTH_TOKEN_PATH"), emulated=False)
        rec = load_record()
        if rec is not None and rec.running_here:
            return rec
        if rec is not None and not rec.temp_dir and not rec.emulated:
            return rec
        local = _local_ray_address()
        if local is not None:
            return local
        raise ClusterError("--address auto found no running cluster",
                           "start one with `tpulaunch cluster up --topology 2x8` or pass --address HOST:PORT")
    rec = load_record()
    if rec is not None and rec.address == address:
        return rec
    return ClusterInfo(address=address, temp_dir=None, token_path=os.environ.get("RAY_AUTH_TOKEN_PATH"),
                       emulated=False)


def _local_ray_address() -> ClusterInfo | None:
    """On a TPU VM where Ray runs (e.g. after `tpulaunch cluster join`): the address Ray wrote."""
    candidates = sorted(Path("/tmp").glob("tpl-*/ray_current_cluster")) + [Path("/tmp/ray/ray_current_cluster")]
    # Emulated clusters (they keep their token inside their temp dir) belong to whoever started them.
    live = [p for p in candidates
            if p.exists() and not (p.parent / "auth_token").exists() and cluster_pids(str(p.parent))]
    if len(live) != 1:
        return None
    token = Path.home() / ".tpulaunch" / "ray_token"
    return ClusterInfo(address=live[0].read_text().strip(), temp_dir=None,
                       token_path=str(token) if token.exists() else os.environ.get("RAY_AUTH_TOKEN_PATH"),
                       emulated=False)


def connect(info: ClusterInfo, runtime_env: dict | None = None) -> None:
    """`ray.init` against the cluster, quietly; Ray's own log forwarding is off (we stream).

    `runtime_env` (the user's working directory) is job-level: Ray uploads it once per run.
    """
    if "ray" in sys.modules and info.token_path and os.environ.get("RAY_AUTH_TOKEN_PATH") != info.token_path:
        raise ClusterError("internal: Ray was imported before its auth token was set", "report this bug")
    for k, v in info.ray_env().items():
        os.environ[k] = v
    import ray

    try:
        ray.init(address=info.address, logging_level="ERROR", log_to_driver=False,
                 configure_logging=True, runtime_env=runtime_env)
    except Exception as e:  # noqa: BLE001 - Ray raises many types for "cannot connect"
        raise ClusterError(f"cannot connect to Ray at {info.address}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           "check --address, and that the cluster is up (`tpulaunch cluster status`)") from e


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
