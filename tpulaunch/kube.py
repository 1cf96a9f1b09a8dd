"""The Kubernetes API: the one module that talks to it (one module per external system).

Through the official client (`kubernetes`, the one kubectl's own Python counterpart), configured as
kubectl is: `--kubeconfig`, else `KUBECONFIG`, else `~/.kube/config`; `--context`; `--namespace`,
else the context's, else `default`; and in a pod with no kubeconfig, the pod's service account
(in-cluster config). Objects come back as plain dicts (the API's JSON), never the client's models:
what the rest of tpulaunch reads is data, and the fake API in the tests serves exactly that JSON.

Every call is bounded (`TPULAUNCH_KUBE_TIMEOUT`, default 15 s), and every failure is one line:
no kubeconfig or no such context, the API unreachable, credentials refused (401), forbidden by RBAC
(403, naming the verb and resource to ask for), a resource the API does not serve (KubeRay's CRD
not installed). `Forward` is a local port whose connections reach a pod's port through the API's
port-forward (WebSocket, as the client speaks it): no kubectl on this machine.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpulaunch import settings
from tpulaunch.errors import ClusterError, DiscoveryError

TIMEOUT_ENV = "TPULAUNCH_KUBE_TIMEOUT"
DEFAULT_TIMEOUT = 15.0
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # where a pod's service account is mounted
RAY_GROUP, RAY_VERSION, RAYCLUSTERS = "ray.io", "v1", "rayclusters"


class KubeError(DiscoveryError):
    """The Kubernetes API could not be used (no config, unreachable, refused)."""


class KubeForbidden(KubeError):
    """The API said 403: the identity lacks an RBAC permission."""


class KubeNotServed(ClusterError):
    """The API does not serve a resource tpulaunch needs (KubeRay's CRD is not installed)."""


class KubeConflict(ClusterError):
    """The object exists already (409)."""


@dataclass(frozen=True)
class KubeTarget:
    """Which cluster and namespace: what `--kubeconfig`, `--context`, `--namespace` say (None: kubectl's default)."""

    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None

    def to_dict(self) -> dict:
        return {"kubeconfig": self.kubeconfig, "context": self.context, "namespace": self.namespace}


def timeout_s() -> float:
    return settings.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT)


def in_pod() -> bool:
    """Running in a Kubernetes pod with a service account (what in-cluster config needs)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (SA_DIR / "token").exists()


def _kubeconfig_file(target: KubeTarget) -> str | None:
    """The kubeconfig kubectl would read, or None (then only in-cluster config can work): KUBECONFIG's
    files that exist, joined as it lists them (the client merges them as kubectl does: the first to
    set a value wins), else ~/.kube/config."""
    if target.kubeconfig:
        if not Path(target.kubeconfig).is_file():
            raise KubeError(f"--kubeconfig {target.kubeconfig[:200]} is not a file", "give the path of a kubeconfig")
        return target.kubeconfig
    found = [x for x in os.environ.get("KUBECONFIG", "").split(os.pathsep) if x and Path(x).is_file()]
    if found:
        return os.pathsep.join(found)
    home = Path.home() / ".kube" / "config"
    return str(home) if home.is_file() else None


def _kubeconfig_docs(path: str) -> list[dict]:
    """The kubeconfig files of `path` (os.pathsep-joined), read; one that cannot be is left to the
    client, which says what is wrong with it."""
    import yaml

    docs = []
    for f in path.split(os.pathsep):
        try:
            doc = yaml.safe_load(Path(f).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


def _current_context(docs: list[dict]) -> str | None:
    """kubectl's current context of the kubeconfig files: the first file's that sets one (the
    client's merge of several takes the last one's)."""
    return next((str(d["current-context"]) for d in docs if d.get("current-context")), None)


def _check_exec_plugin(docs: list[dict], name: str | None) -> None:
    """KubeError (one line) when the context's user gets its credentials from a program that is not on
    PATH (GKE's `gke-gcloud-auth-plugin`): the client would only log it, and the API's 401 would send
    the user to refresh credentials that were never the problem."""
    import shutil

    ctx = next((c.get("context") or {} for d in docs for c in d.get("contexts") or [] if c.get("name") == name), {})
    user = next((u.get("user") or {} for d in docs for u in d.get("users") or [] if u.get("name") == ctx.get("user")),
                {})
    command = str((user.get("exec") or {}).get("command") or "")
    if command and shutil.which(command) is None:
        raise KubeError(f"the kubeconfig's user {ctx.get('user')} gets its credentials from {command}, which is"
                        " not on PATH",
                        "install it (`gcloud components install gke-gcloud-auth-plugin`), or put it on PATH")


def connect(target: KubeTarget) -> Kube:
    """The API the target names, configured as kubectl would be; one line (KubeError) if it cannot be."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    path = _kubeconfig_file(target)
    try:
        if path is None:
            if target.context:
                raise KubeError(f"--context {target.context} given but there is no kubeconfig (KUBECONFIG,"
                                " ~/.kube/config)", "point --kubeconfig at the file that has that context")
            if not in_pod():
                raise KubeError("no kubeconfig (--kubeconfig, KUBECONFIG, ~/.kube/config) and not in a pod",
                                "run `gcloud container clusters get-credentials CLUSTER --location L` first,"
                                " or pass --kubeconfig")
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            namespace = target.namespace or _sa_namespace()
            where = f"the in-cluster API ({cfg.host})"
        else:
            cfg = client.Configuration()
            docs = _kubeconfig_docs(path)
            context = target.context or _current_context(docs)
            _check_exec_plugin(docs, context)
            config.load_kube_config(config_file=path, context=context, client_configuration=cfg,
                                    persist_config=False)
            _contexts, active = config.list_kube_config_contexts(config_file=path)
            if context:
                active = next((c for c in _contexts if c["name"] == context), active)
            namespace = target.namespace or (active or {}).get("context", {}).get("namespace") or "default"
            where = f"the Kubernetes API at {cfg.host} (context {(active or {}).get('name', '?')})"
    except ConfigException as e:
        raise KubeError(f"the kubeconfig cannot be used: {str(e).splitlines()[0][:200]}",
                        "check --kubeconfig / --context (`kubectl config get-contexts` lists them)") from None
    cfg.retries = False  # one attempt per call, bounded by our own timeout: no silent minutes of retries
    check_namespace(namespace)
    return Kube(client.ApiClient(cfg), namespace, where)


def _sa_namespace() -> str:
    try:
        return (SA_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


def check_namespace(ns: str) -> None:
    """A namespace name as Kubernetes takes one (RFC 1123 label): one line, exit 2, otherwise."""
    import re

    from tpulaunch.errors import TpulaunchError

    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", ns):
        raise TpulaunchError(f"--namespace {ns[:70]!r} is not a namespace name",
                             "use lower-case letters, digits and dashes (at most 63)")


# Which RBAC words a call needs, for the 403 line: (verb, resource).
Kind = tuple[str, str, str, bool]  # (api path prefix, plural, kind, namespaced)
KINDS: dict[str, Kind] = {
    "Node": ("/api/v1", "nodes", "Node", False),
    "Pod": ("/api/v1", "pods", "Pod", True),
    "Event": ("/api/v1", "events", "Event", True),
    "Service": ("/api/v1", "services", "Service", True),
    "Secret": ("/api/v1", "secrets", "Secret", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", "ServiceAccount", True),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", "Role", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", False),
    "RayCluster": (f"/apis/{RAY_GROUP}/{RAY_VERSION}", RAYCLUSTERS, "RayCluster", True),
}


class Kube:
    """One Kubernetes API and namespace. Every method returns the API's JSON as dicts."""

    def __init__(self, api_client: Any, namespace: str, where: str) -> None:
        self.api = api_client
        self.namespace = namespace
        self.where = where

    # -- the one request path ---------------------------------------------------------------------

    def _send(self, method: str, path: str, query: dict | None, body: Any, content_type: str,
              timeout: float | None) -> Any:
        """The HTTP exchange (the client's serializer, auth and TLS); the client's response."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            m, url, hdrs, data, _post = self.api.param_serialize(
                method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
                auth_settings=["BearerToken"])
            resp = self.api.call_api(m, url, header_params=hdrs, body=data, _request_timeout=timeout or timeout_s())
            resp.read()
            return resp
        except KubeError:
            raise
        except Exception as e:  # urllib3's connection errors, timeouts, TLS
            raise KubeError(f"{self.where} cannot be reached: {_reason(e)}",
                            "check the cluster's endpoint and your network (`kubectl cluster-info`)") from None

    def request(self, method: str, path: str, *, query: dict | None = None, body: Any = None,
                content_type: str = "application/json", what: str = "", timeout: float | None = None,
                verb: str | None = None) -> Any:
        """One call: the decoded JSON (None for 404 on GET/DELETE), or one line (KubeError and kin).
        `verb`: the RBAC verb the call needs, when the method does not say it (list)."""
        import json

        resp = self._send(method, path, query, body, content_type, timeout)
        if resp.status == 404 and method in ("GET", "DELETE"):
            return None
        if resp.status >= 300:
            raise self._error(resp.status, resp.data, method, what or path, verb)
        return json.loads(resp.data) if resp.data else None

    def _error(self, status: int, body: bytes | None, method: str, what: str, verb: str | None = None) -> Exception:
        import json

        try:
            message = json.loads(body or b"{}").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        message = str(message).splitlines()[0][:240] if message else ""
        if status == 401:
            return KubeError(f"{self.where} refused the credentials (401 Unauthorized)",
                             "refresh them: `gcloud container clusters get-credentials CLUSTER --location L`")
        if status == 403:
            verbs = {"GET": "get", "POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}
            verb = verb or verbs[method]
            return KubeForbidden(f"forbidden by RBAC: {message or what}",
                                 f"ask your cluster admin for '{verb}' on {what} in namespace {self.namespace}")
        if status == 404:
            return KubeNotServed(f"{self.where} does not serve {what}: {message}", "")
        if status == 409:
            return KubeConflict(f"{what} exists already: {message}", "")
        return KubeError(f"{self.where} answered {status} to {method} {what}: {message}", "")

    def _path(self, kind: str, name: str | None = None, namespaced: bool | None = None) -> str:
        prefix, plural, _kind, ns = KINDS[kind]
        base = f"{prefix}/namespaces/{self.namespace}/{plural}" if (ns if namespaced is None else namespaced) else \
            f"{prefix}/{plural}"
        return f"{base}/{name}" if name else base

    # -- reads ------------------------------------------------------------------------------------

    def list(self, kind: str, selector: str | None = None, *, all_namespaces: bool = False,
             fields: str | None = None) -> list[dict]:
        """Every object of `kind` (in the namespace) matching the label selector (and field selector)."""
        query = {"labelSelector": selector} if selector else {}
        if fields:
            query["fieldSelector"] = fields
        path = self._path(kind, namespaced=False if all_namespaces else None)
        doc = self.request("GET", path, query=query, what=KINDS[kind][1], verb="list") or {}
        return list(doc.get("items") or [])

    def get(self, kind: str, name: str) -> dict | None:
        return self.request("GET", self._path(kind, name), what=f"{KINDS[kind][1]}/{name}")

    def rayclusters_served(self) -> None:
        """KubeNotServed (one line) unless the API serves KubeRay's `rayclusters` in ray.io/v1."""
        doc = self.request("GET", f"/apis/{RAY_GROUP}/{RAY_VERSION}", what="ray.io/v1")
        if not doc or not any(r.get("name") == RAYCLUSTERS for r in doc.get("resources") or []):
            raise KubeNotServed(f"{self.where} does not serve ray.io/v1 rayclusters: KubeRay's CRD is not installed",
                                "install the KubeRay operator (helm install kuberay-operator kuberay/kuberay-operator)"
                                " or enable GKE's Ray add-on (--addons=RayOperator)")

    # -- writes -----------------------------------------------------------------------------------

    def create(self, obj: dict) -> dict:
        kind = obj["kind"]
        return self.request("POST", self._path(kind), body=obj, what=f"{KINDS[kind][1]}/{obj['metadata']['name']}")

    def patch(self, kind: str, name: str, patch: dict) -> dict:
        return self.request("PATCH", self._path(kind, name), body=patch, content_type="application/merge-patch+json",
                            what=f"{KINDS[kind][1]}/{name}")

    def delete(self, kind: str, name: str) -> bool:
        """Delete (background propagation: what it owns goes with it); False if it was not there."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        return self.request("DELETE", self._path(kind, name), body=body, what=f"{KINDS[kind][1]}/{name}") is not None

    # -- port-forward -----------------------------------------------------------------------------

    def allowed(self, verb: str, resource: str, subresource: str = "") -> bool:
        """This identity may `verb` `resource`[/`subresource`] in the namespace (a SelfSubjectAccessReview)."""
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"namespace": self.namespace, "verb": verb, "resource": resource,
                                                  "subresource": subresource}}}
        doc = self.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body=review,
                           what="selfsubjectaccessreviews") or {}
        return bool((doc.get("status") or {}).get("allowed"))

    def forward(self, pod: str, port: int) -> Forward:
        """A local port reaching `port` of `pod` through the API (see `Forward`). KubeForbidden first
        when RBAC refuses port-forwards: each connection through it would fail, and the job API
        would be waited for as if the head were still starting."""
        if not self.allowed("create", "pods", "portforward"):
            raise KubeForbidden(f"forbidden by RBAC: port-forward to pod {pod} (the Ray head's job API)",
                                f"ask your cluster admin for 'create' on pods/portforward in namespace {self.namespace}"
                                ", or run tpulaunch in a pod of the cluster")
        return Forward(self, pod, port)


def _reason(e: BaseException) -> str:
    text = str(getattr(e, "reason", "") or e)
    for marker in ("Connection refused", "timed out", "Name or service not known", "CERTIFICATE_VERIFY_FAILED",
                   "No route to host"):
        if marker in text:
            return marker.lower()
    return (type(e).__name__ + ": " + text.splitlines()[0])[:160] if text else type(e).__name__


class Forward:
    """A port on 127.0.0.1 whose every connection reaches `port` of `pod`: each accepted connection
    gets a port-forward of its own over the API's WebSocket (`kubernetes.stream.portforward`), and
    bytes are copied both ways until either side closes. A thread of this process serves it; it
    lives until `close()` (or the process's end)."""

    def __init__(self, kube: Kube, pod: str, port: int) -> None:
        self.kube, self.pod, self.remote_port = kube, pod, port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self.errors: list[str] = []
        threading.Thread(target=self._accept, name=f"tpulaunch-forward-{pod}:{port}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        from kubernetes import client
        from kubernetes.stream import portforward

        try:
            core = client.CoreV1Api(self.kube.api)
            pf = portforward(core.connect_get_namespaced_pod_portforward, self.pod, self.kube.namespace,
                             ports=str(self.remote_port), _request_timeout=timeout_s())
            remote = pf.socket(self.remote_port)
        except Exception as e:  # the pod went away, RBAC, ...: this connection fails, the next may not
            self.errors.append(_reason(e))
            conn.close()
            return
        remote.setblocking(True)
        try:
            _pump(conn, remote._socket if hasattr(remote, "_socket") else remote, self._closed)
        finally:
            conn.close()
            try:
                remote.close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass


def _pump(a: socket.socket, b: socket.socket, closed: threading.Event) -> None:
    """Copy bytes both ways until one side closes (then the other is shut for writing)."""
    open_ = {a: b, b: a}
    while open_ and not closed.is_set():
        r, _, _ = select.select(list(open_), [], [], 1.0)
        for s in r:
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:
                peer = open_.pop(s)
                try:
                    peer.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                if peer not in open_:
                    return
                continue
            try:
                open_[s].sendall(data)
            except OSError:
                return
