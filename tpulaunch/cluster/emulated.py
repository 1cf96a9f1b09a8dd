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
    dashboard: bool = False,
) -> list[str]:
    """`ray start` for one emulated host; every port explicit so parallel starts cannot collide."""
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
        # tpulaunch streams host output itself (log_to_driver=False), so Ray's per-node log
        # monitor would only cost a Python process per emulated host.
        "--include-log-monitor", "false",
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
    env.update(info.ray_env())
    env.update(FAST_HEALTH_CHECKS)
    env["RAY_prestart_worker_first_driver"] = "0"
    return env


def _join(info: ClusterInfo, spec: SliceSpec, topology: Topology, worker: int, ports: list[int]) -> None:
    """`ray start` one more emulated host into the cluster at `info.address`."""
    assert info.temp_dir is not None
    env = {**_base_env(info), **host_node_env(spec, topology, worker)}
    argv = ray_start_argv(head=False, address=info.address, temp_dir=info.temp_dir,
                          chips_per_host=topology.chips_per_host, ports=ports)
    _run_ray_start(argv, env, f"host {worker} of slice {spec.name}")


def start_emulated(
    slices: list[SliceSpec], topology: Topology, *, dashboard: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ClusterInfo:
    """Start one Ray node per host of every slice, on this machine. Head = slice 0 worker 0."""
    say = progress or (lambda _m: None)
    temp_dir = tempfile.mkdtemp(prefix="tpl-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    token_path = os.path.join(temp_dir, "auth_token")
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    info = ClusterInfo(address="", temp_dir=temp_dir, token_path=token_path, emulated=True,
                       slices=[s.to_dict() for s in slices])
    hosts = [(s, w) for s in slices for w in range(topology.num_hosts)]
    ports = free_ports(9 * len(hosts))
    try:
        s0, w0 = hosts[0]
        say(f"starting the Ray head: host 0 of slice {s0.name}")
        env = {**_base_env(info), **host_node_env(s0, topology, w0)}
        _run_ray_start(ray_start_argv(head=True, address=None, temp_dir=temp_dir, chips_per_host=topology.chips_per_host,
                                      ports=ports[0:9], dashboard=dashboard), env, "the head node")
        info.address = (Path(temp_dir) / "ray_current_cluster").read_text().strip()
        # One at a time: raylets started in parallel on one machine race for the same internal
        # ports and log-file names (seen with Ray 2.60: `bind: Address already in use`).
        for i in range(1, len(hosts)):
            s, w = hosts[i]
            _join(info, s, topology, w, ports[9 * i:9 * i + 9])
            say(f"host {w} of slice {s.name} joined")
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


def stop_cluster(info: ClusterInfo, grace_s: float = 5.0) -> int:
    """Stop every process of an emulated cluster; returns how many were running."""
    if not info.temp_dir:
        return 0
    return stop_processes(info.temp_dir, grace_s)
