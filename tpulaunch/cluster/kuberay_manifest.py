"""The Kubernetes objects of a tpulaunch cluster on GKE, as pure data (`--dry-run --json` prints them).

A `ray.io/v1` RayCluster for KubeRay (>= 1.5.1 for `authOptions`):

* the head on a CPU node, never a TPU one (a required node affinity: no
  `cloud.google.com/gke-tpu-accelerator` label), with the service account tpulaunch's supervisor
  uses to read its slices' pods (preemptions) from the Kubernetes API;
* one TPU worker group: `replicas` = `minReplicas` = `maxReplicas` = the slices (KubeRay makes
  each replica one slice of `numOfHosts` pods, atomically), `google.com/tpu` limits = requests =
  the chips of one VM, the nodeSelectors GKE's TPU node pools answer to
  (`cloud.google.com/gke-tpu-accelerator`, `cloud.google.com/gke-tpu-topology`, `cloud.google.com/gke-spot`,
  and a tpu7x pool's workload policy when given);
* Ray's token auth with tpulaunch's own token (`authOptions.secretName`): the token this machine
  keeps (owner-only) is the one in the Secret, so no client ever reads a Secret to get in.

tpulaunch does not ask the webhook for `MEGASCALE_*` (it only writes them when the container sets
`MEGASCALE_NUM_SLICES`): every attempt's plan sets them, for the slices that attempt has.

Every object carries `app.kubernetes.io/managed-by: tpulaunch` and the cluster's name and id, so
`cluster down` deletes exactly what `cluster up` made, and a RayCluster of that name not made by
tpulaunch is never touched.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from tpulaunch.plan import gke

MANAGED_BY = "app.kubernetes.io/managed-by"
CLUSTER_LABEL = "tpulaunch.dev/cluster"
ID_LABEL = "tpulaunch.dev/cluster-id"
VERSION_ANNOTATION = "tpulaunch.dev/version"
SPARES_ANNOTATION = "tpulaunch.dev/spares"  # JSON list of the replicas held in reserve (the supervisor updates it)
GROUP = "tpu"  # the TPU worker group: slices are `tpu-0`, `tpu-1`, ... (the webhook's TPU_NAME)
DASHBOARD_PORT, GCS_PORT, CLIENT_PORT = 8265, 6379, 10001
MEGASCALE_PORT = 8081


@dataclass(frozen=True)
class GkeClusterRequest:
    """What `cluster up --gke` asks for, checked (the shape is a real GKE slice)."""

    name: str
    namespace: str
    shape: gke.SliceShape
    num_slices: int
    image: str
    ray_version: str
    tpulaunch_version: str
    cluster_id: str
    spot: bool = False
    placement_policy: str | None = None
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    spare_slices: int = 0  # replicas more than the slices, held in reserve (the last ones)

    @property
    def replicas(self) -> int:
        return self.num_slices + self.spare_slices

    @property
    def spares(self) -> list[str]:
        return [f"{GROUP}-{r}" for r in range(self.num_slices, self.replicas)]

    @property
    def service_account(self) -> str:
        return f"{self.name}-tpulaunch"

    @property
    def token_secret(self) -> str:
        return f"{self.name}-tpulaunch-token"


def _labels(req: GkeClusterRequest) -> dict[str, str]:
    return {MANAGED_BY: "tpulaunch", CLUSTER_LABEL: req.name, ID_LABEL: req.cluster_id}


def _meta(req: GkeClusterRequest, name: str) -> dict:
    return {"name": name, "namespace": req.namespace, "labels": _labels(req)}


def raycluster(req: GkeClusterRequest) -> dict:
    """The RayCluster (the whole object)."""
    shape, topo = req.shape, req.shape.topology
    node_selector = {gke.ACCELERATOR_LABEL: shape.gke.label, gke.TOPOLOGY_LABEL: topo.topology}
    tolerations = []
    if req.spot:
        node_selector[gke.SPOT_LABEL] = "true"
        tolerations.append({"key": gke.SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    if req.placement_policy:
        node_selector[gke.PLACEMENT_POLICY_LABEL] = req.placement_policy
    chips = str(shape.chips_per_vm)
    common_env = [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]
    worker_ports = [{"containerPort": MEGASCALE_PORT, "name": "mxla"}] if req.replicas > 1 else []
    worker_spec: dict = {
        "nodeSelector": node_selector,
        "containers": [{
            "name": "ray-worker", "image": req.image, "env": list(common_env),
            "resources": {"limits": {gke.TPU_RESOURCE: chips}, "requests": {gke.TPU_RESOURCE: chips}},
            **({"ports": worker_ports} if worker_ports else {}),
        }],
    }
    if tolerations:
        worker_spec["tolerations"] = tolerations
    meta = _meta(req, req.name)
    meta["annotations"] = {VERSION_ANNOTATION: req.tpulaunch_version,
                           "tpulaunch.dev/accelerator": topo.accelerator_type,
                           "tpulaunch.dev/topology": topo.topology, "tpulaunch.dev/chips-per-vm": chips}
    if req.spare_slices:
        import json

        meta["annotations"][SPARES_ANNOTATION] = json.dumps(req.spares)
    return {
        "apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta,
        "spec": {
            "rayVersion": req.ray_version,
            "enableInTreeAutoscaling": False,
            "authOptions": {"mode": "token", "secretName": req.token_secret},
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {
                    "metadata": {"labels": _labels(req)},
                    "spec": {
                        "serviceAccountName": req.service_account,
                        # never on a TPU node; on an on-demand one where there is one (a spot node's
                        # preemption would take the head, and with it the cluster and its runs)
                        "affinity": {"nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchExpressions": [
                                    {"key": gke.ACCELERATOR_LABEL, "operator": "DoesNotExist"}]}]},
                            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
                                "matchExpressions": [{"key": gke.SPOT_LABEL, "operator": "DoesNotExist"}]}}]}},
                        "containers": [{
                            "name": "ray-head", "image": req.image, "env": list(common_env),
                            "ports": [{"containerPort": GCS_PORT, "name": "gcs-server"},
                                      {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                                      {"containerPort": CLIENT_PORT, "name": "client"}],
                            "resources": {"limits": {"cpu": req.head_cpu, "memory": req.head_memory},
                                          "requests": {"cpu": req.head_cpu, "memory": req.head_memory}},
                        }],
                    },
                },
            },
            "workerGroupSpecs": [{
                "groupName": GROUP,
                "replicas": req.replicas, "minReplicas": req.replicas, "maxReplicas": req.replicas,
                "numOfHosts": shape.hosts,
                "rayStartParams": {},
                "template": {"metadata": {"labels": _labels(req)}, "spec": worker_spec},
            }],
        },
    }


def token_secret(req: GkeClusterRequest, token: str) -> dict:
    """The Secret KubeRay reads the cluster's Ray token from (`authOptions.secretName`, key auth_token)."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(req, req.token_secret), "type": "Opaque",
            "data": {"auth_token": base64.b64encode(token.encode()).decode()}}


def supervisor_rbac(req: GkeClusterRequest) -> list[dict]:
    """The head's service account and what it may do: read its pods (whose end says a slice was
    preempted) and delete them (`--replace-hung` makes a hung slice again so, from a detached run's
    supervisor on the head), list the events on them (what GKE's autoscaler says of a slice that does
    not come back), its RayCluster in this namespace, and the nodes (cluster-wide: a node
    going NotReady is the first sign of a spot preemption)."""
    sa = req.service_account
    cluster_wide = f"tpulaunch-{req.namespace}-{req.name}"[:253]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(req, sa)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(req, sa),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
                   {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},  # the autoscaler's word
                   {"apiGroups": ["ray.io"], "resources": ["rayclusters"],
                    "verbs": ["get", "list", "watch", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(req, sa),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": req.namespace}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": cluster_wide, "labels": _labels(req)},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": cluster_wide, "labels": _labels(req)},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_wide},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": req.namespace}]},
    ]


def objects(req: GkeClusterRequest, token: str) -> list[dict]:
    """Everything `cluster up --gke` creates, in the order it creates them (the RayCluster last)."""
    return [token_secret(req, token), *supervisor_rbac(req), raycluster(req)]


def is_ours(obj: dict, name: str | None = None) -> bool:
    """Made by tpulaunch (for cluster `name`, when given)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(MANAGED_BY) == "tpulaunch" and (name is None or labels.get(CLUSTER_LABEL) == name)
