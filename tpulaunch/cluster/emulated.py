"""Start and stop an emulated TPU slice cluster on this machine: one real Ray node per host.

Emulated hosts are real Ray nodes started with `ray start` and the same environment GKE's TPU
webhook gives a TPU pod (`TPU_NAME`, `TPU_WORKER_ID`, `TPU_ACCELERATOR_TYPE`, `TPU_TOPOLOGY`)
plus `--resources '{"TPU": chips_per_host}'`. Ray's own `TPUAcceleratorManager` then derives
the resources and labels it puts on real TPU hosts (`TPU`, `<slice name>`,
`TPU-<type>-head` on worker 0, `accelerator_type:TPU-V6E`, `ray.io/tpu-slice-name`,
`ray.io/tpu-worker-id`, ...), so scheduling code has one path for emulated and real slices.

Every node of an emulated cluster uses a loopback node address (127.0.0.2: Ray rewrites
127.0.0.1 to the machine's external IP) and token authentication with a fresh token stored
owner-only. Each cluster gets its own Ray temp dir; stopping a cluster kills exactly the
processes that belong to that temp dir and nothing else (`processes.py`).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from tpulaunch.cluster.ports import free_ports
from tpulaunch.cluster.processes import stop_processes
from tpulaunch.cluster.record import ClusterInfo
from tpulaunch.errors import ClusterError
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.plan.topology import Topology

EMULATED_NODE_IP = "127.0.0.2"
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # per emulated host; runs move little through Ray
START_TIMEOUT_S = 120.0


def host_node_env(spec: SliceSpec, topology: Topology, worker_id: int) -> dict[str, str]:
    """The TPU identity of one emulated host, in the variables Ray reads on GKE TPU pods."""
    return {
        "TPU_NAME": spec.name,
        "TPU_WORKER_ID": str(worker_id),
        "TPU_ACCELERATOR_TYPE": topology.accelerator_type,
        "TPU_TOPOLOGY": topology.topology,
    }


def _ray_bin() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.exists() else "ray"


def ray_start_argv(
    *, head: bool, address: str | None, temp_dir: str, chips_per_host: int, ports: list[int],
    dashboard: bool = False, log_monitor: bool = False,
) -> list[str]:
    """`ray start` for one emulated host; every port explicit so parallel starts cannot collide.

    `log_monitor`: Ray's per-node log monitor, which forwards worker output to drivers. `tpulaunch
    run` streams host output itself and needs none (a Python process per host saved); a cluster
    left up for other drivers (Ray Train) needs it, or their workers' prints reach nobody.
    """
    nm, om, agent_listen, agent_grpc, env_agent, metrics = ports[:6]
    argv = [
        _ray_bin(), "start",
        "--node-ip-address", EMULATED_NODE_IP,
        "--num-cpus", "1",
        "--resources", json.dumps({"TPU": chips_per_host}),
        "--temp-dir", temp_dir,
        "--object-store-memory", str(OBJECT_STORE_BYTES),
        "--min-worker-port", "0", "--max-worker-port", "0",
        "--node-manager-port", str(nm), "--object-manager-port", str(om),
        "--dashboard-agent-listen-port", str(agent_listen), "--dashboard-agent-grpc-port", str(agent_grpc),
        "--runtime-env-agent-port", str(env_agent), "--metrics-export-port", str(metrics),
        "--disable-usage-stats",
        "--include-log-monitor", "true" if log_monitor else "false",
    ]
    if head:
        argv += ["--head", "--port", str(ports[6]), "--ray-client-server-port", str(ports[7]),
                 "--include-dashboard", "true" if dashboard else "false", "--dashboard-host", "127.0.0.1"]
        if dashboard:
            argv += ["--dashboard-port", str(ports[8])]
    else:
        argv += ["--address", address or ""]
    return argv


def _run_ray_start(argv: list[str], env: dict[str, str], what: str) -> None:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if proc.returncode != 0:
        tail = " | ".join(line for line in (proc.stdout + proc.stderr).splitlines()[-3:])
        raise ClusterError(f"could not start Ray on {what} (ray start exited {proc.returncode}): {tail}",
                           "run with --debug; Ray's logs are under the cluster temp dir")


# A lost emulated host is noticed in seconds (Ray's defaults take about half a minute): the head
# checks every node each second and declares it dead after 3 missed checks.
FAST_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def _base_env(info: ClusterInfo) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("RAY_ADDRESS", "TPU_VISIBLE_CHIPS", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS"):
        env.pop(k, None)
    env.update(info.ray_env())  # token auth, and Ray's background work kept low (QUIET_RAY)
    env.update(FAST_HEALTH_CHECKS)
    env["RAY_prestart_worker_first_driver"] = "0"
    return env


def _join(info: ClusterInfo, spec: SliceSpec, topology: Topology, worker: int, ports: list[int]) -> None:
    """`ray start` one more emulated host into the cluster at `info.address`.

    Each joined host has a temp dir of its own inside the cluster's: `ray start`s running at the
    same time in one session directory pick the same per-node index for their log files and
    unix sockets (seen with Ray 2.60: two raylets in one `raylet.1.out`, the object store's
    `bind: Address already in use`). Stopping by the cluster's directory still finds them all.
    """
    assert info.temp_dir is not None
    node_dir = os.path.join(info.temp_dir, f"s{spec.slice_index}w{worker}")
    os.makedirs(node_dir, exist_ok=True)
    env = {**_base_env(info), **host_node_env(spec, topology, worker)}
    argv = ray_start_argv(head=False, address=info.address, temp_dir=node_dir,
                          chips_per_host=topology.chips_per_host, ports=ports, log_monitor=info.log_monitor)
    _run_ray_start(argv, env, f"host {worker} of slice {spec.name}")


def start_emulated(
    slices: list[SliceSpec], topology: Topology, *, dashboard: bool = False, log_monitor: bool = False,
    progress: Callable[[str], None] | None = None, on_head: Callable[[ClusterInfo], None] | None = None,
) -> ClusterInfo:
    """Start one Ray node per host of every slice, on this machine. Head = slice 0 worker 0.

    `on_head(info)` runs once the head is up, before the other hosts join: work that needs only
    the cluster's address (a driver connecting, agents waiting for their nodes) overlaps the joins.
    """
    say = progress or (lambda _m: None)
    temp_dir = tempfile.mkdtemp(prefix="tpl-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    token_path = os.path.join(temp_dir, "auth_token")
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    info = ClusterInfo(address="", temp_dir=temp_dir, token_path=token_path, emulated=True,
                       slices=[s.to_dict() for s in slices], log_monitor=log_monitor)
    hosts = [(s, w) for s in slices for w in range(topology.num_hosts)]
    ports = free_ports(9 * len(hosts))
    try:
        s0, w0 = hosts[0]
        say(f"starting the Ray head: host 0 of slice {s0.name}")
        env = {**_base_env(info), **host_node_env(s0, topology, w0)}
        _run_ray_start(ray_start_argv(head=True, address=None, temp_dir=temp_dir, chips_per_host=topology.chips_per_host,
                                      ports=ports[0:9], dashboard=dashboard, log_monitor=log_monitor),
                       env, "the head node")
        info.address = (Path(temp_dir) / "ray_current_cluster").read_text().strip()
        if on_head is not None:
            on_head(info)
        # In parallel: every port is explicit and below the ephemeral range (`ports.py`), so no
        # start can take another's port (the `bind: Address already in use` of earlier versions).
        def join(i: int) -> None:
            s, w = hosts[i]
            _join(info, s, topology, w, ports[9 * i:9 * i + 9])
            say(f"host {w} of slice {s.name} joined")

        with ThreadPoolExecutor(max_workers=min(8, max(1, len(hosts) - 1))) as pool:
            list(pool.map(join, range(1, len(hosts))))
    except BaseException:
        stop_cluster(info)
        raise
    return info


def restart_hosts(info: ClusterInfo, topology: Topology, missing: list[tuple[str, int]]) -> None:
    """Start again the emulated hosts `(slice name, worker id)` whose Ray node was lost.

    What a repaired or re-created TPU VM does on a real slice: a node with the same TPU identity
    joins, so Ray labels it as the same worker.
    """
    specs = {d["name"]: SliceSpec.from_dict(d) for d in info.slices}
    ports = free_ports(9 * len(missing))
    for k, (name, worker) in enumerate(missing):
        _join(info, specs[name], topology, worker, ports[9 * k:9 * k + 9])


def stop_cluster(info: ClusterInfo, grace_s: float = 1.0) -> int:
    """Stop every process of an emulated cluster; returns how many were running.

    A short grace: nothing of an emulated cluster needs a graceful exit, and Ray's processes that
    ignore SIGTERM for seconds would only hold the launcher up (SIGKILL follows)."""
    if not info.temp_dir:
        return 0
    return stop_processes(info.temp_dir, grace_s)
