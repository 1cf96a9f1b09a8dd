"""Start the Ray nodes of an emulated slice from one process: what `ray start` does, without a
Python CLI per node.

Each `ray start` is a Python process that imports Ray's CLI (1.3 CPU-s on these machines) to
construct one `ray._private.node.Node` and exit. On an emulated slice every node shares the
machine's cores with the hosts' framework imports, so four of them cost a cold launch seconds.
This module is run once per batch of nodes (`python -m tpulaunch.cluster.nodes`, the batch as JSON
on stdin; the launcher runs a few batches side by side), constructs the same `Node` objects one
after another, each with its host's TPU
identity in the environment (Ray's `TPUAcceleratorManager` reads it while the node is resolved),
prints a line per node and exits; the nodes' processes outlive it, as they outlive `ray start`.

It also starts only what the cluster is used for: the Ray Client server and the autoscaler
monitor run on clusters left up for other drivers (`services`), not on a run's own cluster.

`Node` is Ray's private API (the one `ray start` and `ray.cluster_utils` use). Only emulated
clusters use this module, and every lifecycle test of the suite starts one through it, so a Ray
release that changes `Node` fails the suite, not a user's run on a real slice.

Protocol: stdin a line `{"nodes": [NODE, ...]}`, then (for joining nodes whose address is null and
no head in the batch) a line with the head's address once it is up; NODE = {"index": int,
"head": bool, "address": str | null,
"temp_dir": str, "env": {...}, "ports": [9 ints], "chips": int, "object_store_bytes": int,
"node_ip": str, "dashboard": bool, "services": bool}. stdout: `head ADDRESS` once the head is up,
`node I` once node I (its index) is, `error MESSAGE` (then exit 1) if one cannot start.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from tpulaunch.cluster.worker_start import patient_node_start


def _params(node: dict):  # a ray._private.parameter.RayParams
    from ray._private.parameter import RayParams

    nm, om, agent_listen, agent_grpc, env_agent, metrics, gcs, client, dash = node["ports"][:9]
    services = node["services"]
    params = RayParams(
        node_ip_address=node["node_ip"], node_name=node["node_ip"],
        num_cpus=1, resources={"TPU": node["chips"]}, object_store_memory=node["object_store_bytes"],
        temp_dir=node["temp_dir"], min_worker_port=0, max_worker_port=0,
        node_manager_port=nm, object_manager_port=om,
        dashboard_agent_listen_port=agent_listen, metrics_agent_port=agent_grpc,
        runtime_env_agent_port=env_agent, metrics_export_port=metrics,
        include_log_monitor=services, no_monitor=not services,
        ray_client_server_port=client if node["head"] and services else None,
        include_dashboard=node["dashboard"], dashboard_host="127.0.0.1",
        dashboard_port=dash if node["dashboard"] else None,
    )
    if node["head"]:
        params.gcs_server_port = gcs
        params.update_if_absent(redis_shard_ports=None, num_redis_shards=None, redis_max_clients=None)
    else:
        params.gcs_address = node["address"]
    return params


def _node_type() -> type:
    """Ray's `Node`, less one process on a head without a dashboard.

    Without a dashboard, Ray starts its dashboard process anyway, with one module: usage stats
    (`services.start_api_server`, `--modules-to-load=UsageStatsHead`), which report nothing here
    (every node has RAY_USAGE_STATS_ENABLED=0). It costs a Python process with aiohttp and grpc
    imported (about 1.3 CPU-s at every cold `tpulaunch run`) and serves no API a run uses; Ray
    tolerates its absence, as when it fails to start (`include_dashboard=False` raises nothing)."""
    import ray._private.node

    class Node(ray._private.node.Node):
        def start_api_server(self, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
            if include_dashboard is not False or os.environ.get("RAY_USAGE_STATS_ENABLED") != "0":
                super().start_api_server(include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)

    return Node


def start_node(node: dict) -> str:
    """Construct one Ray node (head or worker) with `node["env"]` set; returns the GCS address."""
    from ray._private.utils import write_ray_address

    os.environ.update(node["env"])  # read while the node resolves its resources, inherited by its processes
    try:
        started = _node_type()(_params(node), head=node["head"], shutdown_at_exit=False, spawn_reaper=False)
    finally:
        for k in node["env"]:
            os.environ.pop(k, None)
    address = started.address if node["head"] else node["address"]
    write_ray_address(address, node["temp_dir"])  # as `ray start` does: `ray_current_cluster`
    return address


def _private_dirs() -> None:
    """What the nodes create is this user's alone: files 0600 and directories 0700 (umask), and
    Ray's `try_to_create_directory`, which makes every directory it creates 0777 "so others can use
    it" (ray/_common/utils.py, for a shared /tmp/ray), keeps them 0700. Every Ray process of the
    node inherits the umask."""
    os.umask(0o077)
    import ray._common.utils as ray_utils

    def keep_private(directory_path: str) -> None:
        try:
            os.chmod(directory_path, 0o700)
        except OSError:
            pass  # not ours to change: Ray tolerates the same

    ray_utils.try_make_directory_shared = keep_private


def main() -> int:
    batch = json.loads(sys.stdin.readline())
    import ray._private.node  # noqa: F401 - while the head comes up, for a helper of joining nodes

    _private_dirs()
    # Ray's `Node()` waits for each raylet spinning a core, and only 30 s; each raylet for its agents'
    # ports only 15 s, and for its runtime-env agent only 30 s (worker_start says why)
    patient_node_start()
    address = None
    for node in batch["nodes"]:
        if not node["head"]:
            if not node["address"] and not address:
                address = sys.stdin.readline().strip()  # the head's, once it is up
            node["address"] = node["address"] or address
        try:
            got = start_node(node)
        except Exception as e:  # one line for the launcher, the rest to the log
            traceback.print_exc(file=sys.stderr)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"error {type(e).__name__}: {first}", flush=True)
            return 1
        if node["head"]:
            address = got
            print(f"head {got}", flush=True)
        else:
            print(f"node {node['index']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
