"""A RayCluster on GKE through the Kubernetes API: create what `kuberay_manifest` describes, read its
pods as slices, wait for them, say what happened to a lost one, and delete what tpulaunch made.

KubeRay makes each replica of the TPU worker group one slice: `numOfHosts` pods labelled
`ray.io/worker-group-replica-index` (the slice's place: the webhook's `TPU_NAME` is
`<group>-<index>`) and `ray.io/replica-host-index` (the host's worker id). A pod's address is its
IP; the slice's hosts are its pods in worker-id order. The rules over pod JSON are pure
(`slices_from_pods`, `slice_loss`, `slice_progress`); the rest are a few API calls each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpulaunch.cluster import kuberay_manifest as manifest
from tpulaunch.errors import ClusterError, DiscoveryError
from tpulaunch.plan import gke
from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint

if TYPE_CHECKING:
    from tpulaunch.kube import Kube

GROUP = "ray.io/group"
REPLICA = "ray.io/worker-group-replica-index"
REPLICA_NAME = "ray.io/worker-group-replica-name"
HOST = "ray.io/replica-host-index"
NODE_TYPE = "ray.io/node-type"
# Why a pod ended, in the kubelet's and the eviction API's words: its node went (preempted, repaired).
NODE_GONE_REASONS = ("Terminated", "NodeShutdown", "Shutdown", "Preempting", "NodeLost", "Evicted", "DeletionByPodGC")


def selector(name: str, *, head: bool | None = None) -> str:
    s = f"ray.io/cluster={name}"
    return s + (f",{NODE_TYPE}={'head' if head else 'worker'}" if head is not None else "")


def _ready(pod: dict) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def _deleting(pod: dict) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


@dataclass(frozen=True)
class SliceProgress:
    """One slice's pods: how many exist, run, are ready (what `cluster up` shows per slice)."""

    name: str
    hosts: int
    pods: int
    running: int
    ready: int
    autoscaler: AutoscalerWord | None = None  # the cluster autoscaler's last word on its unscheduled pods

    @property
    def whole(self) -> bool:
        return self.ready == self.hosts == self.pods

    def line(self) -> str:
        if self.whole:
            return f"{self.name}: {self.hosts}/{self.hosts} ready"
        waiting = self.pods - self.running
        return (f"{self.name}: {self.ready}/{self.hosts} ready" + (f", {waiting} pending" if waiting else "")
                + (f" ({self.autoscaler.short()})" if self.autoscaler else ""))


# -- the cluster autoscaler's word on pods no node can take yet ---------------------------------
#
# Node pools that autoscale from zero, and node auto-provisioning, have no Node until a pod asks: the
# cluster autoscaler answers an unschedulable pod with an event on it (source `cluster-autoscaler`,
# kubernetes/autoscaler's EventingScaleUpStatusProcessor): `TriggeredScaleUp` ("pod triggered
# scale-up: [{<instance group URL> 0->2 (max: 2)}]"), `NotTriggerScaleUp` ("pod didn't trigger
# scale-up: 3 node(s) didn't match Pod's node affinity/selector, 1 max node group size reached"), or
# `FailedScaleUp` ("Node scale up in zones us-east5-a associated with this pod failed: GCE out of
# resources. Pod is at risk of not being scheduled.").

AUTOSCALER = "cluster-autoscaler"
SCALE_UP_REASONS = ("TriggeredScaleUp", "NotTriggerScaleUp", "FailedScaleUp")
# What a decline gives as a node group's reason when no node of that group could ever take the pod
# (the node's labels, taints and size against the pod's). Any other reason (a group at its max
# size, a backoff after a failed scale-up, a quota, other pods' (anti-)affinity or ports) is
# capacity or company that may change: the wait goes on.
_NEVER = ("didn't match Pod's node affinity/selector", "had untolerated taint", "Insufficient ",
          "volume node affinity conflict", "wouldn't fit if a new node is added")


@dataclass(frozen=True)
class AutoscalerWord:
    """The cluster autoscaler's latest event on a pod (see above)."""

    reason: str
    message: str
    pod: str
    triggered: bool = False  # some pod of the slice had the autoscaler scale up for it

    @property
    def never(self) -> bool:
        """A decline saying no autoscaled node group can ever take the pod (and none scaled up for its
        slice). No reason at all is not one: the groups node auto-provisioning would make are left
        out of the message (kubernetes/autoscaler counts only groups that exist)."""
        if self.reason != "NotTriggerScaleUp" or self.triggered:
            return False
        reasons = [r.strip() for r in self.message.partition(":")[2].split(",") if r.strip()]
        return bool(reasons) and all(any(n in r for n in _NEVER) for r in reasons)

    def short(self) -> str:
        """The word for a progress line: the instance groups' URLs by their names."""
        import re

        text = re.sub(r"https?://\S*/", "", self.message).replace("} {", "; ").replace("[{", "").replace("}]", "")
        return f"autoscaler: {text[:200]}"


def _event_time(ev: dict) -> tuple[float, int]:
    """When an event last happened (its times are RFC 3339, seconds or microseconds), then its count."""
    from datetime import datetime

    raw = str(ev.get("lastTimestamp") or ev.get("eventTime") or ev.get("firstTimestamp")
              or (ev.get("metadata") or {}).get("creationTimestamp") or "")
    try:
        at = datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        at = 0.0
    return at, int(ev.get("count") or 1)


def autoscaler_words(events: list[dict], pods: dict[str, str]) -> dict[str, AutoscalerWord]:
    """Per slice, the cluster autoscaler's latest event on its pods: `pods` maps a pod's name to its
    slice; `events` are the namespace's Pod events (the API's JSON). Pure."""
    mine = [ev for ev in events
            if AUTOSCALER in (((ev.get("source") or {}).get("component") or ""), ev.get("reportingComponent") or "")
            and ev.get("reason") in SCALE_UP_REASONS
            and (ev.get("involvedObject") or {}).get("name") in pods]
    mine.sort(key=_event_time)
    out: dict[str, AutoscalerWord] = {}
    triggered: set[str] = set()
    for ev in mine:
        pod = ev["involvedObject"]["name"]
        sl = pods[pod]
        if ev["reason"] == "TriggeredScaleUp":
            triggered.add(sl)
        out[sl] = AutoscalerWord(ev["reason"], str(ev.get("message") or "").strip(), pod)
    return {sl: AutoscalerWord(w.reason, w.message, w.pod, sl in triggered) for sl, w in out.items()}


def slice_progress(pods: list[dict], group: str, num_slices: int, hosts: int,
                   words: dict[str, AutoscalerWord] | None = None) -> list[SliceProgress]:
    """Per slice (replica 0..num_slices-1): its pods, running and ready, and the autoscaler's word on
    them while one is unscheduled (`words`, by slice name). Pure."""
    out = []
    for r in range(num_slices):
        mine = [p for p in pods if _in(p, group, r) and not _deleting(p)]
        name = f"{group}-{r}"
        word = (words or {}).get(name) if any(_unscheduled(p) for p in mine) else None
        out.append(SliceProgress(name, hosts, len(mine),
                                 sum(1 for p in mine if (p.get("status") or {}).get("phase") == "Running"),
                                 sum(1 for p in mine if _ready(p)), word))
    return out


def _unscheduled(pod: dict) -> bool:
    return not (pod.get("spec") or {}).get("nodeName") and not _deleting(pod)


def _slice_of_pods(pods: list[dict], group: str) -> dict[str, str]:
    """Unscheduled pods of `group` -> their slice's name (what the autoscaler's events are read for)."""
    out = {}
    for p in pods:
        labels = (p.get("metadata") or {}).get("labels") or {}
        if labels.get(GROUP) == group and labels.get(REPLICA, "").isdigit() and _unscheduled(p):
            out[p["metadata"]["name"]] = f"{group}-{labels[REPLICA]}"
    return out


def _in(pod: dict, group: str, replica: int) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(GROUP) == group and labels.get(REPLICA) == str(replica)


def slices_from_pods(pods: list[dict], group: str, accelerator_type: str, topology: str,
                     num_slices: int) -> list[SliceSpec]:
    """The cluster's slices as its pods place them (pods' IPs in worker-id order; a slice whose pods
    are not all running lists those that are). Pure."""
    out = []
    for r in range(num_slices):
        mine = sorted((p for p in pods if _in(p, group, r) and not _deleting(p)
                       and (p.get("status") or {}).get("podIP")),
                      key=lambda p: int(p["metadata"]["labels"].get(HOST, "0")))
        workers = tuple(WorkerEndpoint(int(p["metadata"]["labels"].get(HOST, "0")), p["status"]["podIP"],
                                       hostname=(p.get("spec") or {}).get("hostname") or p["metadata"]["name"])
                        for p in mine)
        replica = mine[0]["metadata"]["labels"].get(REPLICA_NAME, "") if mine else ""
        out.append(SliceSpec(name=f"{group}-{r}", accelerator_type=accelerator_type, topology=topology, source="gke",
                             state="READY", workers=workers, slice_index=r, provenance={"replica": replica}))
    return out


def _node_down(node: dict | None) -> str | None:
    """Why a node cannot keep its pods (None: it is Ready): gone, shutting down, being terminated."""
    if node is None:
        return "is gone"
    ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return f"is NotReady ({(ready or {}).get('message') or (ready or {}).get('reason') or 'no status'})"
    taints = (node.get("spec") or {}).get("taints") or []
    if any(t.get("key") == "cloud.google.com/impending-node-termination" for t in taints):
        return "is being terminated (impending-node-termination)"
    return None


def slice_loss(pods: list[dict], nodes: dict[str, dict], group: str, replica: int) -> str | None:
    """Why the slice's hosts are going or went with their nodes (a spot preemption, a repair), from
    its pods and their nodes; None when nothing of the kind shows (a host whose script failed while
    its pod and node are fine). Pure.

    The kubelet's graceful shutdown first makes the node NotReady, then ends its pods `Failed` with
    a `DisruptionTarget` condition (reason Terminated); KubeRay then deletes the whole replica and
    makes it again: a node down, a pod so ended, or pods of the replica being deleted all say it."""
    mine = [p for p in pods if _in(p, group, replica)]
    for p in mine:
        st = p.get("status") or {}
        disrupted = next((c for c in st.get("conditions") or [] if c.get("type") == "DisruptionTarget"
                          and c.get("status") == "True"), None)
        if st.get("phase") == "Failed" and (disrupted or st.get("reason") in NODE_GONE_REASONS):
            why = (disrupted or {}).get("reason") or st.get("reason")
            node = (p.get("spec") or {}).get("nodeName") or "?"
            return f"pod {p['metadata']['name']} on node {node} ended: {why} ({st.get('message') or 'node shut down'})"
    for p in mine:
        node = (p.get("spec") or {}).get("nodeName")
        down = _node_down(nodes.get(node)) if node else None
        if down and not _deleting(p) and (p.get("status") or {}).get("phase") in ("Running", "Pending"):
            return f"node {node} of pod {p['metadata']['name']} {down}"
    if any(_deleting(p) for p in mine):
        return "KubeRay is deleting its replica (a host of it went): it makes the replica again"
    return None


def replica_whole(pods: list[dict], nodes: dict[str, dict], group: str, replica: int, hosts: int) -> bool:
    """Every host of the replica is a ready pod on a ready node, none going. Pure."""
    mine = [p for p in pods if _in(p, group, replica)]
    return (len(mine) == hosts and all(_ready(p) and not _deleting(p) for p in mine)
            and all(_node_down(nodes.get((p.get("spec") or {}).get("nodeName", ""))) is None for p in mine))


def head_pod(kube: Kube, name: str) -> dict | None:
    pods = [p for p in kube.list("Pod", selector(name, head=True)) if not _deleting(p)]
    return pods[0] if pods else None


def create_all(kube: Kube, objects: list[dict]) -> list[str]:
    """Create `objects` in order; on a failure delete those created first (nothing left behind) and
    raise. Returns their "Kind/name"."""
    made: list[str] = []
    try:
        for obj in objects:
            kube.create(obj)
            made.append(f"{obj['kind']}/{obj['metadata']['name']}")
    except BaseException:
        delete_all(kube, made)
        raise
    return made


def delete_all(kube: Kube, objects: list[str] | tuple[str, ...]) -> list[str]:
    """Delete these objects, the RayCluster first (its pods go with it); those that were there."""
    gone = []
    order = sorted(objects, key=lambda o: o.split("/")[0] != "RayCluster")
    for o in order:
        kind, _, name = o.partition("/")
        if kube.delete(kind, name):
            gone.append(o)
    return gone


def wait_pods(kube: Kube, name: str, group: str, num_slices: int, hosts: int, timeout_s: float,
              say: Callable[[list[SliceProgress], bool], None], stopped: Callable[[], bool] = lambda: False,
              poll_s: float = 1.0, declines: Declines | None = None) -> list[dict]:
    """Until the head and every host of every slice run and are ready: the pods. ClusterError when
    `timeout_s` passes (saying which slices wait, and why their pods do, the cluster autoscaler's word
    among it); DiscoveryError when its "never" has stood (`declines`)."""
    end = time.monotonic() + timeout_s
    last = None
    while True:
        pods = kube.list("Pod", selector(name))
        check_webhook(pods, group)
        head = [p for p in pods if (p["metadata"].get("labels") or {}).get(NODE_TYPE) == "head" and not _deleting(p)]
        words = autoscaler_said(kube, pods, group)
        if declines is not None:
            declines.check(words, time.monotonic())
        progress = slice_progress(pods, group, num_slices, hosts, words)
        head_ready = bool(head) and _ready(head[0])
        state = (head_ready, [(s.pods, s.running, s.ready, s.autoscaler) for s in progress])
        if state != last:
            say(progress, head_ready)
            last = state
        if head_ready and all(s.whole for s in progress):
            return pods
        if stopped():
            raise ClusterError("stopped while waiting for the cluster's pods", "")
        if time.monotonic() >= end:
            waiting = [s.line() for s in progress if not s.whole]
            why = _pending_reason(pods)
            raise ClusterError(f"the cluster's pods were not all ready within {timeout_s:g} s: "
                               + "; ".join((["head: not ready"] if not head_ready else []) + waiting)
                               + (f" ({why})" if why else ""),
                               "check the node pools (`tpulaunch slice list --gke`) and the pods' events"
                               " (`kubectl describe pod`); raise --timeout for capacity that comes later")
        time.sleep(poll_s)


def autoscaler_said(kube: Kube, pods: list[dict], group: str) -> dict[str, AutoscalerWord]:
    """The cluster autoscaler's word on `group`'s unscheduled pods, by slice: the namespace's Pod events
    from `source=cluster-autoscaler` (the component its event recorder names); none when RBAC keeps
    events from this user (what is waited for is waited for without them)."""
    from tpulaunch.kube import KubeForbidden

    waiting = _slice_of_pods(pods, group)
    if not waiting:
        return {}
    try:
        return autoscaler_words(kube.list("Event", fields=f"involvedObject.kind=Pod,source={AUTOSCALER}"), waiting)
    except KubeForbidden:
        return {}


@dataclass
class Declines:
    """When a bring-up ends on the cluster autoscaler's word, not at its --timeout. Only where every
    slice hangs on it (`--autoscaler` with no pool of the shape in sight: a pool that is there may
    just be busy, and the autoscaler speaks only of pools that autoscale), and only once its "no
    node could ever take them" has stood `grace_s` with no scale-up for that slice: it posts one
    event a pod and reason in 5 minutes (its event recorder's spam filter), so a later, different
    answer may not show before then. Pure: `now` is given."""

    grace_s: float
    since: dict[str, float] = field(default_factory=dict)  # slice -> when its decline was first seen here

    def check(self, words: dict[str, AutoscalerWord], now: float) -> None:
        for name in [n for n in self.since if not (n in words and words[n].never)]:
            del self.since[name]  # scaled up, placed, or told something else: the clock starts again
        for name, word in sorted(words.items()):
            if word.never and now - self.since.setdefault(name, now) >= self.grace_s:
                raise DiscoveryError(
                    f"no node can ever take {name}'s pods, says GKE's cluster autoscaler, for {self.grace_s:g} s"
                    f" ({word.pod}: {word.message[:300]})",
                    "create a node pool of that shape that autoscales (a spot one for --spot), or ask for a"
                    " shape there is")


def unmutated(pods: list[dict], group: str) -> str | None:
    """A pod of the TPU worker group whose TPU container has no TPU_NAME, the variable the KubeRay TPU
    webhook always sets (and Ray makes the slice label of): its name, or None. Pure."""
    for p in pods:
        labels = p["metadata"].get("labels") or {}
        if labels.get(NODE_TYPE) != "worker" or labels.get(GROUP) != group:
            continue
        for c in (p.get("spec") or {}).get("containers") or []:
            tpu = gke.TPU_RESOURCE in ((c.get("resources") or {}).get("limits") or {})
            if tpu and not any(e.get("name") == "TPU_NAME" for e in c.get("env") or []):
                return str(p["metadata"]["name"])
    return None


def check_webhook(pods: list[dict], group: str) -> None:
    """ClusterError, at once, when the TPU webhook did not mutate the group's pods: their hosts would
    join Ray with no slice, and the bring-up would wait its whole --timeout for them."""
    bare = unmutated(pods, group)
    if bare is not None:
        raise ClusterError(
            f"pod {bare} has no TPU_NAME: the KubeRay TPU webhook is not installed in this cluster (Ray gives"
            " its TPU hosts no slice without it)",
            "enable GKE's Ray Operator add-on (`gcloud container clusters update CLUSTER --update-addons"
            "=RayOperator=ENABLED`), or install it: `helm install kuberay-tpu-webhook"
            " oci://us-docker.pkg.dev/ai-on-gke/kuberay-tpu-webhook-helm/kuberay-tpu-webhook`")


def wait_head(kube: Kube, name: str, timeout_s: float, say: Callable[[str], None],
              poll_s: float = 1.0, group: str | None = None, declines: Declines | None = None) -> dict:
    """Until the head pod runs and is ready: the pod. ClusterError after `timeout_s` (saying why it
    waits), or as soon as `group`'s pods show the TPU webhook missing (`check_webhook`), or the cluster
    autoscaler's "never" for them has stood (`declines`). What the autoscaler says of them is said."""
    end = time.monotonic() + timeout_s
    said = False
    shown: dict[str, str] = {}
    while True:
        every = [p for p in kube.list("Pod", selector(name)) if not _deleting(p)]
        if group is not None:  # what the group's pods show already ends the wait for the head
            check_webhook(every, group)
            words = autoscaler_said(kube, every, group)
            if declines is not None:
                declines.check(words, time.monotonic())
            for sl, word in sorted(words.items()):
                if shown.get(sl) != word.message:  # GKE making TPU nodes while the head starts: said as it goes
                    say(f"{sl}: {word.short()}")
                    shown[sl] = word.message
        pods = [p for p in every if (p["metadata"].get("labels") or {}).get(NODE_TYPE) == "head"]
        if pods and _ready(pods[0]):
            return pods[0]
        if not said:
            say("waiting for the head pod")
            said = True
        if time.monotonic() >= end:
            why = _pending_reason(pods)
            raise ClusterError(f"the head pod of {name} was not ready within {timeout_s:g} s"
                               + (f" ({why})" if why else ""),
                               "is there a CPU node pool for it? (`kubectl describe pod -l ray.io/node-type=head`)")
        time.sleep(poll_s)


def _pending_reason(pods: list[dict]) -> str:
    for p in pods:
        st = p.get("status") or {}
        for c in st.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
                return f"{p['metadata']['name']}: {c['message'][:160]}"
    return ""


def check_name(name: str) -> None:
    """A RayCluster name KubeRay takes: a DNS-1035 label of at most 53 characters (its pods' names
    add to it). One line, exit 2, otherwise."""
    import re

    from tpulaunch.errors import TpulaunchError

    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,51}[a-z0-9])?", name):
        raise TpulaunchError(f"--name {name[:60]!r} is not a RayCluster name",
                             "use lower-case letters, digits and dashes, a letter first, at most 53")


__all__ = ["AutoscalerWord", "Declines", "SliceProgress", "autoscaler_said", "autoscaler_words",
           "check_name", "create_all", "delete_all", "head_pod", "manifest", "replica_whole", "selector",
           "slice_loss", "slice_progress", "slices_from_pods", "wait_pods"]
