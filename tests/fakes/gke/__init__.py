"""A fake GKE cluster with TPU node pools, KubeRay and its TPU webhook, for end-to-end tests.

`FakeGke(pools).start()` gives a Kubernetes API (HTTPS, `apiserver`), a kubeconfig for it, and
behind it: nodes labelled as GKE labels TPU nodes (`cloud.google.com/gke-tpu-accelerator`,
`-topology`, `gke-nodepool`, `gke-spot`, the `google.com/tpu=present:NoSchedule` taint, their chips
as `google.com/tpu` allocatable); GKE's admission (ExtendedResourceToleration) and the KubeRay TPU
webhook (`tpu`); a KubeRay operator (`kuberay`); and kubelets that run every pod on this machine
in a network, PID and mount namespace of its own (`kubelet`, `netns`), with GKE's TPU device
plugin's environment. CPU devices stand in for the chips, as the fake gcloud's do for TPU VMs: Ray
counts the chips from KubeRay's `--resources '{"TPU": n}'`, never from /dev/accel*.

What only GKE does is done here the way GKE does it: `preempt(node)` shuts down every node of that
node's pool (a multi-host slice is one unit; its pods end Failed with the kubelet's
`DisruptionTarget`), deletes the nodes, and after `comeback_s` makes the pool again under new node
names; a pool that autoscales from zero (`NodePool(autoscaled=True)`) has no nodes until GKE's
cluster autoscaler (`autoscaler`) makes them for a pod that asks; `set_maintenance(pool, epoch)` puts `cloud.google.com/scheduled-maintenance-time` on its
nodes. `python -m tests.fakes.gke` serves one from the command line.
"""

from __future__ import annotations

import math
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ADMIN_TOKEN_USER = "admin"


@dataclass(frozen=True)
class NodePool:
    """One GKE node pool: a TPU slice (`accelerator` set), or CPU nodes (`accelerator` None)."""

    name: str
    accelerator: str | None = None  # cloud.google.com/gke-tpu-accelerator, e.g. tpu-v5p-slice
    topology: str | None = None  # cloud.google.com/gke-tpu-topology (None: a tpu7x pool from a workload policy)
    machine_type: str = "e2-standard-8"
    chips_per_node: int = 0
    nodes: int | None = None  # default: the topology's chips / chips_per_node
    spot: bool = False
    zone: str = "us-central1-a"
    placement_policy: str | None = None  # tpu7x multi-host: the workload policy's name
    maintenance: int | None = None  # cloud.google.com/scheduled-maintenance-time (epoch)
    cpu: str = "8"
    memory: str = "32Gi"
    autoscaled: bool = False  # autoscaling from zero: no nodes until the cluster autoscaler makes them (autoscaler.py)

    @property
    def count(self) -> int:
        if self.nodes is not None:
            return self.nodes
        if self.accelerator and self.topology and self.chips_per_node:
            return max(math.prod(int(d) for d in self.topology.split("x")) // self.chips_per_node, 1)
        return 1


def tpu_pool(name: str, accelerator: str, topology: str, chips: int = 4, *, machine: str | None = None,
             spot: bool = False, **kw) -> NodePool:
    """A TPU node pool as GKE makes one (machine type from the generation and chips)."""
    prefix = {"tpu-v4-podslice": "ct4p-hightpu", "tpu-v5-lite-podslice": "ct5lp-hightpu", "tpu-v5p-slice": "ct5p-hightpu",
              "tpu-v6e-slice": "ct6e-standard", "tpu7x": "tpu7x-standard"}[accelerator]
    return NodePool(name, accelerator, topology, machine or f"{prefix}-{chips}t", chips, spot=spot, **kw)


def node_names(cluster: str, pool: NodePool) -> list[str]:
    """New names for a pool's nodes, as GKE makes them (`gke-<cluster>-<pool>-<hash>-<suffix>`)."""
    tag = secrets.token_hex(4)
    return [f"gke-{cluster}-{pool.name}-{tag}-{secrets.token_hex(2)}"[:63] for _ in range(pool.count)]


def node_object(pool: NodePool, name: str, address: str) -> dict:
    """One node of `pool` as GKE registers it: its labels, taints, chips and status."""
    labels = {
        "cloud.google.com/gke-nodepool": pool.name,
        "node.kubernetes.io/instance-type": pool.machine_type,
        "topology.kubernetes.io/zone": pool.zone,
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "cloud.google.com/machine-family": pool.machine_type.split("-")[0],
    }
    taints = []
    alloc = {"cpu": pool.cpu, "memory": pool.memory, "pods": "110"}
    if pool.accelerator:
        labels["cloud.google.com/gke-tpu-accelerator"] = pool.accelerator
        labels["cloud.google.com/gke-accelerator-count"] = str(pool.chips_per_node)
        if pool.topology:
            labels["cloud.google.com/gke-tpu-topology"] = pool.topology
        if pool.placement_policy:
            labels["cloud.google.com/placement-policy-name"] = pool.placement_policy
        taints.append({"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"})
        alloc["google.com/tpu"] = str(pool.chips_per_node)
    if pool.spot:
        labels["cloud.google.com/gke-spot"] = "true"
        taints.append({"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"})
    if pool.maintenance is not None:
        labels["cloud.google.com/scheduled-maintenance-time"] = str(pool.maintenance)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints, "providerID": f"gce://fake-project/{pool.zone}/{name}"},
        "status": {
            "capacity": dict(alloc), "allocatable": dict(alloc),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                            "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.34.1-gke.1000", "kubeProxyVersion": "v1.34.1-gke.1000",
                         "containerRuntimeVersion": "containerd://2.0.4", "osImage": "Container-Optimized OS",
                         "kernelVersion": "6.6.0", "operatingSystem": "linux", "architecture": "amd64",
                         "machineID": name, "systemUUID": name, "bootID": name},
        },
    }


@dataclass
class FakeGke:
    """One fake GKE cluster (see the module docstring). Use as a context manager, or start()/stop()."""

    pools: list[NodePool]
    state_dir: Path | None = None
    cluster: str = "fake"
    image_paths: list[str] = field(default_factory=list)  # what the pods' "image" must see (default: this repo)
    shared_dirs: list[str] = field(default_factory=list)  # host dirs every pod sees (a shared volume's stand-in)
    comeback_s: float = 5.0
    shutdown_grace_s: float = 3.0
    image_env: dict[str, dict[str, str]] = field(default_factory=dict)  # image -> what its containers' env adds

    def start(self) -> "FakeGke":
        import sys

        from . import tpu
        from .apiserver import ApiServer, Store
        from .kubelet import Kubelet, sweep_stale_pods
        from .kuberay import KubeRay
        from .netns import Network, sweep_stale

        sweep_stale_pods()
        sweep_stale()
        if self.state_dir is None:
            # not under /tmp: the pods' /tmp is their own
            base = Path("/var/tmp")
            self.state_dir = Path(tempfile.mkdtemp(prefix="tplt-gke-", dir=base))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.net = Network()
        self.admin_token = secrets.token_urlsafe(24)
        self.store = Store()
        self.store.on_create("pods", self._admit_pod)
        self.store.on_create("rayclusters", self._validate_raycluster, validating=True)
        self.server = ApiServer(self.store, {self.admin_token: ADMIN_TOKEN_USER}, host="0.0.0.0",
                                extra_ips=[self.net.gateway])
        self.url = self.server.start()
        self.kubeconfig = str(self.state_dir / "kubeconfig")
        self.server.kubeconfig(self.kubeconfig, user=ADMIN_TOKEN_USER, token=self.admin_token)
        images = self.image_paths or [str(REPO), sys.prefix, sys.base_prefix]
        self.kubelet = Kubelet(self.store, self.server, self.net, self.state_dir, image_paths=images,
                               shared_dirs=self.shared_dirs, shutdown_grace_s=self.shutdown_grace_s,
                               image_env=self.image_env)
        self.kuberay = KubeRay(self.store)
        self._pool_nodes: dict[str, list[str]] = {}
        for pool in self.pools:
            if not pool.autoscaled:
                self._make_nodes(pool)
        self.kubelet.start()
        self.kuberay.start()
        self.autoscaler = None
        if any(p.autoscaled for p in self.pools):  # GKE runs it when a node pool has autoscaling on
            from .autoscaler import ClusterAutoscaler

            self.autoscaler = ClusterAutoscaler(self.store, self.pools, cluster=self.cluster, address=self.net.gateway,
                                                make_nodes=self._make_nodes).start()
        self._threads: list[threading.Thread] = []
        return self

    def __enter__(self) -> "FakeGke":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for stopper in (getattr(self, "autoscaler", None), getattr(self, "kuberay", None), getattr(self, "kubelet", None),
                        getattr(self, "server", None)):
            if stopper is not None:
                try:
                    stopper.stop()
                except Exception:  # noqa: BLE001 - stop the rest anyway
                    pass
        if getattr(self, "net", None) is not None:
            self.net.close()

    @staticmethod
    def _admit_pod(pod: dict) -> dict:
        """GKE's ExtendedResourceToleration, then the KubeRay TPU webhook (its denial is a 403, as its handler answers)."""
        from . import tpu
        from .apiserver import Forbidden

        try:
            return tpu.webhook_mutate(tpu.tolerate_extended_resources(pod))
        except tpu.Rejected as e:
            raise Forbidden(f'admission webhook "mutate-kuberay-pod.kuberay-tpu-webhook" denied the request: {e}') from None

    @staticmethod
    def _validate_raycluster(rc: dict) -> dict:
        from . import tpu
        from .apiserver import Forbidden

        try:
            tpu.webhook_validate(rc)
        except tpu.Rejected as e:
            raise Forbidden(f'admission webhook "validate-raycluster.kuberay-tpu-webhook" denied the request: {e}') from None
        return rc

    # -- nodes ------------------------------------------------------------------------------------

    def _make_nodes(self, pool: NodePool) -> None:
        names = node_names(self.cluster, pool)
        for name in names:
            self.store.create("nodes", node_object(pool, name, self.net.gateway))
        self._pool_nodes[pool.name] = names

    def nodes_of(self, pool: str) -> list[str]:
        return list(self._pool_nodes.get(pool, []))

    def pool_of_node(self, node: str) -> str:
        return next(p for p, ns in self._pool_nodes.items() if node in ns)

    def preempt(self, node: str) -> list[str]:
        """A spot preemption of `node`: GKE treats its slice as one unit, so every node of its pool
        shuts down (the kubelet's graceful shutdown), the nodes go, and the pool comes back after
        `comeback_s` under new names. Returns the pods that ended."""
        pool_name = self.pool_of_node(node)
        pool = next(p for p in self.pools if p.name == pool_name)
        names = self._pool_nodes.pop(pool_name)
        for n in names:
            obj = self.store.get("nodes", "", n)
            if obj is not None:
                for c in obj["status"]["conditions"]:
                    if c["type"] == "Ready":
                        c.update(status="False", reason="KubeletNotReady", message="node is shutting down")
                self.store.replace("nodes", obj)
        ended: list[str] = []
        threads = []
        for n in names:
            t = threading.Thread(target=lambda n=n: ended.extend(self.kubelet.shutdown_node(n)))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        for n in names:
            self.store.delete("nodes", "", n)
        if self.autoscaler is not None and pool.autoscaled:  # its nodes are coming: not the autoscaler's to make
            self.autoscaler.growing.setdefault(pool.name, [])

        def comeback() -> None:
            time.sleep(self.comeback_s)
            if getattr(self, "net", None) is not None and not self.kubelet._stop.is_set():
                self._make_nodes(pool)
            if self.autoscaler is not None:
                self.autoscaler.growing.pop(pool.name, None)

        t = threading.Thread(target=comeback, name=f"fake-gke-comeback-{pool_name}", daemon=True)
        t.start()
        self._threads.append(t)
        return ended

    def set_maintenance(self, pool: str, epoch: int) -> None:
        for n in self._pool_nodes.get(pool, []):
            self.store.patch("nodes", "", n, {"metadata": {"labels": {"cloud.google.com/scheduled-maintenance-time": str(epoch)}}})

    def pods(self, selector: str = "") -> list[dict]:
        return self.store.list("pods", None, selector)[0]

    def errors(self) -> list[str]:
        return [*self.kubelet.errors, *self.kuberay.errors, *(self.autoscaler.errors if self.autoscaler else [])]
