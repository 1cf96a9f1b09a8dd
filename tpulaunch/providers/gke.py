"""GKE: TPU slices are node pools, Ray is a KubeRay RayCluster (one replica per slice), and a lost
slice comes back when GKE has made its node pool again and KubeRay its replica.

`up` applies the objects `cluster.kuberay_manifest` describes and waits until every host of every
slice has joined Ray (the pods ready, then Ray's own node list through the job API), with progress
per slice; `join` adopts a KubeRay cluster that is there; `GkeProvider` is the seam's GKE side:
status, down, the job API through a port-forward the Kubernetes API opens (no kubectl), and
recovery from what the slice's pods say (`cluster.kuberay.slice_loss`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpulaunch import kube as kube_mod
from tpulaunch import settings
from tpulaunch.cluster import kuberay, tokens
from tpulaunch.cluster import kuberay_manifest as manifest
from tpulaunch.cluster.jobs import Unreachable
from tpulaunch.cluster.record import GKE_ENV, ClusterInfo, GkeSpec, clear_record, save_record
from tpulaunch.discover import ray_labels
from tpulaunch.errors import ClusterError, DiscoveryError, TpulaunchError
from tpulaunch.plan import gke
from tpulaunch.plan.slicespec import SliceSpec
from tpulaunch.providers.base import Progress, Provider, Recreation, RejoinFailed, Say

if TYPE_CHECKING:
    from tpulaunch.cluster.jobs import JobApi

DEFAULT_TIMEOUT_S = 900.0
# How long the cluster autoscaler's "no node could ever take them" stands before a bring-up that hangs
# on it ends (its events come one a pod and reason in 5 minutes; node auto-provisioning speaks late).
DECLINE_ENV, DECLINE_S = "TPULAUNCH_AUTOSCALER_DECLINE_TIMEOUT", 120.0
# How long a lost host's slice may take to show its loss in the API (the kubelet's shutdown: GKE gives
# spot pods 15 s of a 30 s notice, up to 120 s when extended) before it is taken for a host lost alone.
SETTLE_S = 45.0


def token_key(target: kube_mod.KubeTarget, namespace: str, name: str) -> str:
    where = f"{target.kubeconfig or ''}|{target.context or ''}|{namespace}|{name}"
    return "gke-" + hashlib.sha256(where.encode()).hexdigest()[:10]


def client_versions() -> tuple[str, str]:
    """(tpulaunch, ray) as this machine has them: what the image must carry."""
    import importlib.metadata

    return importlib.metadata.version("tpulaunch"), importlib.metadata.version("ray")


@dataclass(frozen=True)
class UpRequest:
    """`cluster up --gke` as given."""

    target: kube_mod.KubeTarget
    name: str
    topology: str
    accelerator: str
    num_slices: int = 1
    chips_per_vm: int | None = None
    spot: bool = False
    image: str | None = None
    placement_policy: str | None = None
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    timeout_s: float = DEFAULT_TIMEOUT_S
    spare_slices: int = 0
    autoscaler: bool = False  # the node pools come from GKE's cluster autoscaler: their nodes need not be there


def request_of(up: UpRequest, namespace: str, cluster_id: str) -> manifest.GkeClusterRequest:
    """The checked request the manifests are made from (one line, exit 2, for a shape GKE lacks)."""
    from tpulaunch.errors import TpulaunchError

    kuberay.check_name(up.name)
    kube_mod.check_namespace(namespace)
    if not 1 <= up.num_slices <= 1024:
        raise TpulaunchError(f"--num-slices {up.num_slices} is not a number of slices from 1 to 1024",
                             "e.g. --num-slices 2")
    if not 0 <= up.spare_slices <= 64:
        raise TpulaunchError(f"--spare-slices {up.spare_slices} is not from 0 to 64", "e.g. --spare-slices 1")
    if not up.image:
        tv, rv = client_versions()
        raise TpulaunchError("--image is needed: the image every pod runs",
                             f"build one with tpulaunch {tv} and ray[default]=={rv}"
                             f" (e.g. FROM rayproject/ray:{rv}-py311, RUN pip install tpulaunch=={tv})")
    shape = gke.shape(up.accelerator, up.topology, up.chips_per_vm)
    tv, rv = client_versions()
    return manifest.GkeClusterRequest(name=up.name, namespace=namespace, shape=shape, num_slices=up.num_slices,
                                      image=up.image, ray_version=rv, tpulaunch_version=tv, cluster_id=cluster_id,
                                      spot=up.spot, placement_policy=up.placement_policy, head_cpu=up.head_cpu,
                                      head_memory=up.head_memory, spare_slices=up.spare_slices)


def dry_run(up: UpRequest) -> dict:
    """The RayCluster `up` would apply; touches nothing (the namespace: --namespace, else `default`)."""
    return manifest.raycluster(request_of(up, up.target.namespace or "default", "dry-run"))


def _connect(target: kube_mod.KubeTarget) -> kube_mod.Kube:
    return kube_mod.connect(target)


@dataclass
class Checked:
    """An `UpRequest` that passed every check that asks nothing to be made (what `up` goes on from)."""

    request: UpRequest
    kube: kube_mod.Kube
    existing: dict | None  # the RayCluster of that name, if tpulaunch made it already
    pools: list  # the node pools the slices fit on


def check_up(request: UpRequest) -> Checked:
    """Everything that can be checked before anything is made, in one line each: the flags, the API
    reachable and KubeRay's CRD served, a RayCluster of that name not made by tpulaunch (refused),
    node pools of the shape (enough of them)."""
    kube = _connect(request.target)
    shape_req = request_of(request, kube.namespace, "check")
    kube.rayclusters_served()
    existing = kube.get("RayCluster", request.name)
    if existing is not None and not manifest.is_ours(existing, request.name):
        raise ClusterError(f"a RayCluster named {request.name} is in namespace {kube.namespace} and tpulaunch did not"
                           " make it", f"choose another --name, or adopt it with `tpulaunch cluster up --gke --join"
                           f" {request.name}`")
    return Checked(request, kube, existing, _check_pools(_pools(kube), shape_req, request.spot, request.autoscaler))


def up(checked: Checked, say: Say) -> ClusterInfo:
    """Bring the RayCluster up and wait until every host of every slice is in Ray; its record.

    A failure after something was made deletes it all; an interrupt leaves the record, which
    `cluster down` clears."""
    request, kube, existing = checked.request, checked.kube, checked.existing
    ns = kube.namespace
    # every slice hangs on GKE's autoscaler: its "never", once it has stood, ends the wait (kuberay.Declines)
    declines = kuberay.Declines(settings.seconds(DECLINE_ENV, DECLINE_S)) \
        if request.autoscaler and not checked.pools else None
    key = token_key(request.target, ns, request.name)
    token_path, token, _created = tokens.ensure_token(key)
    req = request_of(request, ns, tokens.cluster_id_of(token))
    shown = ", ".join(p.pool for p in checked.pools)
    if len(checked.pools) < req.replicas:  # --autoscaler: the rest are GKE's to make
        shown = (shown + "; " if shown else "") + "the rest from GKE's cluster autoscaler"
    say(f"node pools for {req.num_slices} x {req.shape.topology.accelerator_type} ({req.shape.topology.topology}):"
        f" {shown}")
    objs = manifest.objects(req, token)
    names = tuple(f"{o['kind']}/{o['metadata']['name']}" for o in objs)
    spec = GkeSpec(request.name, ns, request.target.context, request.target.kubeconfig, True, manifest.GROUP, names)
    info = ClusterInfo(address=f"{request.name}-head-svc.{ns}.svc.cluster.local:{manifest.GCS_PORT}", temp_dir=None,
                       token_path=str(token_path), emulated=False, cluster_id=req.cluster_id, gke=spec)
    save_record(info)  # before anything is made: an interrupted bring-up leaves what `cluster down` clears
    made: list[str] = []
    try:
        if existing is None:
            say(f"creating RayCluster {request.name} in namespace {ns} ({len(objs)} objects)")
            made = kuberay.create_all(kube, objs)
        else:
            say(f"RayCluster {request.name} is up already (made by tpulaunch): waiting for it")
        shape = req.shape
        provider = GkeProvider(info)
        kuberay.wait_head(kube, request.name, request.timeout_s, say, group=manifest.GROUP, declines=declines)
        api = provider.job_api(kube)
        api.wait_answering(request.timeout_s)
        check_image(api, req.image, say)  # as soon as the head runs: a wrong image fails before any TPU wait
        pods = kuberay.wait_pods(kube, request.name, manifest.GROUP, req.replicas, shape.hosts, request.timeout_s,
                                 lambda prog, head: say(_progress_line(prog, head)), declines=declines)
        wait_ray(api, [f"{manifest.GROUP}-{r}" for r in range(req.replicas)], shape.hosts, request.timeout_s, say)
        info.slices = kuberay.slices_from_pods(pods, manifest.GROUP, shape.topology.accelerator_type,
                                               shape.topology.topology, req.replicas)
        info.spares = req.spares
    except BaseException as e:
        if existing is None and isinstance(e, Exception):
            # only what it made: a create that failed has deleted its own (kuberay.create_all), and
            # an object of that name made by someone else (a 409) is theirs
            say(f"bring-up failed: deleting what it made ({', '.join(made) or 'nothing left'})")
            try:
                kuberay.delete_all(kube, made)
                clear_record()
                tokens.token_file(key).unlink(missing_ok=True)
            except TpulaunchError as d:
                say(f"could not delete it all ({d.line()}): `tpulaunch cluster down` clears it")
        raise
    save_record(info)
    return info


def _pools(kube: kube_mod.Kube) -> list:
    from tpulaunch.discover import gke as discover_gke

    return discover_gke.list_pools(kube)


def _check_pools(pools: list, req: manifest.GkeClusterRequest, spot: bool, autoscaler: bool = False) -> list:
    """The node pools the slices can land on; DiscoveryError when there are not enough (naming what is
    there), unless the cluster autoscaler is to make them (`--autoscaler`: a pool scaled to zero, or
    node auto-provisioning, has no nodes to see; `kuberay.wait_pods` reads its answer instead)."""
    from tpulaunch.discover import gke as discover_gke

    fit = discover_gke.fitting(pools, req.shape, spot)
    if len(fit) >= req.replicas or autoscaler:
        return fit
    topo = req.shape.topology
    want = (f"{req.replicas} node pool(s) of {topo.generation.name} {topo.topology} with {req.shape.chips_per_vm} chips"
            f" a node{' (spot)' if spot else ''}")
    have = "; ".join(f"{p.pool}: {p.generation or p.accelerator_label} {p.topology or '?'},"
                     f" {p.chips_per_node} chips a node, {len(p.nodes)}/{p.expected_hosts or '?'} hosts"
                     f"{', spot' if p.spot else ''}" for p in pools)
    raise DiscoveryError(f"no room for {want}: {len(fit)} fit" + (f" (TPU node pools: {have})" if pools else
                                                                  " (the cluster has no TPU node pools)"),
                         "create them (gcloud container node-pools create ... --machine-type"
                         f" {req.shape.machine_type} --tpu-topology {topo.topology}"
                         f" --num-nodes {req.shape.hosts}), or ask for a shape that is there"
                         " (`tpulaunch slice list --gke`); pools that autoscale from zero, or node"
                         " auto-provisioning: add --autoscaler")


def _progress_line(progress: list[kuberay.SliceProgress], head_ready: bool) -> str:
    return "  ".join([f"head: {'ready' if head_ready else 'starting'}"] + [s.line() for s in progress])


def check_image(api: JobApi, image: str, say: Say) -> None:
    """The image carries this client's tpulaunch and Ray (asked of the head: Ray's version from its
    dashboard, tpulaunch's from a one-line job); ClusterError in one line if not."""
    tv, rv = client_versions()
    head_ray = str(api.version().get("ray_version") or "")
    if head_ray and head_ray != rv:
        raise ClusterError(f"the image {image} runs Ray {head_ray}, this tpulaunch uses Ray {rv}",
                           f"build the image with ray[default]=={rv} and tpulaunch {tv}")
    say("checking the image's tpulaunch on the head")
    sid = f"tpulaunch-version-{int(time.time() * 1000)}"
    code = ("import json, ray, tpulaunch;"
            " print('TPULAUNCH_VERSIONS', json.dumps([tpulaunch.__version__, ray.__version__]))")
    api.submit(entrypoint=f"python3 -c {json.dumps(code)}", submission_id=sid, runtime_env=None,
               metadata={"tpulaunch": "tool", "tool": "version"})
    end = time.monotonic() + 120
    while True:
        try:
            job = api.info(sid)
        except Unreachable:  # a loaded head: asked again, until the bound
            job = None
        if job is not None and job.terminal:
            break
        if time.monotonic() > end:
            raise ClusterError("the head did not run a one-line job within 120 s", "see the head pod's log")
        time.sleep(0.5)
    log = api.driver_log(sid)
    line = next((ln for ln in log.splitlines() if ln.startswith("TPULAUNCH_VERSIONS ")), None)
    if line is None:
        raise ClusterError(f"the image {image} has no tpulaunch (`python3 -c 'import tpulaunch'` failed on the head:"
                           f" {log.strip().splitlines()[-1][:160] if log.strip() else 'no output'})",
                           f"build the image with tpulaunch {tv} and ray[default]=={rv}")
    their_tv, their_rv = json.loads(line.split(" ", 1)[1])
    if (their_tv, their_rv) != (tv, rv):
        raise ClusterError(f"the image {image} carries tpulaunch {their_tv} and Ray {their_rv}; this client has"
                           f" tpulaunch {tv} and Ray {rv}",
                           f"build the image with tpulaunch {tv} and ray[default]=={rv}")


def wait_ray(api: JobApi, slices: list[str], hosts: int, timeout_s: float, say: Say) -> None:
    """Until every host of `slices` is an alive Ray node carrying its TPU labels (Ray's node list)."""
    end = time.monotonic() + timeout_s
    last = ""
    while True:
        joined: dict[str, set[int]] = {s: set() for s in slices}
        try:
            nodes = api.nodes()
        except Unreachable:  # a head loaded by the hosts joining it: asked again, until the bound
            if time.monotonic() >= end:
                raise
            time.sleep(1.0)
            continue  # no answer says nothing of who joined: the progress line stays as it was
        for n in nodes:
            labels = n.get("labels") or {}
            s, w = labels.get(ray_labels.SLICE), labels.get(ray_labels.WORKER, "")
            if n.get("state") == "ALIVE" and s in joined and w.isdigit():
                joined[s].add(int(w))
        line = "in Ray: " + "  ".join(f"{s}: {len(ws)}/{hosts}" for s, ws in joined.items())
        if line != last:
            say(line)
            last = line
        if all(ws == set(range(hosts)) for ws in joined.values()):
            return
        if time.monotonic() >= end:
            raise ClusterError(f"not every host joined Ray within {timeout_s:g} s ({line})",
                               "see the worker pods' logs (`kubectl logs -l ray.io/cluster=NAME`)")
        time.sleep(1.0)


def join(target: kube_mod.KubeTarget, name: str, say: Say) -> ClusterInfo:
    """Adopt a KubeRay cluster that is there: its TPU group's slices from its pods, its token from the
    Secret its `authOptions` name. `cluster down` leaves it standing."""
    import base64

    kube = _connect(target)
    kube.rayclusters_served()
    rc = kube.get("RayCluster", name)
    if rc is None:
        raise ClusterError(f"no RayCluster named {name} in namespace {kube.namespace}",
                           "`kubectl get rayclusters` lists them (or pass --namespace)")
    group = next((g for g in rc["spec"].get("workerGroupSpecs") or []
                  if any(gke.TPU_RESOURCE in ((c.get("resources") or {}).get("limits") or {})
                         for c in g["template"]["spec"]["containers"])), None)
    if group is None:
        raise ClusterError(f"RayCluster {name} has no TPU worker group (no container asks for google.com/tpu)",
                           "join a cluster with TPU workers")
    sel = group["template"]["spec"].get("nodeSelector") or {}
    label, topo_text = sel.get(gke.ACCELERATOR_LABEL), sel.get(gke.TOPOLOGY_LABEL)
    g = gke.generation_of_label(label or "")
    if g is None or not topo_text:
        raise ClusterError(f"RayCluster {name}'s TPU group does not select a TPU generation and topology",
                           f"its nodeSelector needs {gke.ACCELERATOR_LABEL} and {gke.TOPOLOGY_LABEL}")
    chips = int(group["template"]["spec"]["containers"][0]["resources"]["limits"][gke.TPU_RESOURCE])
    shape = gke.shape(g.generation, topo_text, chips)
    token_path = None
    auth = rc["spec"].get("authOptions") or {}
    if auth.get("mode") == "token":
        secret = kube.get("Secret", auth.get("secretName") or name[-50:])
        raw = ((secret or {}).get("data") or {}).get("auth_token")
        if not raw:
            raise ClusterError(f"RayCluster {name} uses token auth but its Secret holds no auth_token",
                               "is KubeRay done creating it? try again")
        token_path = str(tokens.store_token(token_key(target, kube.namespace, name), base64.b64decode(raw).decode()))
    n = group.get("replicas", 0)
    pods = kube.list("Pod", kuberay.selector(name))
    spec = GkeSpec(name, kube.namespace, target.context, target.kubeconfig, False, group["groupName"], ())
    info = ClusterInfo(address=f"{name}-head-svc.{kube.namespace}.svc.cluster.local:{manifest.GCS_PORT}", temp_dir=None,
                       token_path=token_path, emulated=False, gke=spec,
                       slices=kuberay.slices_from_pods(pods, group["groupName"], shape.topology.accelerator_type,
                                                       shape.topology.topology, n))
    info.spares = _spares_of(rc)  # a cluster tpulaunch made with spares names them
    say(f"joined RayCluster {name} ({n} x {shape.topology.accelerator_type}); `cluster down` leaves it standing")
    save_record(info)
    return info


def _spares_of(rc: dict) -> list[str]:
    """The spare slices a RayCluster's annotation names (tpulaunch's; none on another's). Pure."""
    raw = ((rc.get("metadata") or {}).get("annotations") or {}).get(manifest.SPARES_ANNOTATION)
    try:
        names = json.loads(raw) if raw else []
    except ValueError:
        names = []
    return [n for n in names if isinstance(n, str)]


_FORWARDS: dict[tuple[str, str, str], kube_mod.Forward] = {}


class GkeProvider(Provider):
    """A cluster on GKE (`cluster up --gke`, or joined)."""

    kind = "gke"

    def __init__(self, info: ClusterInfo) -> None:
        super().__init__(info)
        assert info.gke is not None
        self.spec = info.gke
        self._kube: kube_mod.Kube | None = None
        self._shape_cache: tuple[int, str, str] | None = None

    @property
    def target(self) -> kube_mod.KubeTarget:
        return kube_mod.KubeTarget(self.spec.kubeconfig, self.spec.context, self.spec.namespace)

    def kube(self) -> kube_mod.Kube:
        if self._kube is None:
            self._kube = _connect(self.target)
        return self._kube

    # -- reaching it --------------------------------------------------------------------------------

    def job_url(self) -> str:
        """In the cluster: the head service; elsewhere a port-forward to the head pod's dashboard,
        opened through the Kubernetes API (kept open for this process)."""
        if kube_mod.in_pod():
            return f"http://{self.spec.head_service}.{self.spec.namespace}.svc.cluster.local:{manifest.DASHBOARD_PORT}"
        kube = self.kube()
        head = kuberay.head_pod(kube, self.spec.name)
        if head is None or not (head.get("status") or {}).get("podIP"):
            raise ClusterError(f"RayCluster {self.spec.name} has no running head pod",
                               "see `tpulaunch cluster status`; KubeRay makes the head again if it failed")
        key = (self.spec.namespace, self.spec.name, head["metadata"]["name"])
        fwd = _FORWARDS.get(key)
        if fwd is None:
            fwd = _FORWARDS[key] = kube.forward(head["metadata"]["name"], manifest.DASHBOARD_PORT)
        return fwd.url

    def job_api(self, kube: kube_mod.Kube | None = None) -> JobApi:
        from tpulaunch.cluster.jobs import JobApi
        from tpulaunch.cluster.record import check_token_file

        if kube is not None:
            self._kube = kube
        token = check_token_file(self.info.token_path, "the cluster's token file") if self.info.token_path else None
        return JobApi(self.job_url(), token)

    def spares(self) -> list[str]:
        """The RayCluster's annotation says (the supervisor on the head and every client read the same)."""
        return _spares_of(self.kube().get("RayCluster", self.spec.name) or {})

    def swap(self, lost: str, spare: str) -> None:
        """The annotation says `lost` is the spare now; the record has the spare where its pods are now
        (`preempted` compares a slice with it when the spare, in the run, is lost in turn)."""
        names = [lost if s == spare else s for s in self.spares()]
        self.kube().patch("RayCluster", self.spec.name,
                          {"metadata": {"annotations": {manifest.SPARES_ANNOTATION: json.dumps(names)}}})
        self.info.spares = names
        r = self._replica(spare)
        if r is not None:
            pods = self.kube().list("Pod", kuberay.selector(self.spec.name))
            now = kuberay.slices_from_pods(pods, self.spec.group, "", "", r + 1)[r]
            self.info.slices = [s for s in self.info.slices if s.name != spare] + [now]

    def supervisor_env(self) -> dict[str, str]:
        doc = {"name": self.spec.name, "namespace": self.spec.namespace, "group": self.spec.group}
        return {GKE_ENV: json.dumps(doc)}

    # -- what it holds --------------------------------------------------------------------------------

    def status(self) -> dict:
        """Each slice's hosts: pod, node, phase, ready, and whether Ray has them; maintenance ahead."""
        from tpulaunch.discover import gke as discover_gke

        kube = self.kube()
        pods = kube.list("Pod", kuberay.selector(self.spec.name))
        nodes = {n["metadata"]["name"]: n for n in kube.list("Node", gke.ACCELERATOR_LABEL)}
        pools = {p.pool: p for p in discover_gke.pools_from_nodes(list(nodes.values()))}
        try:
            ray_nodes = self.job_api().nodes()
        except TpulaunchError:
            ray_nodes = []
        alive = {((n.get("labels") or {}).get(ray_labels.SLICE), (n.get("labels") or {}).get(ray_labels.WORKER))
                 for n in ray_nodes if n.get("state") == "ALIVE"}
        head = kuberay.head_pod(kube, self.spec.name)
        slices = []
        for s in self.info.slices or []:
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(kuberay.REPLICA) == str(s.slice_index)
                    and (p["metadata"].get("labels") or {}).get(kuberay.GROUP) == self.spec.group]
            hosts = []
            pool = None
            for p in sorted(mine, key=lambda p: int(p["metadata"]["labels"].get(kuberay.HOST, "0"))):
                wid = p["metadata"]["labels"].get(kuberay.HOST, "0")
                node = (p.get("spec") or {}).get("nodeName")
                pool = pool or ((nodes.get(node) or {}).get("metadata", {}).get("labels", {}).get(gke.NODEPOOL_LABEL))
                status = p.get("status") or {}
                hosts.append({"worker_id": int(wid), "pod": p["metadata"]["name"], "node": node,
                              "node_ip": status.get("podIP"), "phase": status.get("phase"),
                              "ready": kuberay._ready(p), "alive": (s.name, wid) in alive, "busy": None})
            maint = pools[pool].maintenance if pool in pools else None
            slices.append({"name": s.name, "pod_type": s.accelerator_type, "topology": s.topology, "node_pool": pool,
                           "replica": mine[0]["metadata"]["labels"].get(kuberay.REPLICA_NAME) if mine else None,
                           "maintenance_at": discover_gke._iso(maint) if maint else None, "hosts": hosts})
        return {"schema": "tpulaunch.cluster-status/v1", "address": self.info.address, "emulated": False,
                "gke": {"raycluster": self.spec.name, "namespace": self.spec.namespace, "owned": self.spec.owned,
                        "head_pod": head["metadata"]["name"] if head else None,
                        "head_ready": kuberay._ready(head) if head else False},
                "slices": slices}

    def down(self, progress: Progress, wait_s: float = 180.0) -> dict:
        """Delete what tpulaunch made (a joined cluster: nothing) and wait for its pods to go."""
        say = progress.note
        if not self.spec.owned:
            clear_record()
            return {"deleted": [], "left_standing": self.spec.name}
        kube = self.kube()
        rc = kube.get("RayCluster", self.spec.name)
        if rc is not None and not manifest.is_ours(rc, self.spec.name):
            raise ClusterError(f"RayCluster {self.spec.name} was not made by tpulaunch (its labels say so):"
                               " left as it is",
                               "delete it yourself if it is yours (`kubectl delete raycluster ...`)")
        say(f"deleting RayCluster {self.spec.name} and what tpulaunch made for it")
        gone = kuberay.delete_all(kube, self.spec.objects)
        end = time.monotonic() + wait_s
        while kube.list("Pod", kuberay.selector(self.spec.name)):
            if time.monotonic() >= end:
                raise ClusterError(f"RayCluster {self.spec.name}'s pods were still there {wait_s:g} s after its"
                                   " deletion",
                                   "run `tpulaunch cluster down` again (the record is kept for it)")
            time.sleep(1.0)
        clear_record()
        if self.info.token_path and tokens.is_ours(self.info.token_path):
            from pathlib import Path

            Path(self.info.token_path).unlink(missing_ok=True)
        return {"deleted": gone}

    # -- recovery -----------------------------------------------------------------------------------

    def recreate_refusal(self) -> str | None:
        return None  # KubeRay makes a lost replica again once GKE has its node pool back

    def check_recreate(self) -> None:
        if self.kube().get("RayCluster", self.spec.name) is None:
            raise ClusterError(f"RayCluster {self.spec.name} is not in namespace {self.spec.namespace}",
                               "bring it up again (`tpulaunch cluster up --gke ...`)")

    def _replica(self, slice_name: str) -> int | None:
        prefix = f"{self.spec.group}-"
        tail = slice_name[len(prefix):] if slice_name.startswith(prefix) else ""
        return int(tail) if tail.isdigit() else None

    def _hosts(self) -> int:
        return self._shape()[0]

    def _shape(self) -> tuple[int, str, str]:
        """(hosts per slice, accelerator type, topology) of the TPU group, from the RayCluster."""
        if self._shape_cache is None:
            rc = self.kube().get("RayCluster", self.spec.name) or {}
            group = next((g for g in (rc.get("spec") or {}).get("workerGroupSpecs") or []
                          if g.get("groupName") == self.spec.group), None)
            if group is None:
                raise ClusterError(f"RayCluster {self.spec.name} has no worker group {self.spec.group}",
                                   "is it the cluster tpulaunch brought up? (`tpulaunch cluster status`)")
            sel = group["template"]["spec"].get("nodeSelector") or {}
            chips = int(group["template"]["spec"]["containers"][0]["resources"]["limits"][gke.TPU_RESOURCE])
            g = gke.generation_of_label(sel.get(gke.ACCELERATOR_LABEL, ""))
            topo = sel.get(gke.TOPOLOGY_LABEL, "")
            acc = gke.shape(g.generation, topo, chips).topology.accelerator_type if g and topo else ""
            self._shape_cache = (int(group.get("numOfHosts", 1)), acc, topo)
        return self._shape_cache

    def _facts(self) -> tuple[list[dict], dict[str, dict]]:
        """The cluster's pods and the TPU nodes, as the API has them now."""
        kube = self.kube()
        pods = kube.list("Pod", kuberay.selector(self.spec.name))
        nodes = {n["metadata"]["name"]: n for n in kube.list("Node", gke.ACCELERATOR_LABEL)}
        return pods, nodes

    def preempted(self, slices: list[str]) -> dict[str, str | None]:
        """Also asked once a spare has taken a lost slice's place: by then KubeRay may have made the
        replica again already (new pods, waiting for GKE's pool), which says it as well as the old
        pods' end would have."""
        pods, nodes = self._facts()
        now = self._addresses(pods, slices)
        out: dict[str, str | None] = {}
        for s in slices:
            r = self._replica(s)
            out[s] = (kuberay.slice_loss(pods, nodes, self.spec.group, r) or self._remade(s, now)) \
                if r is not None else None
        return out

    def _addresses(self, pods: list[dict], slices: list[str]) -> dict[str, list[str]]:
        """Each of `slices`' pods' addresses now, by slice (none yet: an empty list)."""
        replicas = max((r for r in (self._replica(s) for s in slices) if r is not None), default=0) + 1
        return {sp.name: sorted(w.ip for w in sp.workers)
                for sp in kuberay.slices_from_pods(pods, self.spec.group, "", "", replicas)}

    def _remade(self, name: str, now: dict[str, list[str]]) -> str | None:
        """Why `name`'s replica is not the one the cluster's record has (KubeRay made it again), or None."""
        known = next((sorted(w.ip for w in s.workers) for s in self.info.slices if s.name == name), None)
        if known and now.get(name) != known:
            return ("KubeRay made its replica again (new pods, at new addresses or none yet): the old ones went with"
                    " their nodes")
        return None

    def bring_back(self, lost: list[str], deadline_s: float, say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """KubeRay makes a lost slice's replica again by itself, once GKE has its node pool back: wait
        for the loss to show (the node NotReady, the pods ended or deleted: within the kubelet's
        shutdown grace, `SETTLE_S` at most), then for the replica to be whole on ready nodes, bounded
        by `deadline_s`. The cluster's slices at their new addresses."""
        end = time.monotonic() + deadline_s
        hosts = self._hosts()
        wanted = {s: self._replica(s) for s in lost}
        why: dict[str, str] = {}
        settle = min(end, time.monotonic() + SETTLE_S)
        while True:
            pods, nodes = self._facts()
            now = self._addresses(pods, lost)
            for s, r in wanted.items():
                if s not in why and r is not None:
                    w = kuberay.slice_loss(pods, nodes, self.spec.group, r)
                    if w or not kuberay.replica_whole(pods, nodes, self.spec.group, r, hosts):
                        why[s] = w or "its pods are not all ready: KubeRay makes its replica whole again"
                    elif now.get(s) and (remade := self._remade(s, now)):
                        why[s] = remade
            if len(why) == len(wanted) or time.monotonic() >= settle:
                break
            time.sleep(1.0)
        recs = []
        for s in lost:
            w = why.get(s) or "a host was lost while its pod and node stayed (its Ray node is started again)"
            say(f"slice {s}: {w}: waiting for GKE to make its node pool again and KubeRay its replica")
            recs.append(Recreation(s, "", w))
        t0 = time.monotonic()
        try:
            slices = self._wait_whole(lost, max(1.0, end - time.monotonic()), hosts)
        except RejoinFailed as e:
            for rec in recs:
                rec.join_failures.append(e.why)
            e.made = recs
            raise
        took = time.monotonic() - t0
        by = {sp.name: sp for sp in slices}
        for rec in recs:
            rec.steps["replica_whole_s"] = took
            rec.replica = by[rec.slice].provenance.get("replica") if rec.slice in by else None
        return recs, slices

    def rejoin(self, lost: list[str], deadline_s: float, say: Say) -> list[SliceSpec]:
        return self._wait_whole(lost, deadline_s, self._hosts())

    def replace_refusal(self) -> str | None:
        return None  # deleting a replica's pods makes KubeRay make it again

    def replace(self, names: list[str], why: str, deadline_s: float,
                say: Say) -> tuple[list[Recreation], list[SliceSpec]]:
        """Delete the slices' pods: KubeRay makes their replicas again (new pods, maybe new nodes)."""
        kube = self.kube()
        pods = kube.list("Pod", kuberay.selector(self.spec.name))
        recs = []
        t = time.monotonic()
        for name in names:
            r = self._replica(name)
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(kuberay.REPLICA) == str(r)
                    and (p["metadata"].get("labels") or {}).get(kuberay.GROUP) == self.spec.group]
            say(f"slice {name}: {why}: deleting its {len(mine)} pod(s); KubeRay makes its replica again")
            for p in mine:
                kube.delete("Pod", p["metadata"]["name"])
            recs.append(Recreation(name, "", why))
        slices = self._wait_whole(names, deadline_s, self._hosts())
        by = {sp.name: sp for sp in slices}
        for rec in recs:
            rec.steps["replica_whole_s"] = time.monotonic() - t
            rec.replica = by[rec.slice].provenance.get("replica") if rec.slice in by else None
        return recs, slices

    def preempted_again(self, lost: list[str]) -> bool:
        """A pod of a lost slice ended by a node shutdown again (not: its replica is still coming back)."""
        pods, _nodes = self._facts()
        return any(kuberay.slice_loss([p for p in pods if (p.get("status") or {}).get("phase") == "Failed"], {},
                                      self.spec.group, r) for r in (self._replica(s) for s in lost) if r is not None)

    def _wait_whole(self, lost: list[str], deadline_s: float, hosts: int) -> list[SliceSpec]:
        end = time.monotonic() + deadline_s
        wanted = sorted(r for r in (self._replica(s) for s in lost) if r is not None)
        while True:
            pods, nodes = self._facts()
            if all(kuberay.replica_whole(pods, nodes, self.spec.group, r, hosts) for r in wanted):
                break
            if time.monotonic() >= end:  # with what GKE's autoscaler said of them (a stockout, a pool at its max)
                prog = kuberay.slice_progress(pods, self.spec.group, max(wanted, default=0) + 1, hosts,
                                              kuberay.autoscaler_said(self.kube(), pods, self.spec.group))
                raise RejoinFailed("not whole again within the wait ("
                                   + "; ".join(prog[r].line() for r in wanted) + ")")
            time.sleep(1.0)
        _hosts, acc, topo = self._shape()
        n = max(len(self.info.slices), max(wanted, default=0) + 1)
        fresh = kuberay.slices_from_pods(pods, self.spec.group, acc, topo, n)
        self.info.slices = fresh
        return fresh
