"""Start and stop an emulated TPU slice cluster on this machine: one real Ray node per host.

Emulated hosts are real Ray nodes, started as `ray start` starts them (`nodes.py`), with the same
environment GKE's TPU webhook gives a TPU pod (`TPU_NAME`, `TPU_WORKER_ID`, `TPU_ACCELERATOR_TYPE`,
`TPU_TOPOLOGY`) plus the resource `{"TPU": chips_per_host}`. Ray's own `TPUAcceleratorManager` then derives
the resources and labels it puts on real TPU hosts (`TPU`, `<slice name>`,
`TPU-<type>-head` on worker 0, `accelerator_type:TPU-V6E`, `ray.io/tpu-slice-name`,
`ray.io/tpu-worker-id`, ...), so scheduling code has one path for emulated and real slices.

Every node of an emulated cluster has the node address 127.0.0.1, so every server of the cluster
listens on loopback only (`record.LOOPBACK_RAY` says how, and what keeps Ray from rewriting that
address), and token authentication with a fresh token stored owner-only. Each cluster gets its
own Ray temp dir and a random id (`ownership.py`): the temp dir's
marker and the environment of every process of the cluster carry it, and stopping a cluster stops
exactly the processes that carry its id, after checking its temp dir is the one it marked.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable

from tpulaunch import procfs
from tpulaunch.cluster import ownership
from tpulaunch.cluster.ports import free_ports
from tpulaunch.cluster.record import LOOPBACK_RAY, ClusterInfo, emulated_token_path, state_dir
from tpulaunch.errors import ClusterError, LaunchError
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.plan.topology import Topology

# Ray 2.60 binds its servers to 127.0.0.1 for this node address and to every interface for any other
# (127.0.0.2 included): the GCS and raylets (`node_ip_address == "127.0.0.1"` in C++), workers, the
# dashboard agent, and the dashboard's and autoscaler's metrics (`is_localhost(ip)` in Python).
EMULATED_NODE_IP = "127.0.0.1"
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


JOIN_HELPERS = 3  # helper processes starting the joining nodes at once (each imports Ray once)


def _start_nodes(info: ClusterInfo, nodes: list[dict], on_head: Callable[[str], None] | None = None,
                 on_node: Callable[[int], None] | None = None) -> None:
    """Start `nodes` (`nodes.py`'s protocol): the head in one helper process, the joining nodes in
    up to `JOIN_HELPERS` more, side by side.

    A helper per batch instead of a `ray start` per node (each imports Ray's CLI, 1.3 CPU-s here).
    Starting one node takes about 2 s here with the machine mostly idle (the new raylet and its
    agents registering), so nodes are started side by side; every helper starts at once and
    imports Ray while the head comes up, and the joiners get the head's address on stdin. Each
    helper says when each of its nodes is up; `on_head(address)` (a driver may connect while the
    others join) and `on_node(i)` run on this thread. Helpers' own output goes to `nodes.log`.
    """
    assert info.temp_dir is not None
    env = _base_env(info)
    for i, node in enumerate(nodes):
        node["index"] = i
    heads = [n for n in nodes if n["head"]]
    joiners = [n for n in nodes if not n["head"]]
    k = max(1, min(JOIN_HELPERS, len(joiners)))
    batches = ([heads] if heads else []) + [b for b in (joiners[j::k] for j in range(k)) if b]
    events: queue.Queue = queue.Queue()
    log_path = os.path.join(info.temp_dir, "nodes.log")
    helpers = []
    with open(log_path, "ab") as log:
        for batch in batches:
            proc = subprocess.Popen([sys.executable, "-m", "tpulaunch.cluster.nodes"], env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"nodes": batch}) + "\n")
            proc.stdin.flush()
            waits = any(n["address"] is None and not n["head"] for n in batch)
            if not waits:
                proc.stdin.close()
            helpers.append(proc)
            threading.Thread(target=_read_helper, args=(proc, events), daemon=True).start()
    error, running = None, len(helpers)
    try:
        while running and error is None:
            try:
                proc, word, rest = events.get(timeout=START_TIMEOUT_S)  # each node gets this long
            except queue.Empty:
                error = f"a node did not come up within {START_TIMEOUT_S:g} s"
                break
            if word == "head":
                for other in helpers:
                    if other is not proc and other.stdin is not None and not other.stdin.closed:
                        try:
                            other.stdin.write(rest + "\n")
                            other.stdin.close()
                        except BrokenPipeError:  # that helper failed already: its exit says so
                            pass
                if on_head is not None:
                    on_head(rest)
            elif word == "node" and on_node is not None:
                on_node(int(rest))
            elif word == "error":
                error = rest
            elif word == "exit":
                running -= 1
                if rest != "0" and error is None:
                    error = f"exit {rest}"
    finally:
        for proc in helpers:
            if proc.poll() is None and (error is not None or running):
                proc.kill()
            proc.wait()
    if error:
        raise ClusterError(f"could not start the emulated Ray nodes: {error}",
                           f"run with --debug; Ray's logs are under {info.temp_dir} (the helpers' in nodes.log)")


def keep_logs(info: ClusterInfo) -> str | None:
    """Copy the logs of a cluster that could not start (every node's `session_*/logs/`, and the
    helpers' `nodes.log`) to `$TPULAUNCH_HOME/failed-starts/<cluster id>/`, as its temp dir is
    removed with it: the error names where they are, and they say why. None if there were none."""
    if not info.temp_dir or not info.cluster_id:
        return None
    dest = os.path.join(state_dir(), "failed-starts", info.cluster_id)
    kept = 0
    for root, _dirs, files in os.walk(info.temp_dir):  # symlinks (session_latest) are not followed
        rel = os.path.relpath(root, info.temp_dir)
        for name in files:
            if not ("logs" in rel.split(os.sep) or (rel == "." and name == "nodes.log")):
                continue
            src = os.path.join(root, name)
            try:
                if not os.path.isfile(src) or os.path.islink(src):
                    continue
                os.makedirs(os.path.join(dest, rel), mode=0o700, exist_ok=True)
                shutil.copyfile(src, os.path.join(dest, rel, name))
                kept += 1
            except OSError:
                pass  # a log that vanished or cannot be read: the others are still worth keeping
    return dest if kept else None


def _read_helper(proc: subprocess.Popen, events: queue.Queue) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        word, _, rest = line.strip().partition(" ")
        events.put((proc, word, rest))
    events.put((proc, "exit", str(proc.wait())))


def node_spec(
    info: ClusterInfo, spec: SliceSpec, topology: Topology, worker: int, ports: list[int], *,
    head: bool = False, dashboard: bool = False,
) -> dict:
    """One emulated host for `nodes.py`: every port explicit, so nodes started close together
    cannot pick the same one; its TPU identity in `env`.

    Each joined host has a temp dir of its own inside the cluster's: nodes started in one session
    directory pick the same per-node index for their log files and unix sockets (seen with Ray
    2.60: two raylets in one `raylet.1.out`, the object store's `bind: Address already in use`).
    Stopping by the cluster's directory still finds them all.
    """
    assert info.temp_dir is not None
    temp_dir = ray_temp_dir(info.temp_dir) if head else os.path.join(info.temp_dir, f"s{spec.slice_index}w{worker}")
    os.makedirs(temp_dir, exist_ok=True)
    return {
        "head": head, "address": None if head else (info.address or None), "temp_dir": temp_dir,
        "env": host_node_env(spec, topology, worker), "ports": ports, "chips": topology.chips_per_host,
        "object_store_bytes": OBJECT_STORE_BYTES, "node_ip": node_ip(info), "dashboard": dashboard,
        "services": info.log_monitor,
    }


def node_ip(info: ClusterInfo) -> str:
    """The node address of the cluster's hosts: its head's (a host started again joins as its peers
    did, whichever tpulaunch started them), else EMULATED_NODE_IP for a new cluster."""
    host = info.address.rpartition(":")[0]
    return host or EMULATED_NODE_IP


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
    if node_ip(info) == "127.0.0.1":  # the head's address is not known yet while it starts
        env.update(LOOPBACK_RAY)
    env.update(FAST_HEALTH_CHECKS)
    env["RAY_prestart_worker_first_driver"] = "0"
    assert info.cluster_id
    env[ownership.ID_ENV] = info.cluster_id  # every process of the cluster carries it (how it is stopped)
    # `python` in the cluster's processes (a detached run's job) is this one, the one with tpulaunch
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


NODE_MEMORY_BYTES = 320 * 1024 * 1024  # what one emulated host's Ray processes hold, about (measured: 250-300 MiB)


def max_emulated_hosts() -> int:
    """How many emulated hosts this machine can hold: one Ray node each (raylet, agents, a worker)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * 1024**3
    return max(1, min(256, total // NODE_MEMORY_BYTES))


def check_capacity(hosts: int) -> None:
    """Refuse an emulated slice this machine cannot hold, before anything starts."""
    limit = max_emulated_hosts()
    if hosts > limit:
        raise LaunchError(f"emulating {hosts} hosts needs {hosts} Ray nodes on this machine, which holds about {limit}"
                          f" ({NODE_MEMORY_BYTES // 2**20} MiB each)",
                          "emulate fewer or smaller slices (--num-slices, --topology), or run on a real cluster"
                          " (--address)")


RAY_SUBDIR = "ray"


def ray_temp_dir(cluster_dir: str) -> str:
    """The head node's Ray temp dir, inside the cluster's own (0700, marked) directory.

    Not the cluster's directory itself: every Ray process that connects makes its temp dir and
    session dirs 0777 (`ray._common.utils.try_make_directory_shared`, from `Node._init_temp`, for
    a /tmp/ray shared between users). Below a 0700 directory Ray never touches, nothing of the
    cluster is reachable by another user whatever Ray does to its own."""
    return os.path.join(cluster_dir, RAY_SUBDIR)


def start_emulated(
    slices: list[SliceSpec], topology: Topology, *, dashboard: bool = False, log_monitor: bool = False,
    progress: Callable[[str], None] | None = None, on_head: Callable[[ClusterInfo], None] | None = None,
) -> ClusterInfo:
    """Start one Ray node per host of every slice, on this machine. Head = slice 0 worker 0.

    `on_head(info)` runs once the head is up, before the other hosts join: work that needs only
    the cluster's address (a driver connecting, agents waiting for their nodes) overlaps the joins.
    `log_monitor`: the cluster is left up for other drivers (`cluster up`): its nodes forward
    worker output to drivers, and the head runs the Ray Client server and the autoscaler monitor.
    """
    say = progress or (lambda _m: None)
    hosts = [(s, w) for s in slices for w in range(topology.num_hosts)]
    check_capacity(len(hosts))
    # The nodes' processes outlive the helpers that start them: as their subreaper this process
    # can wait for them when it stops the cluster (a cold `run` returns with none left behind).
    procfs.become_subreaper()
    cluster_id = ownership.new_cluster_id()
    temp_dir = ownership.make_temp_dir(cluster_id, state_dir())
    token_path = emulated_token_path(temp_dir)
    info = ClusterInfo(address="", temp_dir=temp_dir, token_path=token_path, emulated=True,
                       slices=list(slices), log_monitor=log_monitor, cluster_id=cluster_id)

    def head_up(address: str) -> None:
        info.address = address
        if on_head is not None:
            on_head(info)

    def joined(i: int) -> None:
        s, w = hosts[i]
        say(f"host {w} of slice {s.name} joined")

    try:  # from here on, a failure leaves nothing: no process, no temp dir
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        ports = free_ports(9 * len(hosts))
        nodes = [node_spec(info, s, topology, w, ports[9 * i:9 * i + 9], head=i == 0, dashboard=dashboard)
                 for i, (s, w) in enumerate(hosts)]
        if dashboard:
            info.dashboard = f"127.0.0.1:{ports[8]}"  # the head's dashboard: Ray's job and log APIs
        say(f"starting the Ray head: host 0 of slice {hosts[0][0].name}")
        _start_nodes(info, nodes, on_head=head_up, on_node=joined)
    except ClusterError as e:
        kept = keep_logs(info)
        stop_cluster(info)  # the temp dir goes with it: its logs were kept first
        where = f"Ray's logs are kept under {kept} (the helpers' in nodes.log)" if kept else "no Ray log could be kept"
        raise ClusterError(e.message, f"run with --debug; {where}") from e
    except BaseException:
        stop_cluster(info)
        raise
    return info


def restart_hosts(info: ClusterInfo, topology: Topology, missing: list[tuple[str, int]]) -> None:
    """Start again the emulated hosts `(slice name, worker id)` whose Ray node was lost.

    What a repaired or re-created TPU VM does on a real slice: a node with the same TPU identity
    joins, so Ray labels it as the same worker.
    """
    specs = {s.name: s for s in info.slices}
    ports = free_ports(9 * len(missing))
    _start_nodes(info, [node_spec(info, specs[name], topology, worker, ports[9 * k:9 * k + 9])
                        for k, (name, worker) in enumerate(missing)])


def stop_hosts(info: ClusterInfo, hosts: list[tuple[str, int]], grace_s: float = 1.0) -> int:
    """Stop the Ray nodes (and all below them: agents, host processes) of these emulated hosts
    `(slice name, worker id)`, as a TPU VM taken out of the fleet goes; how many processes ran."""
    assert info.cluster_id
    want = {f"TPU_NAME={name}\0TPU_WORKER_ID={w}" for name, w in hosts}
    tops = []
    for pid in ownership.cluster_pids(info.cluster_id):
        env = procfs.Process(pid).environ().split(b"\0")
        name = next((e[9:].decode() for e in env if e.startswith(b"TPU_NAME=")), None)
        worker = next((e[14:].decode() for e in env if e.startswith(b"TPU_WORKER_ID=")), None)
        if name is not None and f"TPU_NAME={name}\0TPU_WORKER_ID={worker}" in want:
            tops.append(pid)
    pids = ownership.below(tops, procfs.children_map()) if tops else []
    seen = set(pids)
    procfs.stop(lambda: [p for p in seen if procfs.alive(p)], grace_s)
    procfs.reap(seen)
    return len(seen)


def stop_cluster(info: ClusterInfo, grace_s: float = 1.0, record: str = "(in memory)") -> int:
    """Stop every process of an emulated cluster and remove its temp dir; returns how many ran.

    Only after `ownership.check_temp_dir` proved the dir is the one this cluster marked (StateError
    otherwise: nothing is touched). A short grace: nothing of an emulated cluster needs a graceful
    exit, and Ray's processes that ignore SIGTERM for seconds would only hold the launcher up."""
    temp_dir = ownership.check_temp_dir(info.temp_dir, info.cluster_id, record, state_dir())
    assert info.cluster_id
    return stop_owned(info.cluster_id, temp_dir, grace_s)


def stop_owned(cluster_id: str, temp_dir: str | None, grace_s: float = 1.0) -> int:
    """Stop the processes carrying `cluster_id`, then remove `temp_dir` if it is still marked for it."""
    verified = temp_dir if temp_dir and ownership.marker_id(temp_dir) == cluster_id else None
    pids = ownership.cluster_pids(cluster_id, verified)
    seen = set(pids)

    def find() -> list[int]:
        now = ownership.cluster_pids(cluster_id, verified)
        seen.update(now)
        return now

    procfs.stop(find, grace_s)
    procfs.reap(seen)  # the nodes this process started are its (subreaper) children: none left a zombie
    # ... nor an agent of theirs that exited, orphaned to us, after `seen` was taken (a zombie's
    # command line is empty; its name keeps Ray's title)
    ours = procfs.child_pids(os.getpid()) or []
    procfs.reap([c for c in ours if procfs.Process(c).state() == "Z"
                 and (procfs.Process(c).name().startswith("ray::")
                      or procfs.Process(c).name() in ("raylet", "gcs_server"))])
    if verified:
        shutil.rmtree(verified, ignore_errors=True)
    return len(pids)
