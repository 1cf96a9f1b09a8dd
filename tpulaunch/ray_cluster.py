"""Ray: start an emulated slice cluster, connect to a cluster, stop what we started.

The only module that runs `ray start` or calls `ray.init`.

Emulated hosts are real Ray nodes started with `ray start` and the same environment GKE's TPU
webhook gives a TPU pod (`TPU_NAME`, `TPU_WORKER_ID`, `TPU_ACCELERATOR_TYPE`, `TPU_TOPOLOGY`)
plus `--resources '{"TPU": chips_per_host}'`. Ray's own `TPUAcceleratorManager` then derives
the resources and labels it puts on real TPU hosts (`TPU`, `<slice name>`,
`TPU-<type>-head` on worker 0, `accelerator_type:TPU-V6E`, `ray.io/tpu-slice-name`,
`ray.io/tpu-worker-id`, ...), so scheduling code has one path for emulated and real slices.

Every node of an emulated cluster uses a loopback node address (127.0.0.2: Ray rewrites
127.0.0.1 to the machine's external IP) and token authentication with a fresh token stored
owner-only. Each cluster gets its own Ray temp dir; stopping a cluster kills exactly the
processes that belong to that temp dir and nothing else.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tpulaunch.errors import ClusterError
from tpulaunch.slicespec import SliceSpec
from tpulaunch.topology import Topology

EMULATED_NODE_IP = "127.0.0.2"
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # per emulated host; runs move little through Ray
START_TIMEOUT_S = 120.0


def state_dir() -> Path:
    """Where tpulaunch keeps cluster records and tokens (`TPULAUNCH_HOME`, default ~/.cache/tpulaunch)."""
    d = Path(os.environ.get("TPULAUNCH_HOME") or Path.home() / ".cache" / "tpulaunch")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


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
    # ({"tpu", "zone", "project", "port", "temp_dir", "python"}; see `ray_remote`). None otherwise.
    remote: dict | None = None

    @property
    def running_here(self) -> bool:
        """True when this is a cluster tpulaunch started on this machine and it still runs."""
        return bool(self.temp_dir) and bool(cluster_pids(self.temp_dir))  # type: ignore[arg-type]

    def ray_env(self) -> dict[str, str]:
        """Environment a process needs to talk to this cluster."""
        env = {"RAY_USAGE_STATS_ENABLED": "0"}
        if self.token_path:
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN_PATH"] = self.token_path
        return env


# -- persisted record of the warm cluster ---------------------------------------------------------


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


# -- ports ------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together so the OS cannot hand out one twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# -- starting ------------------------------------------------------------------------------------


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
    base_env = dict(os.environ)
    for k in ("RAY_ADDRESS", "TPU_VISIBLE_CHIPS", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS"):
        base_env.pop(k, None)
    base_env.update(info.ray_env())
    base_env["RAY_prestart_worker_first_driver"] = "0"
    hosts = [(s, w) for s in slices for w in range(topology.num_hosts)]
    ports = _free_ports(9 * len(hosts))
    try:
        s0, w0 = hosts[0]
        say(f"starting Ray head (emulated {s0.name} host 0)")
        env = {**base_env, **host_node_env(s0, topology, w0)}
        _run_ray_start(ray_start_argv(head=True, address=None, temp_dir=temp_dir, chips_per_host=topology.chips_per_host,
                                      ports=ports[0:9], dashboard=dashboard), env, "the head node")
        info.address = (Path(temp_dir) / "ray_current_cluster").read_text().strip()

        def _join(i: int) -> None:
            s, w = hosts[i]
            env = {**base_env, **host_node_env(s, topology, w)}
            argv = ray_start_argv(head=False, address=info.address, temp_dir=temp_dir,
                                  chips_per_host=topology.chips_per_host, ports=ports[9 * i:9 * i + 9])
            _run_ray_start(argv, env, f"emulated {s.name} host {w}")
            say(f"emulated {s.name} host {w} joined")

        # One at a time: raylets started in parallel on one machine race for the same internal
        # ports and log-file names (seen with Ray 2.60: `bind: Address already in use`).
        for i in range(1, len(hosts)):
            _join(i)
    except BaseException:
        stop_cluster(info)
        raise
    return info


# -- stopping -----------------------------------------------------------------------------------


def cluster_pids(temp_dir: str) -> list[int]:
    """Processes of the Ray cluster living in `temp_dir`.

    Most name it in argv; some (Ray's client server) only inherit it in their environment
    (`RAY_AUTH_TOKEN_PATH` points into it), so both are searched.
    """
    me = os.getpid()
    needle = temp_dir.encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        if _mentions(entry, needle, temp_dir):
            out.append(int(entry))
    return out


def _mentions(pid: str, needle: bytes, temp_dir: str) -> bool:
    """argv, environment, or an open file inside temp_dir (Ray's agents rename their argv)."""
    for part in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as f:
                if needle in f.read():
                    return True
        except OSError:
            return False
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(temp_dir):
                return True
    except OSError:
        pass
    return False


def stop_cluster(info: ClusterInfo, grace_s: float = 5.0) -> int:
    """Stop every process of an emulated cluster; returns how many were running."""
    if not info.temp_dir:
        return 0
    pids = cluster_pids(info.temp_dir)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in cluster_pids(info.temp_dir):
        _signal(pid, signal.SIGKILL)
    shutil.rmtree(info.temp_dir, ignore_errors=True)
    return len(pids)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


# -- connecting ---------------------------------------------------------------------------------


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
