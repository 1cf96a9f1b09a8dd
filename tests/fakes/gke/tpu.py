"""What GKE's TPU machinery does to a pod, as pure functions: the KubeRay TPU webhook (admission),
GKE's TPU device plugin (the environment of a container that got chips), and GKE's
ExtendedResourceToleration admission (a pod asking for `google.com/tpu` tolerates the TPU taint).

Written from their sources (tests/fakes/kuberay/NOTES.md section g; ../shared/notes/gke.md 2.1),
not from tpulaunch's code: a fake must not agree with the product by sharing its mistakes.
"""

from __future__ import annotations

import copy
import math

TPU = "google.com/tpu"
TOPOLOGY = "cloud.google.com/gke-tpu-topology"
ACCEL = "cloud.google.com/gke-tpu-accelerator"
NODEPOOL = "cloud.google.com/gke-nodepool"

# accelerator label -> (TPU_ACCELERATOR_TYPE prefix, cores per chip counted in its suffix, 3D torus?)
GENERATIONS = {
    "tpu-v4-podslice": ("v4", 2, True),
    "tpu-v5-lite-podslice": ("v5litepod", 1, False),
    "tpu-v5-lite-device": ("v5litepod", 1, False),
    "tpu-v5p-slice": ("v5p", 2, True),
    "tpu-v6e-slice": ("v6e", 1, False),
    "tpu7x": ("tpu7x", 2, True),
}


class Rejected(Exception):
    """An admission webhook refused the object (what the API server returns as a 403/400)."""


def _dims(topology: str) -> list[int]:
    return [int(d) for d in topology.split("x")]


def container_chips(container: dict) -> int:
    res = container.get("resources") or {}
    value = (res.get("requests") or {}).get(TPU) or (res.get("limits") or {}).get(TPU) or 0
    return int(value)


def pod_chips(spec: dict) -> int:
    return sum(container_chips(c) for c in spec.get("containers") or [])


def hosts_for(topology: str, chips_per_host: int) -> int:
    return max(math.prod(_dims(topology)) // max(chips_per_host, 1), 1)


def _add_env(container: dict, name: str, value: str | None = None, field_path: str | None = None) -> None:
    env = container.setdefault("env", [])
    entry: dict = {"name": name}
    if field_path:
        entry["valueFrom"] = {"fieldRef": {"fieldPath": field_path}}
    else:
        entry["value"] = value
    env.append(entry)  # appended, as the webhook's JSON patch does: a later duplicate wins


def _env_value(container: dict, name: str) -> str | None:
    for e in reversed(container.get("env") or []):
        if e.get("name") == name:
            return e.get("value", "")
    return None


# -- the KubeRay TPU webhook ------------------------------------------------------------------------


def webhook_mutate(pod: dict) -> dict:
    """The mutating webhook on a Pod CREATE (kuberay-tpu-webhook main.go `mutatePod`)."""
    spec = pod.get("spec") or {}
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get("app.kubernetes.io/name") != "kuberay" or not pod_chips(spec):
        return pod
    selector = spec.get("nodeSelector") or {}
    if "ray.io/cluster" not in labels or "ray.io/group" not in labels or TOPOLOGY not in selector:
        raise Rejected("TPU pod is missing the ray.io/cluster or ray.io/group label, or the"
                       f" {TOPOLOGY} nodeSelector")
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    cluster, group = labels["ray.io/cluster"], labels["ray.io/group"]
    topology = selector[TOPOLOGY]
    hosts = hosts_for(topology, pod_chips(spec))
    v7x = selector.get(ACCEL, "").startswith("tpu7x")
    tpu_containers = [c for c in spec["containers"] if container_chips(c)]
    if "ray.io/worker-group-replica-index" not in labels or "ray.io/replica-host-index" not in labels:
        if hosts > 1:
            raise Rejected("multi-host TPU pod without KubeRay's replica index labels (the fake serves KubeRay >= 1.5)")
        replica, worker = int(labels.get("ray.io/worker-group-replica-index", "0")), 0
        pod["metadata"].setdefault("labels", {})["replicaIndex"] = f"{group}-{replica}"
    else:
        replica, worker = int(labels["ray.io/worker-group-replica-index"]), int(labels["ray.io/replica-host-index"])
    headless = f"{cluster}-headless"[-50:]  # CheckName keeps the end
    if hosts > 1:
        spec["hostname"] = f"{group}-{replica}-{worker}"
        spec["subdomain"] = headless
        replica_name = labels.get("ray.io/worker-group-replica-name", "")
        spec["affinity"] = {
            "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchExpressions": [
                    {"key": "ray.io/worker-group-replica-name", "operator": "In", "values": [replica_name]},
                    {"key": "ray.io/cluster", "operator": "In", "values": [cluster]}]},
                "topologyKey": NODEPOOL}]},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchExpressions": [
                    {"key": "ray.io/worker-group-replica-name", "operator": "NotIn", "values": [replica_name]},
                    {"key": "ray.io/worker-group-replica-name", "operator": "Exists"},
                    {"key": "ray.io/cluster", "operator": "In", "values": [cluster]}]},
                 "topologyKey": NODEPOOL},
                {"labelSelector": {"matchExpressions": [
                    {"key": "ray.io/cluster", "operator": "NotIn", "values": [cluster]},
                    {"key": "ray.io/worker-group-replica-name", "operator": "Exists"}]},
                 "topologyKey": NODEPOOL}]},
        }
    for k, c in enumerate(tpu_containers):
        if _env_value(c, "MEGASCALE_NUM_SLICES") is not None:
            if not _env_value(c, "MEGASCALE_SLICE_ID"):
                _add_env(c, "MEGASCALE_SLICE_ID", str(replica))
            if not _env_value(c, "MEGASCALE_COORDINATOR_ADDRESS"):
                _add_env(c, "MEGASCALE_COORDINATOR_ADDRESS", f"{group}-0-0.{headless}" + (":8081" if v7x else ""))
            if not _env_value(c, "MEGASCALE_PORT"):
                _add_env(c, "MEGASCALE_PORT", str(8081 + k if v7x else 8081))
        if hosts > 1:
            names = [f"{group}-{replica}-{h}.{headless}" for h in range(hosts)]
            if _env_value(c, "TPU_WORKER_HOSTNAMES") in (None, "", "localhost"):
                _add_env(c, "TPU_WORKER_HOSTNAMES", ",".join(names))
            if v7x:
                n = len(tpu_containers)
                if "localhost" in (_env_value(c, "TPU_PROCESS_ADDRESSES") or "localhost"):
                    _add_env(c, "TPU_PROCESS_ADDRESSES", ",".join(f"{h}:{8471 + j}" for h in names for j in range(n)))
                if not _env_value(c, "TPU_PROCESS_PORT"):
                    _add_env(c, "TPU_PROCESS_PORT", str(8471 + k))
        wid = worker * len(tpu_containers) + k if v7x else worker
        have = _env_value(c, "TPU_WORKER_ID")
        if not have or (have == str(k) and have != str(wid)):
            _add_env(c, "TPU_WORKER_ID", str(wid))
        if not _env_value(c, "TPU_NAME"):
            _add_env(c, "TPU_NAME", f"{group}-{replica}")
        if _env_value(c, "TPU_DEVICE_PLUGIN_HOST_IP") is None:
            _add_env(c, "TPU_DEVICE_PLUGIN_HOST_IP", field_path="status.hostIP")
        if not _env_value(c, "TPU_DEVICE_PLUGIN_ADDR"):
            _add_env(c, "TPU_DEVICE_PLUGIN_ADDR", "$(TPU_DEVICE_PLUGIN_HOST_IP):2112")
    return pod


def webhook_validate(raycluster: dict) -> None:
    """The validating webhook on a RayCluster CREATE (`validateRayCluster`)."""
    for g in (raycluster.get("spec") or {}).get("workerGroupSpecs") or []:
        tspec = (g.get("template") or {}).get("spec") or {}
        chips = pod_chips(tspec)
        if not chips:
            continue
        topology = (tspec.get("nodeSelector") or {}).get(TOPOLOGY)
        if not topology or not g.get("numOfHosts"):
            raise Rejected(f"worker group {g.get('groupName')}: a TPU group needs the {TOPOLOGY} nodeSelector"
                           " and numOfHosts")
        if hosts_for(topology, chips) != g["numOfHosts"]:
            raise Rejected("Number of workers in worker group not equal to specified topology")


# -- GKE admission: pods that ask for TPU chips tolerate the TPU taint -------------------------------


def tolerate_extended_resources(pod: dict) -> dict:
    """ExtendedResourceToleration: a pod requesting `google.com/tpu` gets a toleration for the taint
    GKE puts on TPU nodes (`google.com/tpu=present:NoSchedule`)."""
    if not pod_chips(pod.get("spec") or {}):
        return pod
    pod = copy.deepcopy(pod)
    tol = pod["spec"].setdefault("tolerations", [])
    if not any(t.get("key") == TPU for t in tol):
        tol.append({"key": TPU, "operator": "Exists", "effect": "NoSchedule"})
    return pod


# -- GKE's TPU device plugin ------------------------------------------------------------------------


_PER_DIM = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


def device_plugin_env(node_labels: dict, chips: int, node_ip: str) -> dict[str, str]:
    """What the device plugin's Allocate puts in a container given `chips` chips on this node
    (`util.go` InitEnvs / addPodsliceOrSliceEnvs / addSingleHostEnvs)."""
    accel = node_labels.get(ACCEL, "")
    prefix, cores, three_d = GENERATIONS[accel]
    topology = node_labels.get(TOPOLOGY, "")
    dims = _dims(topology)
    dims3 = dims + [1] * (3 - len(dims))
    per = _PER_DIM[chips]
    host_bounds = [max(d // p, 1) for d, p in zip(dims3, per)]
    if three_d:
        wrap = ["true" if all(d >= 4 for d in dims3) else "false"] * 3
    else:
        wrap = ["true" if d == 16 else "false" for d in dims3[:2]] + ["false"]
    env = {
        "TPU_SKIP_MDS_QUERY": "true",
        "TPU_RUNTIME_METRICS_PORTS": ",".join(str(8431 + i) for i in range(chips)),
        "TPU_TOPOLOGY": topology,
        "TPU_ACCELERATOR_TYPE": f"{prefix}-{math.prod(dims) * cores}",
        "VBAR_CONTROL_SERVICE_URL": f"{node_ip}:8353",
        "TPU_HOST_BOUNDS": ",".join(map(str, host_bounds)), "HOST_BOUNDS": ",".join(map(str, host_bounds)),
        "TPU_CHIPS_PER_HOST_BOUNDS": ",".join(map(str, per)), "CHIPS_PER_HOST_BOUNDS": ",".join(map(str, per)),
        "TPU_TOPOLOGY_WRAP": ",".join(wrap), "WRAP": ",".join(wrap),
        "TPU_TOPOLOGY_ALT": "false", "ALT": "false",
    }
    if three_d and all(d >= 4 for d in dims3) and node_labels.get("cloud.google.com/gke-tpu-ici-resiliency") != "false":
        env["ENABLE_ICI_RESILIENCY"] = "true"
    if math.prod(dims) <= chips and accel != "tpu7x":  # single-host, before tpu7x
        env.update(TPU_WORKER_ID="0", TPU_WORKER_HOSTNAMES="localhost")
    return env
