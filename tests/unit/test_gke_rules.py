"""GKE's TPU facts and the rules tpulaunch reads them with: pure, over the API's JSON.

The golden rows are `../shared/notes/gke.md`'s ("Golden facts for tests"), from xpk, GKE's TPU
device plugin, the tpu-provisioner and KubeRay's samples: a v5e/v6e `2x4` is one 8-chip VM or two
4-chip VMs, decided by the nodes' chips.
"""

from __future__ import annotations

import pytest

from tpulaunch.cluster import kuberay
from tpulaunch.discover import gke as discover_gke
from tpulaunch.errors import TopologyError
from tpulaunch.plan import gke

# (generation, topology, chips per VM, machine type, hosts, TPU_ACCELERATOR_TYPE, host bounds, chips-per-host bounds)
GOLDEN = [
    ("v4", "2x2x1", 4, "ct4p-hightpu-4t", 1, "v4-8", "1,1,1", "2,2,1"),
    ("v4", "2x2x2", 4, "ct4p-hightpu-4t", 2, "v4-16", "1,1,2", "2,2,1"),
    ("v4", "2x2x4", 4, "ct4p-hightpu-4t", 4, "v4-32", "1,1,4", "2,2,1"),
    ("v5e", "2x2", 4, "ct5lp-hightpu-4t", 1, "v5litepod-4", "1,1,1", "2,2,1"),
    ("v5e", "2x4", 8, "ct5lp-hightpu-8t", 1, "v5litepod-8", "1,1,1", "2,4,1"),
    ("v5e", "2x4", 4, "ct5lp-hightpu-4t", 2, "v5litepod-8", "1,2,1", "2,2,1"),
    ("v5e", "4x4", 4, "ct5lp-hightpu-4t", 4, "v5litepod-16", "2,2,1", "2,2,1"),
    ("v5e", "16x16", 4, "ct5lp-hightpu-4t", 64, "v5litepod-256", "8,8,1", "2,2,1"),
    ("v5p", "2x2x1", 4, "ct5p-hightpu-4t", 1, "v5p-8", "1,1,1", "2,2,1"),
    ("v5p", "2x2x2", 4, "ct5p-hightpu-4t", 2, "v5p-16", "1,1,2", "2,2,1"),
    ("v5p", "4x4x4", 4, "ct5p-hightpu-4t", 16, "v5p-128", "2,2,4", "2,2,1"),
    ("v6e", "2x2", 4, "ct6e-standard-4t", 1, "v6e-4", "1,1,1", "2,2,1"),
    ("v6e", "2x4", 8, "ct6e-standard-8t", 1, "v6e-8", "1,1,1", "2,4,1"),
    ("v6e", "2x4", 4, "ct6e-standard-4t", 2, "v6e-8", "1,2,1", "2,2,1"),
    ("v6e", "4x4", 4, "ct6e-standard-4t", 4, "v6e-16", "2,2,1", "2,2,1"),
    ("v6e", "16x16", 4, "ct6e-standard-4t", 64, "v6e-256", "8,8,1", "2,2,1"),
    ("v6e", "1x1", 1, "ct6e-standard-1t", 1, "v6e-1", "1,1,1", "1,1,1"),
    ("v5e", "1x1", 1, "ct5lp-hightpu-1t", 1, "v5litepod-1", "1,1,1", "1,1,1"),
    ("tpu7x", "2x2x1", 4, "tpu7x-standard-4t", 1, "tpu7x-8", "1,1,1", "2,2,1"),
    ("tpu7x", "2x2x2", 4, "tpu7x-standard-4t", 2, "tpu7x-16", "1,1,2", "2,2,1"),
    ("tpu7x", "4x4x4", 4, "tpu7x-standard-4t", 16, "tpu7x-128", "2,2,4", "2,2,1"),
]


@pytest.mark.parametrize("gen,topo,chips,machine,hosts,acc,host_bounds,chip_bounds", GOLDEN)
def test_a_gke_slice_shape_is_the_one_google_documents(gen, topo, chips, machine, hosts, acc, host_bounds, chip_bounds):
    s = gke.shape(gen, topo, chips)
    t = s.topology
    assert (s.machine_type, s.hosts, t.accelerator_type) == (machine, hosts, acc)
    assert (t.bounds_str(t.host_bounds), t.bounds_str(t.chips_per_host_bounds)) == (host_bounds, chip_bounds)
    assert s.needs_workload_policy == (gen == "tpu7x" and hosts > 1)
    assert gke.hosts_of(topo, chips) == hosts


def test_a_2x4_with_no_chips_given_is_gkes_default_one_vm():
    assert gke.shape("v6e", "2x4").hosts == 1 and gke.shape("v5e", "2x4").machine_type == "ct5lp-hightpu-8t"


@pytest.mark.parametrize("gen,topo,chips,why", [
    ("v5p", "2x2x2", 8, "no GKE machine type of v5p has 8 chips"),
    ("v6e", "2x2", 8, "cannot be made of 8-chip VMs"),
    ("v3", "4x4", 4, "not offered on GKE"),
    ("v5p", "3x3x3", 4, "3x3x3"),
])
def test_a_shape_gke_has_no_node_pool_for_is_one_line(gen, topo, chips, why):
    with pytest.raises(TopologyError, match=why):
        gke.shape(gen, topo, chips)


def test_every_accelerator_label_names_its_generation():
    assert {g.label: g.generation for g in gke.GKE_GENERATIONS} == {
        "tpu-v4-podslice": "v4", "tpu-v5-lite-podslice": "v5e", "tpu-v5p-slice": "v5p", "tpu-v6e-slice": "v6e",
        "tpu7x": "v7x"}
    assert gke.generation_of_label("tpu-v5-lite-device").generation == "v5e"  # older GKE's label, still read
    assert gke.generation_of_label("nvidia-l4") is None


# -- node pools as slices --------------------------------------------------------------------------


def node(name: str, pool: str, label: str | None, topology: str | None, chips: int, *, ready: bool = True,
         spot: bool = False, maintenance: str | None = None, policy: str | None = None) -> dict:
    labels = {gke.NODEPOOL_LABEL: pool, gke.INSTANCE_TYPE_LABEL: f"m-{chips}t", gke.ZONE_LABEL: "us-east5-a"}
    if label:
        labels[gke.ACCELERATOR_LABEL] = label
        labels[gke.CHIPS_LABEL] = str(chips)
    if topology:
        labels[gke.TOPOLOGY_LABEL] = topology
    if spot:
        labels[gke.SPOT_LABEL] = "true"
    if maintenance:
        labels[gke.MAINTENANCE_LABEL] = maintenance
    if policy:
        labels[gke.PLACEMENT_POLICY_LABEL] = policy
    return {"metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {gke.TPU_RESOURCE: str(chips)} if label else {},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "addresses": [{"type": "InternalIP", "address": f"10.0.0.{len(name)}"}]}}


def test_node_pools_become_slices_with_their_hosts_settled_by_the_nodes_chips():
    nodes = [
        node("a1", "v6e-8t", "tpu-v6e-slice", "2x4", 8),  # one VM
        node("b1", "v6e-4t", "tpu-v6e-slice", "2x4", 4), node("b2", "v6e-4t", "tpu-v6e-slice", "2x4", 4),  # two VMs
        node("c1", "v5p", "tpu-v5p-slice", "2x2x2", 4, spot=True, maintenance="1893456000"),
        node("c2", "v5p", "tpu-v5p-slice", "2x2x2", 4, spot=True, maintenance="1893452400"),
        node("d1", "short", "tpu-v4-podslice", "2x2x4", 4), node("d2", "short", "tpu-v4-podslice", "2x2x4", 4, ready=False),
        node("e1", "ironwood", "tpu7x", None, 4, policy="wp-1"), node("e2", "ironwood", "tpu7x", None, 4, policy="wp-1"),
        node("cpu1", "default-pool", None, None, 0),
    ]
    pools = {p.pool: p for p in discover_gke.pools_from_nodes(nodes)}
    assert set(pools) == {"v6e-8t", "v6e-4t", "v5p", "short", "ironwood"}  # the CPU pool is no slice
    assert (pools["v6e-8t"].expected_hosts, pools["v6e-8t"].accelerator_type, pools["v6e-8t"].complete) == (1, "v6e-8", True)
    assert (pools["v6e-4t"].expected_hosts, pools["v6e-4t"].complete) == (2, True)
    v5p = pools["v5p"]
    assert v5p.spot and v5p.maintenance == 1893452400 and v5p.to_dict()["maintenance_at"] == "2029-12-31T23:00:00Z"
    short = pools["short"]
    assert (short.state, short.ready, short.expected_hosts) == ("INCOMPLETE", 1, 4)
    assert short.problems() == ["2 of 4 hosts", "1 host(s) not Ready"]
    iron = pools["ironwood"]
    assert iron.state == "UNKNOWN_TOPOLOGY" and "workload policy wp-1" in iron.problems()[0]
    spec = v5p.to_spec()
    assert (spec.source, spec.accelerator_type, spec.spot, len(spec.workers)) == ("gke", "v5p-16", True, 2)


def test_a_nodes_chips_are_not_the_zero_a_device_plugin_reports_before_it_registers():
    """GKE's device plugin reports `google.com/tpu: "0"` until it has registered the chips (and when
    every chip is unhealthy): the pool's hosts are then read from the machine's count, not 0 chips a
    node (which made the expected hosts the pool's whole chip count)."""
    fresh = node("f1", "v5p-b", "tpu-v5p-slice", "2x2x2", 4)
    fresh["status"]["allocatable"][gke.TPU_RESOURCE] = "0"  # first in name order
    other = node("f2", "v5p-b", "tpu-v5p-slice", "2x2x2", 4)
    assert [discover_gke.node_chips(n) for n in (fresh, other)] == [4, 4]
    del fresh["metadata"]["labels"][gke.CHIPS_LABEL]
    assert discover_gke.node_chips(fresh) == 0  # nothing says: unknown
    fresh["status"]["capacity"] = {gke.TPU_RESOURCE: "4"}
    assert discover_gke.node_chips(fresh) == 4
    fresh["status"]["capacity"] = {}
    (pool,) = discover_gke.pools_from_nodes([fresh, other])
    assert (pool.chips_per_node, pool.expected_hosts, pool.accelerator_type) == (4, 2, "v5p-16")


def test_the_pools_a_shape_fits_are_whole_and_of_that_shape_and_capacity_kind():
    nodes = [node("a1", "p4t", "tpu-v6e-slice", "2x4", 4), node("a2", "p4t", "tpu-v6e-slice", "2x4", 4),
             node("b1", "p8t", "tpu-v6e-slice", "2x4", 8),
             node("c1", "spot4t", "tpu-v6e-slice", "2x4", 4, spot=True), node("c2", "spot4t", "tpu-v6e-slice", "2x4", 4, spot=True)]
    pools = discover_gke.pools_from_nodes(nodes)
    two_vms = gke.shape("v6e", "2x4", 4)
    assert [p.pool for p in discover_gke.fitting(pools, two_vms, spot=False)] == ["p4t"]
    assert [p.pool for p in discover_gke.fitting(pools, two_vms, spot=True)] == ["spot4t"]
    assert [p.pool for p in discover_gke.fitting(pools, gke.shape("v6e", "2x4"), spot=False)] == ["p8t"]


def test_a_gke_pod_finds_its_slice_in_the_webhooks_variables():
    env = {"TPU_NAME": "tpu-1", "TPU_WORKER_ID": "1", "TPU_ACCELERATOR_TYPE": "v5p-16", "TPU_TOPOLOGY": "2x2x2",
           "TPU_WORKER_HOSTNAMES": "tpu-1-0.c-headless,tpu-1-1.c-headless"}
    spec, worker = discover_gke.local_slice(env)
    assert (spec.name, worker, spec.source, spec.to_topology().num_hosts) == ("tpu-1", 1, "gke", 2)
    assert [w.hostname for w in spec.workers] == ["tpu-1-0.c-headless", "tpu-1-1.c-headless"]
    assert discover_gke.local_slice({**env, "TPU_NAME": ""}) is None  # not a KubeRay TPU pod
    single = {**env, "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0", "HOSTNAME": "pod-x",
              "TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_TOPOLOGY": "2x2x1"}
    assert [w.ip for w in discover_gke.local_slice(single)[0].workers] == ["pod-x"]


# -- a RayCluster's pods ---------------------------------------------------------------------------


def pod(name: str, replica: int, host: int, *, phase: str = "Running", ready: bool = True, ip: str | None = None,
        disruption: bool = False, reason: str | None = None, node_name: str = "n1", replica_name: str = "tpu-abcde") -> dict:
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if disruption:
        conds.append({"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"})
    st = {"phase": phase, "conditions": conds, "podIP": ip or f"10.1.{replica}.{host + 2}"}
    if reason:
        st.update(reason=reason, message="Pod was terminated in response to imminent node shutdown.")
    return {"metadata": {"name": name, "labels": {"ray.io/group": "tpu", kuberay.REPLICA: str(replica),
                                                  kuberay.HOST: str(host), kuberay.REPLICA_NAME: replica_name}},
            "spec": {"nodeName": node_name, "hostname": f"tpu-{replica}-{host}"}, "status": st}


def test_a_clusters_slices_are_its_replicas_pods_in_worker_order():
    pods = [pod("b", 0, 1), pod("a", 0, 0), pod("c", 1, 0), pod("d", 1, 1, ip="10.9.9.9")]
    specs = kuberay.slices_from_pods(pods, "tpu", "v5p-16", "2x2x2", 2)
    assert [s.name for s in specs] == ["tpu-0", "tpu-1"] and [s.slice_index for s in specs] == [0, 1]
    assert [w.ip for w in specs[0].workers] == ["10.1.0.2", "10.1.0.3"]
    assert [w.ip for w in specs[1].workers] == ["10.1.1.2", "10.9.9.9"]
    assert specs[1].workers[1].hostname == "tpu-1-1"


def _node(name: str, ready: bool = True, terminating: bool = False) -> dict:
    return {"metadata": {"name": name},
            "spec": {"taints": [{"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}]
                     if terminating else []},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "message": "node is shutting down" if not ready else ""}]}}


def test_a_slice_lost_to_a_node_shutdown_says_so_and_a_failed_script_does_not():
    nodes = {"n1": _node("n1")}
    ok = [pod("a", 0, 0), pod("b", 0, 1)]
    assert kuberay.slice_loss(ok, nodes, "tpu", 0) is None
    assert kuberay.replica_whole(ok, nodes, "tpu", 0, 2) and not kuberay.replica_whole(ok, nodes, "tpu", 0, 3)
    # the first sign: the node shutting down (its pods still Running)
    going = kuberay.slice_loss(ok, {"n1": _node("n1", ready=False)}, "tpu", 0)
    assert going == "node n1 of pod a is NotReady (node is shutting down)"
    assert "impending-node-termination" in kuberay.slice_loss(ok, {"n1": _node("n1", terminating=True)}, "tpu", 0)
    assert kuberay.slice_loss(ok, {}, "tpu", 0) == "node n1 of pod a is gone"
    # then the pods ended by the kubelet
    shut = [pod("a", 0, 0, phase="Failed", ready=False, disruption=True, reason="Terminated"), pod("b", 0, 1)]
    assert kuberay.slice_loss(shut, nodes, "tpu", 0).startswith("pod a on node n1 ended: TerminationByKubelet")
    # then KubeRay deleting the replica (Terminating pods)
    deleting = [dict(pod("a", 0, 0), metadata={**pod("a", 0, 0)["metadata"], "deletionTimestamp": "2026-11-28T00:00:00Z"})]
    assert "KubeRay is deleting its replica" in kuberay.slice_loss(deleting, nodes, "tpu", 0)
    assert not kuberay.replica_whole(deleting + [pod("b", 0, 1)], nodes, "tpu", 0, 2)
    # a pod that ended Failed for its own reasons, on a fine node, is not a preemption
    own = [pod("a", 0, 0, phase="Failed", ready=False), pod("b", 0, 1)]
    assert kuberay.slice_loss(own, nodes, "tpu", 0) is None and not kuberay.replica_whole(own, nodes, "tpu", 0, 2)


def test_each_slices_progress_is_counted_from_its_pods():
    pods = [pod("a", 0, 0), pod("b", 0, 1, ready=False), pod("c", 1, 0, phase="Pending", ready=False)]
    prog = kuberay.slice_progress(pods, "tpu", 2, 2)
    assert [p.line() for p in prog] == ["tpu-0: 1/2 ready", "tpu-1: 0/2 ready, 1 pending"]
    assert not any(p.whole for p in prog)


def _event(pod_name: str, reason: str, message: str, at: str, component: str = "cluster-autoscaler") -> dict:
    return {"kind": "Event", "involvedObject": {"kind": "Pod", "name": pod_name}, "reason": reason, "message": message,
            "source": {"component": component}, "lastTimestamp": at}


# The cluster autoscaler's messages as GKE shows them (kubectl describe pod; kubernetes/autoscaler's
# EventingScaleUpStatusProcessor).
TRIGGERED = ("pod triggered scale-up: [{https://www.googleapis.com/compute/v1/projects/p/zones/us-east5-a/"
             "instanceGroups/gke-c-v5p-b-1a2b3c4d-grp 0->2 (max: 2)}]")
MISMATCH = "pod didn't trigger scale-up: 3 node(s) didn't match Pod's node affinity/selector, 1 Insufficient google.com/tpu"
FULL = "pod didn't trigger scale-up: 2 node(s) didn't match Pod's node affinity/selector, 1 max node group size reached"
BACKOFF = "pod didn't trigger scale-up: 1 in backoff after failed scale-up"
STOCKOUT = ("Node scale up in zones us-east5-a associated with this pod failed: GCE out of resources. Pod is at risk"
            " of not being scheduled.")


def test_the_cluster_autoscalers_last_word_on_a_slices_pods_says_whether_a_node_can_ever_come():
    pods = {"c-tpu-0-a": "tpu-0", "c-tpu-0-b": "tpu-0", "c-tpu-1-a": "tpu-1"}
    events = [
        _event("c-tpu-0-a", "NotTriggerScaleUp", MISMATCH, "2026-12-07T10:00:05Z"),
        _event("c-tpu-0-b", "TriggeredScaleUp", TRIGGERED, "2026-12-07T10:00:01Z"),  # earlier: the last word is the decline
        _event("c-tpu-1-a", "NotTriggerScaleUp", MISMATCH, "2026-12-07T10:00:03Z"),
        _event("c-tpu-1-a", "FailedScheduling", "0/5 nodes are available", "2026-12-07T10:00:09Z", "default-scheduler"),
        _event("other-pod", "NotTriggerScaleUp", MISMATCH, "2026-12-07T10:00:09Z"),  # not this cluster's
    ]
    words = kuberay.autoscaler_words(events, pods)
    assert sorted(words) == ["tpu-0", "tpu-1"]
    # a slice one of whose pods made the autoscaler scale up is coming, whatever its other pods were told
    assert words["tpu-0"].reason == "NotTriggerScaleUp" and words["tpu-0"].triggered and not words["tpu-0"].never
    assert words["tpu-1"].never and words["tpu-1"].pod == "c-tpu-1-a"
    # only a decline in which no node group could ever take the pod is final; the rest is capacity to wait for
    # (no reason at all: the groups node auto-provisioning would make are left out of the message)
    for message, never in [(MISMATCH, True), (FULL, False), (BACKOFF, False), ("pod didn't trigger scale-up:", False),
                           ("pod didn't trigger scale-up: 2 node(s) didn't match pod anti-affinity rules", False),
                           ("pod didn't trigger scale-up: 1 node(s) had untolerated taint {google.com/tpu: present}",
                            True)]:
        word = kuberay.autoscaler_words([_event("p", "NotTriggerScaleUp", message, "t")], {"p": "tpu-0"})["tpu-0"]
        assert word.never is never, message
    up = kuberay.autoscaler_words([_event("p", "TriggeredScaleUp", TRIGGERED, "t")], {"p": "tpu-0"})["tpu-0"]
    assert not up.never and up.short() == "autoscaler: pod triggered scale-up: gke-c-v5p-b-1a2b3c4d-grp 0->2 (max: 2)"
    two = TRIGGERED.replace("}]", "} {https://x/instanceGroups/gke-c-v5p-c-grp 0->2 (max: 2)}]")
    assert kuberay.AutoscalerWord("TriggeredScaleUp", two, "p").short().endswith(
        "gke-c-v5p-b-1a2b3c4d-grp 0->2 (max: 2); gke-c-v5p-c-grp 0->2 (max: 2)")
    # times as the API gives them (seconds, or microseconds): the later one is the last word
    words = kuberay.autoscaler_words([_event("p", "TriggeredScaleUp", TRIGGERED, "2026-12-07T10:00:05.500000Z"),
                                      _event("p", "NotTriggerScaleUp", FULL, "2026-12-07T10:00:05Z")], {"p": "tpu-0"})
    assert words["tpu-0"].reason == "TriggeredScaleUp"
    failed = kuberay.autoscaler_words([_event("p", "FailedScaleUp", STOCKOUT, "t")], {"p": "tpu-0"})["tpu-0"]
    assert not failed.never and "GCE out of resources" in failed.short()


def test_the_autoscalers_never_ends_a_bring_up_only_once_it_has_stood_with_no_scale_up_meanwhile():
    from tpulaunch.errors import DiscoveryError

    never = kuberay.AutoscalerWord("NotTriggerScaleUp", MISMATCH, "c-tpu-1-a")
    full = kuberay.AutoscalerWord("NotTriggerScaleUp", FULL, "c-tpu-1-a")
    declines = kuberay.Declines(grace_s=120.0)
    declines.check({"tpu-1": never}, now=1000.0)
    declines.check({"tpu-1": never}, now=1119.0)  # not yet
    declines.check({"tpu-1": full}, now=1130.0)  # told something else: the clock starts again
    declines.check({"tpu-1": never}, now=1140.0)
    declines.check({}, now=1200.0)  # its pods placed (no word for them)
    declines.check({"tpu-1": never}, now=1210.0)
    with pytest.raises(DiscoveryError, match=r"no node can ever take tpu-1's pods, says GKE's cluster autoscaler,"
                                             r" for 120 s \(c-tpu-1-a: pod didn't trigger scale-up: 3 node"):
        declines.check({"tpu-0": full, "tpu-1": never}, now=1330.0)
    # a slice one pod of which had a scale-up is coming: never refused
    coming = kuberay.AutoscalerWord("NotTriggerScaleUp", MISMATCH, "c-tpu-1-a", triggered=True)
    declines.check({"tpu-1": coming}, now=2000.0)
    declines.check({"tpu-1": coming}, now=9000.0)


def test_a_slice_waiting_on_the_autoscaler_says_so_in_its_progress_line():
    waiting = [pod("a", 0, 0, phase="Pending", ready=False, node_name=""), pod("b", 1, 0)]
    word = kuberay.AutoscalerWord("TriggeredScaleUp", TRIGGERED, "a")
    prog = kuberay.slice_progress(waiting, "tpu", 2, 1, {"tpu-0": word, "tpu-1": word})
    assert prog[0].line() == "tpu-0: 0/1 ready, 1 pending (autoscaler: pod triggered scale-up: gke-c-v5p-b-1a2b3c4d-grp" \
                             " 0->2 (max: 2))"
    assert prog[1].line() == "tpu-1: 1/1 ready" and prog[1].autoscaler is None  # its pods are placed: no word shown


@pytest.mark.parametrize("name,ok", [("tpl-a", True), ("a" * 53, True), ("a" * 54, False), ("9abc", False),
                                     ("Abc", False), ("a_b", False), ("a-", False)])
def test_a_raycluster_name_is_a_dns_label_kuberay_takes(name, ok):
    from tpulaunch.errors import TpulaunchError

    if ok:
        kuberay.check_name(name)
    else:
        with pytest.raises(TpulaunchError, match="is not a RayCluster name"):
            kuberay.check_name(name)
