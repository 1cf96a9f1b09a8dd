"""GKE's cluster autoscaler, for node pools that autoscale from zero: what it does to a pod no node can take.

The real one (kubernetes/autoscaler, cluster-autoscaler; GKE runs it in the control plane when a
node pool has autoscaling on) looks every 10 s at the pods the scheduler could not place, and for
each asks its node groups (one per autoscaled node pool) whether a node made from the group's
template would take the pod. Then, as its EventingScaleUpStatusProcessor reports it, an event on
the pod (source `cluster-autoscaler`):

* `TriggeredScaleUp` (Normal): "pod triggered scale-up: [{<instance group URL> 0->2 (max: 2)}]", and
  the group's nodes come. A multi-host TPU slice pool grows whole: 0 to all its hosts at once.
* `NotTriggerScaleUp` (Normal): "pod didn't trigger scale-up: " and each group's reason counted
  ("2 node(s) didn't match Pod's node affinity/selector, 1 max node group size reached", "1 in
  backoff after failed scale-up").
* `FailedScaleUp` (Warning): "Node scale up in zones <zone> associated with this pod failed: GCE out
  of resources. ..." (a stockout; the group then backs off): not modelled (tpulaunch shows it and
  waits, a rule its unit tests hold).

A pod that fits a node that is there, or a group already growing, gets no event (the scheduler's,
or the coming nodes', to place); a loop that scaled up posts no declines. Its event recorder's spam
filter is kept: one event a pod and reason in 5 minutes, whatever the message (so a first answer
stands that long); the same event after that bumps `count` and `lastTimestamp`. Node
auto-provisioning is not modelled (the real one leaves the groups it would make out of a decline's
reasons). Pools with autoscaling are `NodePool(autoscaled=True)`: no nodes until asked, at most
their slice's hosts; the pods a growing pool's nodes are for are counted (one TPU pod a
host, another slice's pods kept off by their anti-affinity) as the real one bin-packs them.
Scale-down (10 minutes unneeded) is not modelled: no test lives that long.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable

from . import NodePool, node_names, node_object
from .kubelet import _matches, _terminal, fits
from .tpu import TPU

SCALE_UP_S = 2.0  # from the event to the nodes Ready (minutes on GKE; the order of things is what matters here)
SPAM_S = 300.0  # its recorder's spam filter: one event a pod and reason in 5 minutes (utils/kubernetes/factory.go)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def why_not(pod: dict, node: dict) -> str:
    """The scheduler's words for why `node` cannot take `pod` (the reason a decline counts)."""
    spec = pod["spec"]
    labels = node["metadata"].get("labels") or {}
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()) or (
            terms and not any(_matches(labels, {"matchExpressions": t.get("matchExpressions") or []}) for t in terms)):
        return "node(s) didn't match Pod's node affinity/selector"
    for t in (node.get("spec") or {}).get("taints") or []:
        if not any(tol.get("key") in (None, "", t["key"]) for tol in spec.get("tolerations") or []):
            return f"node(s) had untolerated taint {{{t['key']}: {t.get('value', '')}}}"
    want = sum(float(((c.get("resources") or {}).get("requests") or (c.get("resources") or {}).get("limits") or {})
                     .get(TPU, 0)) for c in spec.get("containers") or [])
    if want > float(((node.get("status") or {}).get("allocatable") or {}).get(TPU, 0)):
        return f"Insufficient {TPU}"
    return "node(s) didn't match pod anti-affinity rules"  # (tpulaunch's pods: another slice's are there)


class ClusterAutoscaler:
    """The autoscaler over `store`'s unschedulable pods, for `pools` (those `autoscaled`)."""

    def __init__(self, store, pools: list[NodePool], *, cluster: str = "fake", address: str = "10.0.0.1",  # noqa: ANN001
                 make_nodes: Callable[[NodePool], None] | None = None, scan_s: float = 1.0,
                 scale_up_s: float = SCALE_UP_S) -> None:
        self.store = store
        self.pools = [p for p in pools if p.autoscaled]
        self.cluster = cluster
        self.address = address
        self.make_nodes = make_nodes or self._make_nodes
        self.scan_s = scan_s
        self.scale_up_s = scale_up_s
        self.growing: dict[str, list[dict]] = {}  # pool -> the pods its coming nodes are for
        self.errors: list[str] = []
        self._events: dict[tuple[str, str], tuple[str, str, float]] = {}  # (pod uid, reason) -> its last post
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> ClusterAutoscaler:
        t = threading.Thread(target=self._loop, name="fake-cluster-autoscaler", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.scan_s):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - the fake's own bug: kept for the test to show
                import traceback

                self.errors.append(traceback.format_exc())

    def _make_nodes(self, pool: NodePool) -> None:
        for name in node_names(self.cluster, pool):
            self.store.create("nodes", node_object(pool, name, self.address))

    def _present(self, pool: NodePool, nodes: dict[str, dict]) -> int:
        return sum(1 for n in nodes.values() if (n["metadata"].get("labels") or {}).get(
            "cloud.google.com/gke-nodepool") == pool.name)

    def scan(self) -> None:
        """One pass over the unschedulable pods (the real one's loop body)."""
        pods = self.store.list("pods", None)[0]
        nodes = {n["metadata"]["name"]: n for n in self.store.list("nodes", None)[0]}
        pods_on: dict[str, list[dict]] = {}
        for p in pods:
            if p["spec"].get("nodeName") and not _terminal(p):
                pods_on.setdefault(p["spec"]["nodeName"], []).append(p)
        declined: list[tuple[dict, str]] = []
        scaled = False
        for pod in pods:
            if pod["spec"].get("nodeName") or _terminal(pod) or pod["metadata"].get("deletionTimestamp"):
                continue
            if any(fits(pod, n, pods_on, pods, nodes) for n in nodes.values()):
                continue  # the scheduler's to place
            reasons: Counter[str] = Counter()
            chosen = None
            for pool in self.pools:  # in the real one's order: a group at its max is out before any simulation
                template = node_object(pool, f"template-{pool.name}", self.address)
                if pool.name in self.growing and fits(pod, template, {}, pods, nodes):
                    if self._claim(pool, pod):
                        chosen = "coming"  # it lands on the nodes being made: no event
                        break
                    reasons["max node group size reached"] += 1
                elif self._present(pool, nodes) >= pool.count or pool.name in self.growing:
                    reasons["max node group size reached"] += 1
                elif not fits(pod, template, {}, pods, nodes):
                    reasons[why_not(pod, template)] += 1
                else:
                    chosen = pool
                    break
            if chosen == "coming":
                continue
            if chosen is None:
                why = ", ".join(f"{n} {r}" for r, n in reasons.items())
                declined.append((pod, f"pod didn't trigger scale-up: {why}"))
            else:
                scaled = True
                self._event(pod, "TriggeredScaleUp", "pod triggered scale-up: [{https://www.googleapis.com/compute/v1/"
                            f"projects/fake-project/zones/{chosen.zone}/instanceGroups/gke-{self.cluster}-{chosen.name}"
                            f"-grp {self._present(chosen, nodes)}->{chosen.count} (max: {chosen.count})}}]")
                self._grow(chosen, pod)
        if not scaled:  # a loop that scaled up posts no declines (the pods wait for its next look)
            for pod, message in declined:
                self._event(pod, "NotTriggerScaleUp", message)

    def _claim(self, pool: NodePool, pod: dict) -> bool:
        """Whether `pod` goes on the nodes `pool` is growing (room left, and none of the pods they are
        for repels it: another slice's pods keep off a slice's pool): it is counted there if so."""
        claimed = self.growing[pool.name]
        if any(c["metadata"]["uid"] == pod["metadata"]["uid"] for c in claimed):
            return True
        terms = ((pod["spec"].get("affinity") or {}).get("podAntiAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or []
        if len(claimed) >= pool.count or any(_matches(c["metadata"].get("labels") or {}, t["labelSelector"])
                                             for c in claimed for t in terms):
            return False
        claimed.append(pod)
        return True

    def _grow(self, pool: NodePool, pod: dict) -> None:
        self.growing[pool.name] = [pod]

        def made() -> None:
            if self._stop.wait(self.scale_up_s):
                return
            try:
                self.make_nodes(pool)
            finally:
                self.growing.pop(pool.name, None)

        t = threading.Thread(target=made, name=f"fake-scale-up-{pool.name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _event(self, pod: dict, reason: str, message: str) -> None:
        """Post it as its event recorder does: one a pod and reason in `SPAM_S` (the spam filter's key
        leaves the message out: what comes meanwhile is dropped); the same message again after that
        bumps the event's count, another is a new event."""
        m = pod["metadata"]
        last = self._events.get((m["uid"], reason))
        if last is not None and time.monotonic() - last[2] < SPAM_S:
            return
        ev = self.store.get("events", m["namespace"], last[0]) if last is not None and last[1] == message else None
        if last is not None and ev is not None:
            self.store.patch("events", m["namespace"], last[0], {"count": ev.get("count", 1) + 1,
                                                                 "lastTimestamp": _now()})
            self._events[(m["uid"], reason)] = (last[0], message, time.monotonic())
            return
        name = f"{m['name']}.{secrets.token_hex(8)}"
        self._events[(m["uid"], reason)] = (name, message, time.monotonic())
        now = _now()
        self.store.create("events", {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": m["namespace"]},
            "involvedObject": {"kind": "Pod", "namespace": m["namespace"], "name": m["name"], "uid": m["uid"],
                               "apiVersion": "v1"},
            "reason": reason, "message": message, "type": "Normal", "source": {"component": "cluster-autoscaler"},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1, "reportingComponent": "cluster-autoscaler",
        })
