"""The fake Kubernetes API server (tests/fakes/gke/apiserver.py) against the official `kubernetes` client.

The fake is only worth something if the real client accepts what it says and gets from it what a
real cluster would say: these tests drive it through `kubernetes` 37 (TLS, bearer tokens,
CustomObjectsApi, typed CoreV1Api models, `watch.Watch`, `stream.portforward`) and pin the shapes
tpulaunch reads: Status errors, 410 Gone in both forms, garbage collection, tables, paging.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import struct
import threading
import time

import pytest
import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from kubernetes.stream import portforward

from fakes.gke import selectors
from fakes.gke.apiserver import (
    ApiServer, Conflict, Gone, Invalid, NotFound, OP_BINARY, OP_CLOSE, OP_CONT, OP_PING, OP_PONG, Store, WsReader,
    json_patch, merge_patch, strategic_merge_patch, ws_frame,
)
from fakes.kuberay import crd

pytestmark = pytest.mark.unit

TOKENS = {"admin-token": "admin", "alice-token": "alice"}

# KubeRay's own sample (ray-operator/config/samples/ray-cluster.tpu-v6e-16-multihost.yaml).
SAMPLE = yaml.safe_load("""
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: raycluster-tpu-v6e-multihost
spec:
  rayVersion: '2.45.0'
  headGroupSpec:
    template:
      spec:
        containers:
          - name: ray-head
            image: rayproject/ray:2.45.0
            imagePullPolicy: IfNotPresent
            resources:
              limits: {cpu: "8", memory: 40G}
              requests: {cpu: "8", memory: 40G}
            ports:
            - {containerPort: 6379, name: gcs}
            - {containerPort: 8265, name: dashboard}
            - {containerPort: 10001, name: client}
            - {containerPort: 8000, name: serve}
            - {containerPort: 8888, name: grpc}
  workerGroupSpecs:
  - groupName: tpu-group
    replicas: 1
    minReplicas: 0
    maxReplicas: 1
    numOfHosts: 4
    template:
      spec:
        containers:
          - name: ray-worker
            image: rayproject/ray:2.45.0
            imagePullPolicy: IfNotPresent
            resources:
              limits: {cpu: "24", google.com/tpu: "4", memory: 200G}
              requests: {cpu: "24", google.com/tpu: "4", memory: 200G}
            env:
            - name: NODE_IP
              valueFrom: {fieldRef: {fieldPath: status.hostIP}}
            - {name: JAX_PLATFORMS, value: "tpu,cpu"}
            ports:
            - {containerPort: 8081, name: mxla}
        nodeSelector:
          cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
          cloud.google.com/gke-tpu-topology: 4x4
""")


def raycluster(name: str, labels: dict | None = None) -> dict:
    rc = json.loads(json.dumps(SAMPLE))
    rc["metadata"] = {"name": name, **({"labels": labels} if labels else {})}
    return rc


def node(name: str, labels: dict | None = None) -> dict:
    """A Node the typed client accepts (V1NodeSystemInfo has ten required fields)."""
    info = {k: "x" for k in ("architecture", "bootID", "containerRuntimeVersion", "kernelVersion", "kubeProxyVersion",
                             "machineID", "operatingSystem", "osImage", "systemUUID")}
    info["kubeletVersion"] = "v1.32.4-gke.1106006"
    return {"metadata": {"name": name, "labels": labels or {}},
            "status": {"nodeInfo": info, "conditions": [{"type": "Ready", "status": "True"}],
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.2"}]}}


def pod(name: str, owner: dict | None = None, **status) -> dict:
    meta: dict = {"name": name, "namespace": "default", "labels": {"app": "x"}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": owner["kind"], "controller": True,
                                    "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
                                    "blockOwnerDeletion": True}]
    return {"metadata": meta, "spec": {"containers": [{"name": "c", "image": "busybox:1"}], "nodeName": "n1"},
            "status": status}


@pytest.fixture
def cluster(tmp_path):
    """A running fake (fresh store), the kubeconfig it wrote, and clients built from that file."""
    store = Store()
    api = ApiServer(store, TOKENS)
    api.start()
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(api.kubeconfig(tmp_path / "kubeconfig")), client_configuration=cfg)
    api_client = client.ApiClient(cfg)
    yield store, api, api_client
    api_client.close()
    api.stop()


def raw(api: ApiServer, method: str, path: str, body: bytes | None = None, token: str = "admin-token",
        headers: dict | None = None) -> tuple[int, dict]:
    ctx = ssl.create_default_context(cadata=api.ca_pem)
    conn = http.client.HTTPSConnection("127.0.0.1", api.port, context=ctx, timeout=10)
    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {token}", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


def co_args(**kw):
    return {"group": "ray.io", "version": "v1", "namespace": "default", "plural": "rayclusters", **kw}


# -- CRUD through the official client ------------------------------------------------------------


def test_raycluster_create_get_list_patch_delete(cluster):
    store, api, ac = cluster
    co = client.CustomObjectsApi(ac)
    made = co.create_namespaced_custom_object(**co_args(), body=raycluster("rc-a", {"team": "a", "tier": "1"}))
    m = made["metadata"]
    assert m["namespace"] == "default" and m["uid"] and m["generation"] == 1 and m["creationTimestamp"].endswith("Z")
    group = made["spec"]["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"], group["numOfHosts"]) == (1, 0, 1, 4)
    assert group["priority"] == 0  # a CRD default the request did not carry
    co.create_namespaced_custom_object(**co_args(), body=raycluster("rc-b", {"team": "b"}))
    co.create_namespaced_custom_object(**co_args(), body=raycluster("rc-c"))

    assert co.get_namespaced_custom_object(**co_args(), name="rc-a")["metadata"]["uid"] == m["uid"]

    def names(sel: str) -> list[str]:
        return [i["metadata"]["name"] for i in co.list_namespaced_custom_object(**co_args(), label_selector=sel)["items"]]

    assert names("team=a") == ["rc-a"]
    assert names("team!=a") == ["rc-b", "rc-c"]  # != also matches objects without the label
    assert names("team in (a, b),tier") == ["rc-a"]
    assert names("team notin (a)") == ["rc-b", "rc-c"]
    assert names("!team") == ["rc-c"]
    listed = co.list_namespaced_custom_object(**co_args())
    assert listed["kind"] == "RayClusterList" and int(listed["metadata"]["resourceVersion"]) >= int(m["resourceVersion"])
    assert listed["items"][0]["kind"] == "RayCluster"  # custom resources keep kind per item

    patched = co.patch_namespaced_custom_object(**co_args(), name="rc-a",
                                                body={"spec": {"workerGroupSpecs": [{**group, "replicas": 0}]}})
    assert patched["spec"]["workerGroupSpecs"][0]["replicas"] == 0 and patched["metadata"]["generation"] == 2
    assert int(patched["metadata"]["resourceVersion"]) > int(m["resourceVersion"])
    jp = co.patch_namespaced_custom_object(**co_args(), name="rc-a", _content_type="application/json-patch+json",
                                           body=[{"op": "add", "path": "/metadata/labels/tier", "value": "2"}])
    assert jp["metadata"]["labels"] == {"team": "a", "tier": "2"} and jp["metadata"]["generation"] == 2

    # a stale resourceVersion loses the race (409 Conflict)
    stale = dict(patched, metadata={**patched["metadata"]})
    with pytest.raises(ApiException) as e:
        co.replace_namespaced_custom_object(**co_args(), name="rc-a", body=stale)
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "Conflict"
    # a strategic merge patch of a custom resource is refused, as the real server does
    status, doc = raw(api, "PATCH", "/apis/ray.io/v1/namespaces/default/rayclusters/rc-a", b"{}",
                      headers={"Content-Type": "application/strategic-merge-patch+json"})
    assert status == 415 and doc["reason"] == "UnsupportedMediaType"

    gone = co.delete_namespaced_custom_object(**co_args(), name="rc-a")
    assert gone["status"] == "Success" and gone["details"] == {"name": "rc-a", "group": "ray.io", "kind": "rayclusters",
                                                               "uid": m["uid"]}
    with pytest.raises(ApiException) as e:
        co.get_namespaced_custom_object(**co_args(), name="rc-a")
    assert e.value.status == 404
    assert json.loads(e.value.body) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'rayclusters.ray.io "rc-a" not found', "reason": "NotFound",
        "details": {"name": "rc-a", "group": "ray.io", "kind": "rayclusters"}, "code": 404}
    with pytest.raises(ApiException) as e:
        co.create_namespaced_custom_object(**co_args(), body=raycluster("rc-b"))
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "AlreadyExists"


def test_crd_rejects_a_typo_and_accepts_kuberays_sample(cluster):
    assert crd.validate(SAMPLE) == []
    bad = raycluster("typo")
    bad["spec"]["workerGroupSpecs"][0]["numOfHost"] = bad["spec"]["workerGroupSpecs"][0].pop("numOfHosts")
    bad["spec"]["workerGroupSpecs"][0]["rayStartParams"] = {"num-cpus": 1}
    assert crd.validate(bad) == [
        "spec.workerGroupSpecs[0].numOfHost: unknown field",
        'spec.workerGroupSpecs[0].rayStartParams.num-cpus: Invalid value: "integer": '
        'spec.workerGroupSpecs[0].rayStartParams.num-cpus in body must be of type string: "integer"',
    ]
    no_head = raycluster("nohead")
    del no_head["spec"]["headGroupSpec"]["template"]
    no_head["spec"]["authOptions"] = {"mode": "tokens"}
    assert crd.validate(no_head) == [
        "spec.headGroupSpec.template: Required value",
        'spec.authOptions.mode: Unsupported value: "tokens": supported values: "disabled", "token"',
    ]

    _, _, ac = cluster
    with pytest.raises(ApiException) as e:
        client.CustomObjectsApi(ac).create_namespaced_custom_object(**co_args(), body=bad)
    doc = json.loads(e.value.body)
    assert e.value.status == 422 and doc["reason"] == "Invalid"
    assert doc["message"].startswith(
        'RayCluster.ray.io "typo" is invalid: [spec.workerGroupSpecs[0].numOfHost: unknown field, ')
    assert doc["details"]["causes"][0] == {"reason": "FieldValueInvalid", "message": "unknown field",
                                           "field": "spec.workerGroupSpecs[0].numOfHost"}
    assert doc["details"]["kind"] == "RayCluster" and doc["details"]["group"] == "ray.io"


def test_nodes_typed_list_table_and_paging(cluster):
    store, api, ac = cluster
    for i in range(5):
        store.create("nodes", node(f"n{i}", {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice"} if i % 2 else {}))
    core = client.CoreV1Api(ac)
    tpu = core.list_node(label_selector="cloud.google.com/gke-tpu-accelerator")
    assert [n.metadata.name for n in tpu.items] == ["n1", "n3"] and tpu.items[0].status.node_info.kubelet_version

    first = core.list_node(limit=2)
    assert [n.metadata.name for n in first.items] == ["n0", "n1"] and first.metadata.remaining_item_count == 3
    second = core.list_node(limit=2, _continue=first.metadata._continue)
    third = core.list_node(limit=2, _continue=second.metadata._continue)
    assert [n.metadata.name for n in second.items + third.items] == ["n2", "n3", "n4"]
    assert not third.metadata._continue

    kubectl_accept = ("application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;"
                      "g=meta.k8s.io,application/json")
    status, tab = raw(api, "GET", "/api/v1/nodes?limit=500", headers={"Accept": kubectl_accept})
    assert status == 200 and tab["kind"] == "Table"
    default_cols = [c["name"] for c in tab["columnDefinitions"] if c["priority"] == 0]
    assert default_cols == ["Name", "Status", "Roles", "Age", "Version"]
    assert tab["rows"][0]["cells"][:3] == ["n0", "Ready", "<none>"]
    assert tab["rows"][0]["object"]["kind"] == "PartialObjectMetadata"

    store.create("pods", pod("p1", podIP="10.1.0.5", phase="Running",
                             containerStatuses=[{"name": "c", "ready": True, "restartCount": 2, "image": "busybox:1",
                                                 "imageID": "", "state": {"running": {}}}]))
    _, ptab = raw(api, "GET", "/api/v1/namespaces/default/pods", headers={"Accept": kubectl_accept})
    assert ptab["rows"][0]["cells"][:4] == ["p1", "1/1", "Running", "2"]
    store.create("rayclusters", raycluster("rc"))
    _, rtab = raw(api, "GET", "/apis/ray.io/v1/namespaces/default/rayclusters", headers={"Accept": kubectl_accept})
    assert [c["name"] for c in rtab["columnDefinitions"]][:3] == ["Name", "desired workers", "available workers"]
    assert rtab["rows"][0]["cells"][0] == "rc"
    # without the Table Accept: a plain list, items without kind (typed lists)
    _, plain = raw(api, "GET", "/api/v1/nodes")
    assert plain["kind"] == "NodeList" and "kind" not in plain["items"][0]


# -- watch -----------------------------------------------------------------------------------------


def test_watch_from_a_resource_version_then_410_gone(cluster):
    store, api, ac = cluster
    co = client.CustomObjectsApi(ac)
    co.create_namespaced_custom_object(**co_args(), body=raycluster("before"))
    rv = co.list_namespaced_custom_object(**co_args())["metadata"]["resourceVersion"]
    co.create_namespaced_custom_object(**co_args(), body=raycluster("w1"))
    co.patch_namespaced_custom_object(**co_args(), name="w1", body={"metadata": {"labels": {"x": "y"}}})
    co.delete_namespaced_custom_object(**co_args(), name="w1")
    w = watch.Watch()
    seen = []
    for ev in w.stream(co.list_namespaced_custom_object, **co_args(), resource_version=rv, timeout_seconds=5):
        seen.append((ev["type"], ev["object"]["metadata"]["name"]))
        if len(seen) == 3:
            w.stop()
    assert seen == [("ADDED", "w1"), ("MODIFIED", "w1"), ("DELETED", "w1")]

    # no resourceVersion: the current objects first, as synthetic ADDED events
    w = watch.Watch()
    first = next(iter(w.stream(co.list_namespaced_custom_object, **co_args(), timeout_seconds=5)))
    w.stop()
    assert (first["type"], first["object"]["metadata"]["name"]) == ("ADDED", "before")

    # at the start: the history no longer reaches back (compaction) -> an ERROR event with 410 Expired
    store.compact()
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(co.list_namespaced_custom_object, **co_args(), resource_version=rv, timeout_seconds=5))
    assert e.value.status == 410 and e.value.reason.startswith("Expired: too old resource version: ")
    # ... or as an HTTP 410 Status, when the fake is asked to answer that way
    api.watch_gone = "http"
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(co.list_namespaced_custom_object, **co_args(), resource_version=rv, timeout_seconds=5))
    assert e.value.status == 410 and json.loads(e.value.body)["reason"] == "Expired"
    api.watch_gone = "event"

    # mid-stream: the watch is going, then the server expires it
    now = co.list_namespaced_custom_object(**co_args())["metadata"]["resourceVersion"]
    stream = watch.Watch().stream(co.list_namespaced_custom_object, **co_args(), resource_version=now, timeout_seconds=5)
    store.create("rayclusters", raycluster("mid"))
    assert next(stream)["object"]["metadata"]["name"] == "mid"
    store.expire_watches()
    with pytest.raises(ApiException) as e:
        next(stream)
    assert e.value.status == 410


def test_typed_pod_watch_with_selector_transitions_and_bookmarks(cluster):
    store, api, ac = cluster
    api.bookmark_interval = 0.2
    core = client.CoreV1Api(ac)
    rv = store.resource_version
    store.create("pods", pod("p1"))
    p = store.get("pods", "default", "p1")
    p["metadata"]["labels"]["app"] = "other"  # leaves the selector: the watcher sees DELETED
    store.replace("pods", p)
    w = watch.Watch()
    events = []
    for ev in w.stream(core.list_namespaced_pod, "default", label_selector="app=x", resource_version=rv,
                       allow_watch_bookmarks=True, timeout_seconds=5):
        events.append(ev["type"])
        if ev["type"] == "BOOKMARK":
            w.stop()
    assert events == ["ADDED", "DELETED", "BOOKMARK"]
    assert w.resource_version == store.resource_version


# -- garbage collection, auth ----------------------------------------------------------------------


def test_deleting_a_raycluster_collects_its_pods(cluster):
    store, api, ac = cluster
    co = client.CustomObjectsApi(ac)
    rc = co.create_namespaced_custom_object(**co_args(), body=raycluster("owner"))
    head = store.create("pods", pod("owner-head-x", owner=rc))
    store.create("pods", pod("owner-worker-x", owner=rc))
    store.create("secrets", {"metadata": {"name": "s", "ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": head["metadata"]["name"], "uid": head["metadata"]["uid"]}]},
        "stringData": {"k": "v"}})
    store.create("pods", pod("bystander"))
    sub = store.watch("pods", "default", "", store.resource_version)
    co.delete_namespaced_custom_object(**co_args(), name="owner")
    assert [p["metadata"]["name"] for p in store.list("pods", "default")[0]] == ["bystander"]
    assert store.get("secrets", "default", "s") is None  # transitively: the head pod owned it
    got = [sub.get(timeout=1) for _ in range(2)]
    assert sorted((t, o["metadata"]["name"]) for t, o in got) == [("DELETED", "owner-head-x"), ("DELETED", "owner-worker-x")]
    sub.close()


def test_unauthorized_and_forbidden_shapes(cluster, tmp_path):
    store, api, ac = cluster
    status, doc = raw(api, "GET", "/api/v1/namespaces/default/pods", token="nope")
    assert status == 401 and doc == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                     "message": "Unauthorized", "reason": "Unauthorized", "code": 401}
    api.deny("alice", "list", "pods", "default")
    api.deny("alice", "get", "rayclusters")
    api.deny("alice", "list", "nodes")
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(api.kubeconfig(tmp_path / "alice", user="alice")), client_configuration=cfg)
    with client.ApiClient(cfg) as alice:
        with pytest.raises(ApiException) as e:
            client.CoreV1Api(alice).list_namespaced_pod("default")
        assert e.value.status == 403 and json.loads(e.value.body) == {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": 'pods is forbidden: User "alice" cannot list resource "pods" in API group "" '
                       'in the namespace "default"',
            "reason": "Forbidden", "details": {"kind": "pods"}, "code": 403}
        with pytest.raises(ApiException) as e:
            client.CustomObjectsApi(alice).get_namespaced_custom_object(**co_args(), name="x")
        assert json.loads(e.value.body)["message"] == (
            'rayclusters.ray.io "x" is forbidden: User "alice" cannot get resource "rayclusters" in API group "ray.io" '
            'in the namespace "default"')
        with pytest.raises(ApiException) as e:
            client.CoreV1Api(alice).list_node()
        assert json.loads(e.value.body)["message"].endswith(
            'cannot list resource "nodes" in API group "" at the cluster scope')
        assert client.CoreV1Api(alice).list_namespaced_pod("kube-system").items == []


def test_unserved_group_disappears_from_discovery(cluster):
    store, api, ac = cluster
    assert "ray.io" in [g.name for g in client.ApisApi(ac).get_api_versions().groups]
    api.set_served("ray.io/v1", False)
    assert "ray.io" not in [g.name for g in client.ApisApi(ac).get_api_versions().groups]
    with pytest.raises(ApiException) as e:
        client.CustomObjectsApi(ac).list_namespaced_custom_object(**co_args())
    assert e.value.status == 404
    status, res = raw(api, "GET", "/api/v1")
    pods = next(r for r in res["resources"] if r["name"] == "pods")
    assert pods["shortNames"] == ["po"] and pods["namespaced"] and pods["kind"] == "Pod"
    api.set_served("ray.io/v1")
    _, rl = raw(api, "GET", "/apis/ray.io/v1")
    assert rl["resources"][0]["name"] == "rayclusters" and "shortNames" not in rl["resources"][0]


def test_in_cluster_config_reaches_the_fake(cluster, tmp_path):
    store, api, ac = cluster
    sa = api.serviceaccount_dir(tmp_path / "sa", "admin-token", "default")
    cfg = client.Configuration()
    config.incluster_config.InClusterConfigLoader(str(sa / "token"), str(sa / "ca.crt"), try_refresh_token=False,
                                                  environ=api.service_env()).load_and_set(cfg)
    with client.ApiClient(cfg) as c:
        assert [n.metadata.name for n in client.CoreV1Api(c).list_namespace().items] == [
            "default", "kube-node-lease", "kube-public", "kube-system"]


# -- port-forward -----------------------------------------------------------------------------------


@pytest.fixture
def echo_server():
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def recv_exactly(sock, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "connection closed early"
        out += chunk
    return out


def test_port_forward_to_an_echo_server(cluster, echo_server):
    store, api, ac = cluster
    store.create("pods", pod("head", podIP="127.0.0.1", phase="Running"))
    core = client.CoreV1Api(ac)
    pf = portforward(core.connect_get_namespaced_pod_portforward, "head", "default", ports=str(echo_server))
    sock = pf.socket(echo_server)
    sock.settimeout(5)
    sock.sendall(b"hello")
    assert recv_exactly(sock, 5) == b"hello"
    big = bytes(range(256)) * 1200  # > 64 KiB: 64-bit frame lengths both ways
    sock.sendall(big)
    assert recv_exactly(sock, len(big)) == big
    sock.close()
    assert pf.error(echo_server) is None

    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    pf = portforward(core.connect_get_namespaced_pod_portforward, "head", "default", ports=str(port))
    s = pf.socket(port)
    s.settimeout(5)
    assert s.recv(10) == b""
    assert pf.error(port).startswith(f"error forwarding port {port} to pod ")
    assert "connection refused" in pf.error(port)


def _ws_connect(api: ApiServer, path: str, protocol: str = "v4.channel.k8s.io") -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cadata=api.ca_pem)
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", api.port), timeout=5), server_hostname="127.0.0.1")
    key = base64.b64encode(b"0123456789abcdef").decode()
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {protocol}\r\n"
               "Authorization: Bearer admin-token\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    assert f"Sec-WebSocket-Protocol: {protocol}".encode() in head
    return s


def test_websocket_framing_fragments_ping_and_close(cluster, echo_server):
    store, api, _ = cluster
    store.create("pods", pod("head", podIP="127.0.0.1", phase="Running"))
    s = _ws_connect(api, f"/api/v1/namespaces/default/pods/head/portforward?ports={echo_server}")
    reader = WsReader()

    def frames(n: int) -> list[tuple[int, bytes]]:
        got: list[tuple[int, bytes]] = []
        while len(got) < n:
            got += reader.feed(s.recv(65536))
        return got

    port = struct.pack("<H", echo_server)
    assert frames(2) == [(OP_BINARY, b"\x00" + port), (OP_BINARY, b"\x01" + port)]
    # one message in two fragments, a ping between them
    s.sendall(b"\x02" + ws_frame(b"\x00hel", mask=True)[1:])  # FIN=0, opcode binary
    s.sendall(ws_frame(b"are you there", OP_PING, mask=True))
    s.sendall(ws_frame(b"lo", OP_CONT, mask=True))
    got = frames(2)
    assert got[0] == (OP_PONG, b"are you there")
    assert got[1] == (OP_BINARY, b"\x00hello")
    s.sendall(ws_frame(struct.pack("!H", 1000), OP_CLOSE, mask=True))
    assert frames(1) == [(OP_CLOSE, struct.pack("!H", 1000))]
    s.close()


# -- the store in-process ----------------------------------------------------------------------------


def test_store_admission_names_conflicts_finalizers():
    store = Store()
    seen = []

    def webhook(obj: dict) -> None:
        seen.append(obj["metadata"].get("name"))
        obj["spec"]["containers"][0].setdefault("env", []).append({"name": "TPU_WORKER_ID", "value": "0"})

    def deny_tpu(obj: dict) -> None:
        if obj["metadata"]["labels"].get("deny"):
            raise Invalid(["metadata.labels.deny: Forbidden: no"])

    store.on_create("pods", webhook)
    store.on_create("pods", deny_tpu, validating=True)
    p = pod("")
    p["metadata"]["generateName"] = "rc-tpu-group-worker-"
    made = store.create("pods", p)
    assert seen == [""]  # mutating webhooks run before the name is generated, as in the real server
    name = made["metadata"]["name"]
    assert name.startswith("rc-tpu-group-worker-") and len(name) == len("rc-tpu-group-worker-") + 5
    assert set(name[-5:]) <= set("bcdfghjklmnpqrstvwxz2456789")
    assert made["spec"]["containers"][0]["env"] == [{"name": "TPU_WORKER_ID", "value": "0"}]
    assert made["spec"]["serviceAccountName"] == "default" and made["status"]["phase"] == "Pending"
    denied = pod("d")
    denied["metadata"]["labels"]["deny"] = "1"
    with pytest.raises(Invalid) as e:
        store.create("pods", denied)
    assert str(e.value) == 'Pod "d" is invalid: metadata.labels.deny: Forbidden: no'
    with pytest.raises(Conflict):
        store.create("pods", {**pod("x")})
        store.create("pods", pod("x"))
    with pytest.raises(NotFound):
        store.create("pods", {**pod("y"), "metadata": {"name": "y", "namespace": "nowhere"}})

    # an unchanged replace writes nothing; a stale one is a Conflict
    cur = store.get("pods", "default", "x")
    assert store.replace("pods", cur)["metadata"]["resourceVersion"] == cur["metadata"]["resourceVersion"]
    cur["status"]["phase"] = "Running"
    store.replace("pods", cur)
    with pytest.raises(Conflict):
        store.replace("pods", cur)

    # finalizers hold a deletion until they are removed
    store.patch("pods", "default", "x", {"metadata": {"finalizers": ["example.com/hold"]}})
    held = store.delete("pods", "default", "x")
    assert held["metadata"]["deletionTimestamp"] and store.get("pods", "default", "x") is not None
    store.patch("pods", "default", "x", [{"op": "remove", "path": "/metadata/finalizers"}], "json")
    assert store.get("pods", "default", "x") is None

    svc = store.create("services", {"metadata": {"name": "s"}, "spec": {"ports": [{"port": 80}]}})
    assert svc["spec"]["clusterIP"].startswith("34.118.") and svc["spec"]["ports"][0]["targetPort"] == 80
    with pytest.raises(Invalid) as e:
        store.create("services", {"metadata": {"name": "Bad_Name"}, "spec": {"clusterIP": "None"}})
    assert "a DNS-1035 label must consist of" in str(e.value)


def test_store_watch_history_bound_and_gone():
    store = Store(history=5)
    start = store.resource_version
    for i in range(3):
        store.create("pods", pod(f"p{i}"))
    sub = store.watch("pods", "default", "", start)
    assert [sub.get(0)[1]["metadata"]["name"] for _ in range(3)] == ["p0", "p1", "p2"]
    assert sub.get(0.01) is None
    sub.close()
    for i in range(3, 10):
        store.create("pods", pod(f"p{i}"))
    with pytest.raises(Gone) as e:
        store.watch("pods", "default", "", start)
    assert e.value.status()["code"] == 410 and e.value.message.startswith(f"too old resource version: {start} (")


def test_selectors_and_patches():
    match = selectors.selector("a in (x,y), !b, c!=z, d", "metadata.name=p,spec.nodeName!=n2", "pods")
    obj = {"metadata": {"name": "p", "labels": {"a": "x", "d": ""}}, "spec": {"nodeName": "n1"}}
    assert match(obj)
    assert not match({**obj, "spec": {"nodeName": "n2"}})
    for bad in ("a in ()", "a b", "a=(", "-a=1"):
        with pytest.raises(selectors.SelectorError):
            selectors.parse_labels(bad)
    with pytest.raises(selectors.SelectorError, match="field label not supported: spec.foo"):
        selectors.parse_fields("spec.foo=1", "pods")
    assert selectors.selector("n>3")({"metadata": {"labels": {"n": "4"}}})

    assert merge_patch({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": None, "e": 3}, "d": [2]}) == {
        "a": {"c": 2, "e": 3}, "d": [2]}
    assert json_patch({"a": [1, 3]}, [{"op": "add", "path": "/a/1", "value": 2}, {"op": "test", "path": "/a/2", "value": 3},
                                      {"op": "move", "from": "/a", "path": "/b"}]) == {"b": [1, 2, 3]}
    spec = {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}
    assert strategic_merge_patch(spec, {"containers": [{"name": "b", "image": "2"}]}) == {
        "containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}]}
    assert strategic_merge_patch(spec, {"containers": [{"name": "a", "$patch": "delete"}]}) == {
        "containers": [{"name": "b", "image": "1"}]}


def test_ws_reader_joins_fragments_around_control_frames():
    r = WsReader()
    wire = (b"\x01" + ws_frame(b"ab", mask=True)[1:] + ws_frame(b"", OP_PING, mask=True)
            + ws_frame(b"cd", OP_CONT, mask=True))
    out = []
    for i in range(len(wire)):  # byte by byte: partial headers and payloads wait for more
        out += r.feed(wire[i:i + 1])
    assert out == [(OP_PING, b""), (1, b"abcd")]
    t = time.perf_counter()
    big = bytes(1 << 20)
    assert r.feed(ws_frame(big, mask=True)) == [(OP_BINARY, big)]
    assert time.perf_counter() - t < 1


def test_status_subresource_strict_decoding_and_access_review(cluster):
    store, api, ac = cluster
    co = client.CustomObjectsApi(ac)
    rc = co.create_namespaced_custom_object(**co_args(), body=raycluster("st"))
    status = {"state": "ready", "conditions": [{"type": "HeadPodReady", "status": "True", "reason": "HeadPodRunningAndReady",
                                                "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}
    out = co.patch_namespaced_custom_object_status(**co_args(), name="st",
                                                   body={"status": status, "spec": {"suspend": True}})
    assert out["status"]["state"] == "ready" and "suspend" not in out["spec"]  # /status changes only status
    out["status"]["state"] = "failed"
    out["spec"]["suspend"] = True
    kept = co.replace_namespaced_custom_object(**co_args(), name="st", body=out)
    assert kept["status"]["state"] == "ready" and kept["spec"]["suspend"] is True  # the main resource keeps status
    bad = dict(status, conditions=[{"type": "HeadPodReady", "status": "Maybe"}])
    with pytest.raises(ApiException) as e:
        co.patch_namespaced_custom_object_status(**co_args(), name="st", body={"status": bad})
    assert e.value.status == 422 and "status.conditions[0].message: Required value" in json.loads(e.value.body)["message"]

    typo = raycluster("strict")
    typo["spec"]["headGroupSpec"]["rayStartParms"] = {}
    status_code, doc = raw(api, "POST", "/apis/ray.io/v1/namespaces/default/rayclusters?fieldValidation=Strict",
                           json.dumps(typo).encode())
    assert status_code == 400 and doc["message"] == 'strict decoding error: unknown field "spec.headGroupSpec.rayStartParms"'
    assert rc["metadata"]["uid"] == store.get("rayclusters", "default", "st")["metadata"]["uid"]

    api.deny("admin", "create", "pods/portforward", "default")
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
              "spec": {"resourceAttributes": {"namespace": "default", "verb": "create", "resource": "pods",
                                              "subresource": "portforward"}}}
    _, doc = raw(api, "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", json.dumps(review).encode())
    assert doc["status"] == {"allowed": False}
    review["spec"]["resourceAttributes"]["verb"] = "get"
    _, doc = raw(api, "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", json.dumps(review).encode())
    assert doc["status"] == {"allowed": True}


def test_namespace_deletion_takes_its_content():
    store = Store()
    store.create("namespaces", {"metadata": {"name": "team"}})
    store.create("pods", {**pod("a"), "metadata": {"name": "a", "namespace": "team", "finalizers": ["x/y"]}})
    store.create("secrets", {"metadata": {"name": "s", "namespace": "team"}})
    store.delete("namespaces", "", "team")
    assert store.get("namespaces", "", "team")["status"]["phase"] == "Terminating"  # held by the pod's finalizer
    assert store.get("secrets", "team", "s") is None
    with pytest.raises(Exception, match="being terminated"):
        store.create("secrets", {"metadata": {"name": "t", "namespace": "team"}})
    store.patch("pods", "team", "a", {"metadata": {"finalizers": None}})
    assert store.get("pods", "team", "a") is None and store.get("namespaces", "", "team") is None
