"""`slice list/describe --gke`, `cluster up --gke --dry-run`, and every bad input of GKE, in this process.

The Kubernetes API is the fake's (tests/fakes/gke/apiserver.py: HTTPS, tokens, RBAC, discovery,
KubeRay's CRD), served from a thread with GKE's nodes in it and no kubelet: nothing here starts a
pod. The CLI runs in this process (`fakes.invoke`) and talks to it with the official client.

The manifests of every GKE generation are a golden file (delete it to record it again, then read the
diff), each one validated against KubeRay v1.7.0's RayCluster CRD (vendored) and accepted by the
KubeRay TPU webhook's validation, and its TPU pods (as KubeRay builds them) by the webhook's mutation.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

import pytest

from fakes import cli_env, closed_port, invoke
from fakes.gke import NodePool, node_names, node_object, tpu
from fakes.gke import kuberay as fake_kuberay
from fakes.gke import tpu_pool
from fakes.gke.apiserver import ApiServer, Store
from fakes.kuberay import crd
from tpulaunch.errors import ExitCode

GOLDEN = Path(__file__).parent / "golden" / "gke_manifests.json"
TOKEN = "admin-token-" + secrets.token_hex(4)

POOLS = [
    NodePool("default-pool", nodes=2),
    tpu_pool("v4-16", "tpu-v4-podslice", "2x2x2"),
    tpu_pool("v5e-8t", "tpu-v5-lite-podslice", "2x4", chips=8),
    tpu_pool("v5e-16", "tpu-v5-lite-podslice", "4x4", spot=True, maintenance=1893456000),
    tpu_pool("v5p-16", "tpu-v5p-slice", "2x2x2", spot=True),
    tpu_pool("v6e-4t", "tpu-v6e-slice", "2x4", chips=4),
    tpu_pool("v6e-256", "tpu-v6e-slice", "16x16"),
    tpu_pool("tpu7x-8", "tpu7x", "2x2x1"),
    tpu_pool("tpu7x-16", "tpu7x", None, nodes=2, placement_policy="wp-ironwood"),  # from a workload policy
    tpu_pool("v4-broken", "tpu-v4-podslice", "2x2x4", nodes=3),  # a host missing
]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    store = Store()
    for pool in POOLS:
        for name in node_names("unit", pool):
            store.create("nodes", node_object(pool, name, "10.0.0.1"))
    server = ApiServer(store, {TOKEN: "admin"})
    server.start()
    home = tmp_path_factory.mktemp("gke-cli")
    kubeconfig = server.kubeconfig(home / "kubeconfig", user="admin", token=TOKEN)
    yield server, store, str(kubeconfig), home
    server.stop()


@pytest.fixture
def env(api, tmp_path):
    server, _store, kubeconfig, _home = api
    return cli_env(tmp_path / "home", KUBECONFIG=kubeconfig, TPULAUNCH_HOME=str(tmp_path / "state"))


def one_line(proc, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# -- discovery ------------------------------------------------------------------------------------


def test_slice_list_gke_shows_every_tpu_node_pool_as_a_slice(env):
    proc = invoke("slice", "list", "--gke", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    pools = {p["pool"]: p for p in json.loads(proc.stdout)["node_pools"]}
    assert set(pools) == {p.name for p in POOLS if p.accelerator}
    row = {k: (p["generation"], p["topology"], p["expected_hosts"], p["ready"], p["accelerator_type"], p["state"])
           for k, p in pools.items()}
    assert row == {
        "v4-16": ("v4", "2x2x2", 2, 2, "v4-16", "READY"),
        "v5e-8t": ("v5e", "2x4", 1, 1, "v5litepod-8", "READY"),  # one 8-chip VM ...
        "v6e-4t": ("v6e", "2x4", 2, 2, "v6e-8", "READY"),  # ... or two 4-chip VMs: the nodes' chips say which
        "v5e-16": ("v5e", "4x4", 4, 4, "v5litepod-16", "READY"),
        "v5p-16": ("v5p", "2x2x2", 2, 2, "v5p-16", "READY"),
        "v6e-256": ("v6e", "16x16", 64, 64, "v6e-256", "READY"),
        "tpu7x-8": ("v7x", "2x2x1", 1, 1, "tpu7x-8", "READY"),
        "tpu7x-16": ("v7x", None, None, 2, None, "UNKNOWN_TOPOLOGY"),
        "v4-broken": ("v4", "2x2x4", 4, 3, "v4-32", "INCOMPLETE"),
    }
    assert pools["v5e-16"]["spot"] and pools["v5e-16"]["maintenance_at"] == "2030-01-01T00:00:00Z"
    assert pools["tpu7x-16"]["placement_policy"] == "wp-ironwood"
    assert pools["v6e-4t"]["machine_type"] == "ct6e-standard-4t"
    table = invoke("slice", "list", "--gke", env=env)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["POOL", "GENERATION", "TOPOLOGY", "HOSTS"]
    broken = next(ln for ln in lines if ln.startswith("v4-broken"))
    assert "3/4 (3 nodes)" in broken and "INCOMPLETE (3 of 4 hosts)" in broken


def test_slice_describe_gke_reads_one_pool_and_exits_4_for_an_incomplete_one(env):
    ok = invoke("slice", "describe", "v5p-16", "--gke", "--json", env=env)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert (doc["accelerator_type"], doc["hosts"], doc["source"], doc["node_pool"]["machine_type"]) == (
        "v5p-16", 2, "gke", "ct5p-hightpu-4t")
    bad = invoke("slice", "describe", "v4-broken", "--gke", env=env)
    assert bad.returncode == ExitCode.NOT_READY and "3 of 4 hosts" in bad.stderr
    missing = invoke("slice", "describe", "nope", "--gke", env=env)
    assert "no TPU node pool named nope" in one_line(missing, ExitCode.DISCOVERY)


# -- manifests ------------------------------------------------------------------------------------

CASES = {
    "v4-2x2x2-x2": ("--topology", "2x2x2", "--accelerator", "v4", "--num-slices", "2"),
    "v5e-2x4-one-vm": ("--topology", "2x4", "--accelerator", "v5e"),
    "v5e-4x4-spot": ("--topology", "4x4", "--accelerator", "v5e", "--spot"),
    "v5p-2x2x2-x2-spot": ("--topology", "2x2x2", "--accelerator", "v5p", "--num-slices", "2", "--spot"),
    "v5p-4x4x4": ("--topology", "4x4x4", "--accelerator", "v5p"),
    "v6e-2x4-two-vms": ("--topology", "2x4", "--accelerator", "v6e", "--chips-per-host", "4"),
    "v6e-16x16": ("--topology", "16x16", "--accelerator", "v6e"),
    "tpu7x-2x2x1": ("--topology", "2x2x1", "--accelerator", "tpu7x"),
    "tpu7x-2x2x2-policy": ("--topology", "2x2x2", "--accelerator", "tpu7x", "--placement-policy", "wp-ironwood"),
}


def _dry_run(env, args) -> dict:
    proc = invoke("cluster", "up", "--gke", *args, "--image", "example.com/tpulaunch:0.1.0", "--name", "golden",
                  "--namespace", "ml", "--dry-run", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_dry_run_manifests_of_every_gke_generation_are_the_golden_ones_and_kuberay_takes_them(env):
    got = {name: _dry_run(env, args) for name, args in CASES.items()}
    if not GOLDEN.exists():  # first run: record (commit the file)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert sorted(want) == sorted(got)
    for name, rc in got.items():
        assert rc == want[name], f"{name} differs from {GOLDEN}; if the change is meant, delete the file and rerun"
        assert rc["kind"] == "RayCluster" and rc["apiVersion"] == "ray.io/v1"
        assert crd.validate(rc) == [], (name, crd.validate(rc))  # KubeRay v1.7.0's schema, strictly
        tpu.webhook_validate(rc)  # numOfHosts agrees with the topology and chips
        g = rc["spec"]["workerGroupSpecs"][0]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"]
        limits = g["template"]["spec"]["containers"][0]["resources"]
        assert limits["limits"] == limits["requests"]
        head = rc["spec"]["headGroupSpec"]["template"]["spec"]
        assert head["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"] == [{"key": "cloud.google.com/gke-tpu-accelerator", "operator": "DoesNotExist"}]
        # what KubeRay makes of it, the webhook admits (single- and multi-host)
        rc = crd.apply_defaults(json.loads(json.dumps(rc))) if hasattr(crd, "apply_defaults") else rc
        rc["metadata"].update(uid="u-1", namespace="ml")
        pod = fake_kuberay.build_pod(rc, head=False, group=g, replica=0, replica_name="tpu-abcde", host=0,
                                     token_secret="golden-tpulaunch-token")
        mutated = tpu.webhook_mutate(tpu.tolerate_extended_resources(pod))
        env_names = [e["name"] for e in mutated["spec"]["containers"][0]["env"]]
        assert "TPU_NAME" in env_names and "TPU_WORKER_ID" in env_names
        assert "MEGASCALE_NUM_SLICES" not in env_names  # the plan sets MEGASCALE_*, per attempt
    sel = got["v5p-2x2x2-x2-spot"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert sel["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x2", "cloud.google.com/gke-spot": "true"}
    assert got["v6e-16x16"]["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 64
    assert got["v6e-2x4-two-vms"]["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 2
    assert got["v5e-2x4-one-vm"]["spec"]["workerGroupSpecs"][0]["numOfHosts"] == 1
    ironwood = got["tpu7x-2x2x2-policy"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    assert ironwood["cloud.google.com/placement-policy-name"] == "wp-ironwood"


def test_spare_slices_are_more_replicas_of_the_group_named_in_the_clusters_annotation(env):
    rc = _dry_run(env, ["--topology", "2x2x2", "--accelerator", "v5p", "--num-slices", "2", "--spare-slices", "1"])
    g = rc["spec"]["workerGroupSpecs"][0]
    assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 3 and crd.validate(rc) == []
    assert json.loads(rc["metadata"]["annotations"]["tpulaunch.dev/spares"]) == ["tpu-2"]  # the last K replicas


def test_a_typo_in_a_manifest_is_what_the_crd_check_catches():
    rc = json.loads(GOLDEN.read_text())["v5p-4x4x4"]
    rc["spec"]["workerGroupSpecs"][0]["numOfHost"] = rc["spec"]["workerGroupSpecs"][0].pop("numOfHosts")
    assert any("numOfHost" in e and "unknown field" in e for e in crd.validate(rc)), crd.validate(rc)


# -- bad input ------------------------------------------------------------------------------------


def test_no_kubeconfig_and_no_pod_is_one_line(tmp_path):
    env = cli_env(tmp_path / "home")
    env.pop("KUBECONFIG", None)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    assert "no kubeconfig (--kubeconfig, KUBECONFIG, ~/.kube/config) and not in a pod" in one_line(
        invoke("slice", "list", "--gke", env=env), ExitCode.DISCOVERY)
    assert "--kubeconfig /nope is not a file" in one_line(
        invoke("slice", "list", "--gke", "--kubeconfig", "/nope", env=env), ExitCode.DISCOVERY)


def test_a_context_the_kubeconfig_lacks_is_one_line(env):
    line = one_line(invoke("slice", "list", "--gke", "--context", "prod", env=env), ExitCode.DISCOVERY)
    assert "the kubeconfig cannot be used" in line and "prod" in line


def test_an_unreachable_api_is_one_line(api, tmp_path):
    server, _store, kubeconfig, _home = api
    cfg = json.loads(Path(kubeconfig).read_text())
    cfg["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{closed_port()}"
    dead = tmp_path / "dead-kubeconfig"
    dead.write_text(json.dumps(cfg))
    line = one_line(invoke("slice", "list", "--gke", env=cli_env(tmp_path / "h", KUBECONFIG=str(dead))),
                    ExitCode.DISCOVERY)
    assert "cannot be reached: connection refused" in line


def test_kubeconfig_files_are_merged_as_kubectl_merges_them(api, tmp_path):
    """KUBECONFIG lists several files: a context of any of them can be named, not only the first's."""
    _server, _store, kubeconfig, _home = api
    other = json.loads(Path(kubeconfig).read_text())
    other["clusters"][0] = {"name": "other", "cluster": {"server": f"https://127.0.0.1:{closed_port()}"}}
    other["contexts"][0] = {"name": "other", "context": {"cluster": "other", "user": "admin"}}
    other["current-context"] = "other"
    first = tmp_path / "other-kubeconfig"
    first.write_text(json.dumps(other))
    env = cli_env(tmp_path / "h", KUBECONFIG=f"{first}{os.pathsep}{tmp_path / 'missing'}{os.pathsep}{kubeconfig}")
    proc = invoke("slice", "list", "--gke", "--context", "fake", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert {p["pool"] for p in json.loads(proc.stdout)["node_pools"]} == {p.name for p in POOLS if p.accelerator}
    # the first file's current context is the one used when none is named, as kubectl does
    assert "127.0.0.1:" in one_line(invoke("slice", "list", "--gke", env=env), ExitCode.DISCOVERY)


def test_a_bring_up_that_meets_another_users_object_of_its_name_deletes_none_of_theirs(api, env):
    """Two users, one --name: the second's bring-up fails on the first object it cannot create (a
    409) and deletes nothing (it had deleted its whole list, the other user's objects with it)."""
    store = api[1]
    theirs = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": {"auth_token": "dGhlaXJz"},
              "metadata": {"name": "clash-tpulaunch-token", "namespace": "default"}}
    store.create("secrets", theirs)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "clash-tpulaunch", "namespace": "default"}}
    store.create("serviceaccounts", sa)
    try:
        proc = invoke("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--spot", "--image",
                      "i", "--name", "clash", env=env)
        assert proc.returncode == ExitCode.CLUSTER and "Traceback" not in proc.stderr, proc.stderr
        assert store.get("secrets", "default", "clash-tpulaunch-token")["data"] == {"auth_token": "dGhlaXJz"}
        assert store.get("serviceaccounts", "default", "clash-tpulaunch") is not None
        assert store.get("rayclusters", "default", "clash") is None
    finally:
        store.delete("secrets", "default", "clash-tpulaunch-token")
        store.delete("serviceaccounts", "default", "clash-tpulaunch")


def test_a_cluster_without_the_tpu_webhook_is_one_line_at_once_not_a_wait_for_hosts_that_never_join(api, env):
    """KubeRay alone (helm's operator chart), no TPU webhook: its TPU pods get no TPU_NAME, so Ray
    would give their hosts no slice and the bring-up would wait its whole --timeout. The first look
    at the pods says so, and what was made is deleted."""
    store = api[1]
    operator = fake_kuberay.KubeRay(store)  # this store admits pods as they are: no webhook mutates them
    operator.start()
    try:
        proc = invoke("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--spot",
                      "--image", "i", "--name", "nohook", "--timeout", "120", env=env)
    finally:
        operator.stop()
    assert proc.returncode == ExitCode.CLUSTER and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]  # after the bring-up's progress, and what it deleted
    assert line.startswith("error: ") and "bring-up failed: deleting what it made" in proc.stderr
    assert "pod nohook-tpu-" in line and "has no TPU_NAME: the KubeRay TPU webhook is not installed" in line, line
    assert "RayOperator" in line and "kuberay-tpu-webhook" in line
    assert store.get("rayclusters", "default", "nohook") is None
    assert not [o for o in store.list("secrets", "default")[0] if o["metadata"]["name"].startswith("nohook")]


def test_a_credential_plugin_not_on_path_is_one_line_naming_it(api, tmp_path):
    """GKE's kubeconfigs get their tokens from `gke-gcloud-auth-plugin`: missing, the client only logs
    it and the API answers 401, whose hint (refresh the credentials) would mislead."""
    _server, _store, kubeconfig, _home = api
    cfg = json.loads(Path(kubeconfig).read_text())
    cfg["users"][0]["user"] = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1",
                                        "command": "gke-gcloud-auth-plugin-not-here", "provideClusterInfo": True}}
    path = tmp_path / "exec-kubeconfig"
    path.write_text(json.dumps(cfg))
    line = one_line(invoke("slice", "list", "--gke", env=cli_env(tmp_path / "h", KUBECONFIG=str(path))),
                    ExitCode.DISCOVERY)
    assert "gets its credentials from gke-gcloud-auth-plugin-not-here, which is not on PATH" in line
    assert "gcloud components install gke-gcloud-auth-plugin" in line


def test_rbac_forbidden_names_the_verb_and_resource_to_ask_for(api, env):
    server = api[0]
    server.deny("admin", "list", "nodes")
    try:
        line = one_line(invoke("slice", "list", "--gke", env=env), ExitCode.DISCOVERY)
    finally:
        server.allow("admin", "list", "nodes")
    assert "forbidden by RBAC" in line and "ask your cluster admin for 'list' on nodes" in line


def test_a_port_forward_rbac_refuses_is_one_line_before_any_connection_waits_on_it(api):
    """Outside the cluster the head's job API is reached through a port-forward: without the right to
    make one, every connection would fail and be waited for as a head still starting (15 minutes)."""
    from tpulaunch import kube as kube_mod

    server, _store, kubeconfig, _home = api
    kube = kube_mod.connect(kube_mod.KubeTarget(kubeconfig=kubeconfig))
    fwd = kube.forward("head-pod", 8265)  # allowed: a local port, nothing asked of the pod yet
    assert fwd.url.startswith("http://127.0.0.1:")
    fwd.close()
    server.deny("admin", "create", "pods/portforward", "default")
    try:
        with pytest.raises(kube_mod.KubeForbidden) as e:
            kube.forward("head-pod", 8265)
    finally:
        server.allow("admin", "create", "pods/portforward", "default")
    assert e.value.line() == ("forbidden by RBAC: port-forward to pod head-pod (the Ray head's job API). ask your"
                              " cluster admin for 'create' on pods/portforward in namespace default, or run"
                              " tpulaunch in a pod of the cluster"), e.value.line()


@contextlib.contextmanager
def autoscaled(tmp_path, pools, decline_s: str, theirs: bool = False):
    """An API of its own with `pools` (the autoscaled ones without nodes), KubeRay with GKE's admission
    and the TPU webhook, and GKE's cluster autoscaler; no kubelet. `theirs`: another job's pod holds
    every TPU node's chips. Yields (store, CLI env, the autoscaler)."""
    from fakes.gke import FakeGke
    from fakes.gke.autoscaler import ClusterAutoscaler

    store = Store()
    store.on_create("pods", FakeGke._admit_pod)
    for pool in pools:
        for name in [] if pool.autoscaled else node_names("unit", pool):
            store.create("nodes", node_object(pool, name, "10.0.0.1"))
            if theirs and pool.accelerator:
                limits = {"google.com/tpu": str(pool.chips_per_node)}
                store.create("pods", {"apiVersion": "v1", "kind": "Pod",
                                      "metadata": {"name": f"theirs-{name[-4:]}", "namespace": "default"},
                                      "spec": {"nodeName": name, "containers": [
                                          {"name": "c", "image": "x", "resources": {"limits": limits, "requests": limits}}]},
                                      "status": {"phase": "Running"}})
    server = ApiServer(store, {TOKEN: "admin"})
    server.start()
    kubeconfig = str(server.kubeconfig(tmp_path / "kubeconfig", user="admin", token=TOKEN))
    env = cli_env(tmp_path / "home", KUBECONFIG=kubeconfig, TPULAUNCH_HOME=str(tmp_path / "state"),
                  TPULAUNCH_AUTOSCALER_DECLINE_TIMEOUT=decline_s)
    operator = fake_kuberay.KubeRay(store)
    operator.start()
    scaler = ClusterAutoscaler(store, pools, scan_s=0.2).start()
    try:
        yield store, env, scaler
    finally:
        scaler.stop()
        operator.stop()
        server.stop()


def test_pools_the_autoscaler_makes_pass_the_fit_check_and_its_no_ends_the_bring_up_at_once(tmp_path):
    """A cluster whose only TPU pool autoscales from zero (no nodes until a pod asks), of another shape
    than asked: without --autoscaler the fit check refuses and says --autoscaler is there; with it,
    the bring-up goes on until GKE's cluster autoscaler answers the TPU pods, and its "no node could
    ever take them", once it has stood (TPULAUNCH_AUTOSCALER_DECLINE_TIMEOUT, 1 s here), ends it (not
    --timeout), quoting it, with what it made deleted."""
    pools = [NodePool("default-pool", nodes=1), tpu_pool("v6e-auto", "tpu-v6e-slice", "4x4", autoscaled=True)]
    up = ("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--image", "i", "--name", "auto")
    with autoscaled(tmp_path, pools, "1") as (store, env, scaler):
        line = one_line(invoke(*up, env=env), ExitCode.DISCOVERY)
        assert "(the cluster has no TPU node pools)" in line and "add --autoscaler" in line, line
        proc = invoke(*up, "--autoscaler", "--timeout", "300", env=env)
    assert proc.returncode == ExitCode.DISCOVERY and "Traceback" not in proc.stderr, proc.stderr
    assert "the rest from GKE's cluster autoscaler" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no node can ever take tpu-0's pods, says GKE's cluster autoscaler, for 1 s"
                           " (auto-tpu-"), last
    assert "pod didn't trigger scale-up: 1 node(s) didn't match Pod's node affinity/selector" in last, last
    assert "bring-up failed: deleting what it made" in proc.stderr and store.get("rayclusters", "default", "auto") is None
    assert not [n for n in store.list("nodes", None)[0] if "v6e-auto" in n["metadata"]["name"]]  # none made for it
    assert not scaler.errors, scaler.errors


def test_a_busy_pool_of_the_shape_is_waited_for_whatever_the_autoscaler_says_of_its_own_pools(tmp_path):
    """The TPU pool of the shape is there but held by another job's pods; the only pool that
    autoscales is a CPU one, so the autoscaler says "1 node(s) didn't match ..." of the TPU pods: it
    speaks only of its own pools, and a pool in sight may free up. The word is shown; the wait goes
    on to --timeout (the head never runs here: no kubelet), never a refusal."""
    pools = [NodePool("default-pool", nodes=1), NodePool("cpu-auto", autoscaled=True),
             tpu_pool("v5p-busy", "tpu-v5p-slice", "2x2x2", spot=True)]
    with autoscaled(tmp_path, pools, "0.5", theirs=True) as (_store, env, scaler):
        proc = invoke("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--spot", "--image", "i",
                      "--name", "busy", "--autoscaler", "--timeout", "6", env=env)
    assert proc.returncode == ExitCode.CLUSTER and "Traceback" not in proc.stderr, proc.stderr
    assert "tpu-0: autoscaler: pod didn't trigger scale-up: 1 node(s) didn't match Pod's node affinity/selector" \
        in proc.stderr, proc.stderr
    assert "the head pod of busy was not ready within 6 s" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not scaler.errors, scaler.errors


def test_a_slice_that_does_not_come_back_says_what_gkes_autoscaler_said_of_it(api):
    """A preempted slice's replica whose pods stay unscheduled past the wait: asked whether it was
    preempted (once, when a spare stepped in), KubeRay's new pods say so; the recovery's line says why
    it is not back, in the autoscaler's words (a stockout's backoff here), read as the head's
    supervisor reads it."""
    from tpulaunch.cluster.record import ClusterInfo, GkeSpec
    from tpulaunch.plan.slicespec import SliceSpec, WorkerEndpoint
    from tpulaunch.providers.gke import GkeProvider
    from tpulaunch.run.recovery.recreate import RejoinFailed

    _server, store, kubeconfig, _home = api
    rc = json.loads(GOLDEN.read_text())["v5p-2x2x2-x2-spot"]
    rc["metadata"] = {"name": "back", "namespace": "default"}
    store.create("rayclusters", rc)
    names = []
    for host in (0, 1):  # the replica KubeRay made again, its pods waiting for nodes
        pod = store.create("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"back-tpu-worker-{host}", "namespace": "default",
            "labels": {"ray.io/cluster": "back", "ray.io/group": "tpu", "ray.io/node-type": "worker",
                       "ray.io/worker-group-replica-index": "1", "ray.io/replica-host-index": str(host)}},
            "spec": {"containers": [{"name": "ray-worker", "image": "i"}]}})
        names.append(pod["metadata"]["name"])
    store.create("events", {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": "back-tpu-worker-0.1", "namespace": "default"},
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": names[0]},
        "reason": "NotTriggerScaleUp", "message": "pod didn't trigger scale-up: 1 in backoff after failed scale-up",
        "type": "Normal", "source": {"component": "cluster-autoscaler"}, "lastTimestamp": "2026-12-07T10:00:00Z"})
    was = SliceSpec(name="tpu-1", accelerator_type="v5p-16", topology="2x2x2", source="gke", slice_index=1,
                    workers=(WorkerEndpoint(0, "10.1.1.2"), WorkerEndpoint(1, "10.1.1.3")))  # where the run had it
    provider = GkeProvider(ClusterInfo(address="back-head-svc.default.svc.cluster.local:6379", temp_dir=None,
                                       token_path=None, emulated=False, gke=GkeSpec("back", "default", None, kubeconfig),
                                       slices=[was]))
    try:
        # asked once when a spare took its place: its old pods are gone already, and new ones wait for nodes
        assert provider.preempted(["tpu-1"]) == {"tpu-1": "KubeRay made its replica again (new pods, at new addresses"
                                                           " or none yet): the old ones went with their nodes"}
        with pytest.raises(RejoinFailed) as e:
            provider.rejoin(["tpu-1"], 0.1, lambda _msg: None)
        # a swap names the lost slice the spare, and records the spare where its pods are now (none with an
        # address yet here): a loss of it in turn is read against that, not against where it once was
        store.patch("rayclusters", "default", "back", {"metadata": {"annotations": {"tpulaunch.dev/spares": '["tpu-1"]'}}})
        provider.swap("tpu-0", "tpu-1")
        assert provider.spares() == ["tpu-0"]
        assert [(sl.name, sl.workers) for sl in provider.info.slices] == [("tpu-1", ())]
    finally:
        for n in names:
            store.delete("pods", "default", n)
        store.delete("events", "default", "back-tpu-worker-0.1")
        store.delete("rayclusters", "default", "back")
    assert ("tpu-1: 0/2 ready, 2 pending (autoscaler: pod didn't trigger scale-up: 1 in backoff after failed"
            " scale-up)") in e.value.why, e.value.why


def test_kuberays_crd_missing_is_one_line(api, env):
    server = api[0]
    server.set_served("ray.io/v1", False)
    try:
        line = one_line(invoke("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--image", "i",
                               env=env), ExitCode.CLUSTER)
    finally:
        server.set_served("ray.io/v1", True)
    assert "KubeRay's CRD is not installed" in line and "RayOperator" in line


def test_no_node_pool_of_the_shape_is_one_line_naming_what_is_there(env):
    line = one_line(invoke("cluster", "up", "--gke", "--topology", "4x4x4", "--accelerator", "v5p", "--image", "i",
                           env=env), ExitCode.DISCOVERY)
    assert "no room for 1 node pool(s) of v5p 4x4x4" in line and "v5p-16: v5p 2x2x2" in line
    # the pool is there, but not spot: the capacity kind matters
    line = one_line(invoke("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v4", "--spot",
                           "--image", "i", env=env), ExitCode.DISCOVERY)
    assert "(spot)" in line


def test_a_raycluster_of_that_name_not_made_by_tpulaunch_is_refused_and_untouched(api, env):
    store = api[1]
    theirs = json.loads(GOLDEN.read_text())["v5p-2x2x2-x2-spot"]
    theirs["metadata"] = {"name": "theirs", "namespace": "default"}
    store.create("rayclusters", theirs)
    try:
        line = one_line(invoke("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--spot",
                               "--image", "i", "--name", "theirs", env=env), ExitCode.CLUSTER)
        assert "tpulaunch did not make it" in line and "--join theirs" in line
        assert store.get("rayclusters", "default", "theirs")["metadata"].get("labels") is None
    finally:
        store.delete("rayclusters", "default", "theirs")


@pytest.mark.parametrize("args,why", [
    (("--name", "Bad_Name"), "is not a RayCluster name"),
    (("--namespace", "NS!"), "is not a namespace name"),
    (("--accelerator", "v3"), "not offered on GKE"),
    (("--chips-per-host", "8"), "no GKE machine type of v5p has 8 chips"),
    (("--num-slices", "1000000000"), "is not a number of slices from 1 to 1024"),
])
def test_a_bad_flag_is_one_line_and_exit_2(env, args, why):
    base = {"--topology": "2x2x2", "--accelerator": "v5p", "--image": "i"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    flat = [x for kv in base.items() for x in kv]
    assert why in one_line(invoke("cluster", "up", "--gke", *flat, "--dry-run", env=env), ExitCode.USAGE)


def test_no_image_says_how_to_build_one(env):
    line = one_line(invoke("cluster", "up", "--gke", "--topology", "2x2x2", "--accelerator", "v5p", "--dry-run",
                           env=env), ExitCode.USAGE)
    assert "--image is needed" in line and "pip install tpulaunch==0.1.0" in line


def test_joining_a_raycluster_that_is_not_there_is_one_line(env):
    assert "no RayCluster named ghost" in one_line(invoke("cluster", "up", "--gke", "--join", "ghost", env=env),
                                                   ExitCode.CLUSTER)
