"""The fake GKE's nodes: a scheduler, and a kubelet that runs every pod on this machine.

Scheduling is Kubernetes' filter for what tpulaunch's pods use: the node Ready and schedulable, its
taints tolerated, the `nodeSelector` matched, the requests (`google.com/tpu`, cpu, memory) within
what is left of its allocatable, and the required pod (anti-)affinity the TPU webhook writes (one
slice per node pool). The first node that fits takes the pod.

Running a pod: its own network namespace and IP on the cluster's bridge (`netns`), and for each of
its containers a process tree in a PID namespace of its own (`unshare --pid --fork --mount-proc
--uts`, as the fake gcloud runs a TPU VM's processes) with a mount namespace where the pod has its
own `/tmp`, `/dev/shm` and `/run` (tmpfs), its `/etc/hosts` (the fake's DNS: every service and pod
name of the cluster, rewritten as pods come and go) and its service account at
`/var/run/secrets/kubernetes.io/serviceaccount`. The "image" is this machine's Python environment
(`image_paths`: directories under /tmp, such as a fresh clone's .venv, are bound back into the
pod's /tmp). The environment is the container's, resolved as the kubelet does (`value`,
`$(VAR)`, `fieldRef`, `secretKeyRef`), plus the service variables of the API
(`KUBERNETES_SERVICE_HOST`), plus what GKE's TPU device plugin gives a container that got chips.

A container whose process ends is restarted under `restartPolicy: Always` (with backoff), else the
pod ends `Succeeded` or `Failed`. Readiness is the container's `httpGet` probe when it has one
(asked from this machine, at the pod's IP), else "running". A pod removed from the API is
stopped: SIGTERM to each container's first process, SIGKILL after its grace. A node shut down
(`shutdown_node`, a spot preemption) does what the kubelet's graceful node shutdown does: every
pod on it gets SIGTERM and `shutdown_grace_s`, then ends `Failed` with reason `Terminated`, the
message "Pod was terminated in response to imminent node shutdown." and a `DisruptionTarget`
condition (reason `TerminationByKubelet`).

Left out: liveness probes, exec probes (taken as passing), volumes other than what is named above,
resource limits (cgroups), image pulls.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import tpu
from .netns import Network, PodNet

DOMAIN = "cluster.local"
OWNER_ENV = "FAKE_GKE_POD"  # every process of a pod: "<the fake's pid>/<namespace>/<pod>"
# The API keeps a deleted pod (Terminating) until its kubelet has stopped its containers; the fake's
# kubelet holds its pods with this finalizer for that, and lets go once they are stopped.
FINALIZER = "fake-gke.tpulaunch.dev/kubelet"
SA_MOUNT = "/run/secrets/kubernetes.io/serviceaccount"  # /var/run is /run
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _cpu(q: str | int | float | None) -> float:
    if q is None:
        return 0.0
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _bytes(q: str | int | None) -> int:
    if q is None:
        return 0
    q = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "k": 10**3, "M": 10**6, "G": 10**9}
    for u in sorted(units, key=len, reverse=True):
        if q.endswith(u):
            return int(float(q[: -len(u)]) * units[u])
    return int(float(q))


def _requests(pod: dict) -> dict[str, float]:
    out = {"cpu": 0.0, "memory": 0.0, tpu.TPU: 0.0}
    for c in pod["spec"].get("containers") or []:
        res = c.get("resources") or {}
        req = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        out["cpu"] += _cpu(req.get("cpu"))
        out["memory"] += _bytes(req.get("memory"))
        out[tpu.TPU] += float(req.get(tpu.TPU, 0))
    return out


def _matches(labels: dict, selector: dict) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
        if op in ("Gt", "Lt") and not (k in labels and labels[k].lstrip("-").isdigit()
                                        and (int(labels[k]) > int(vals[0]) if op == "Gt" else int(labels[k]) < int(vals[0]))):
            return False
    return True


def _terminal(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _node_ready(node: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (node.get("status") or {}).get("conditions") or [])


def fits(pod: dict, node: dict, pods_on: dict[str, list[dict]], all_pods: list[dict], nodes: dict[str, dict]) -> bool:
    """Kubernetes' filter, for what tpulaunch's pods use (see the module docstring)."""
    spec = pod["spec"]
    if not _node_ready(node) or (node.get("spec") or {}).get("unschedulable"):
        return False
    for t in (node.get("spec") or {}).get("taints") or []:
        if t.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any((tol.get("key") in (None, "", t["key"]))
                   and (tol.get("operator") == "Exists" or tol.get("value") == t.get("value"))
                   and tol.get("effect") in (None, "", t["effect"]) for tol in spec.get("tolerations") or []):
            return False
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    if terms and not any(_matches(labels, {"matchExpressions": t.get("matchExpressions") or []}) for t in terms):
        return False  # the terms are ORed, each term's expressions ANDed
    alloc = (node.get("status") or {}).get("allocatable") or {}
    want = _requests(pod)
    used = {"cpu": 0.0, "memory": 0.0, tpu.TPU: 0.0}
    for p in pods_on.get(node["metadata"]["name"], []):
        for k, v in _requests(p).items():
            used[k] += v
    if want[tpu.TPU] and want[tpu.TPU] + used[tpu.TPU] > float(alloc.get(tpu.TPU, 0)):
        return False
    if want["cpu"] + used["cpu"] > _cpu(alloc.get("cpu", "1000")):
        return False
    if want["memory"] + used["memory"] > _bytes(alloc.get("memory", "1Ti")):
        return False
    aff = spec.get("affinity") or {}
    ns = pod["metadata"]["namespace"]
    placed = [(p, nodes.get(p["spec"].get("nodeName", ""))) for p in all_pods
              if p["spec"].get("nodeName") and not _terminal(p) and p["metadata"]["namespace"] == ns]
    for term in (aff.get("podAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or []:
        key = term["topologyKey"]
        peers = [(p, n) for p, n in placed if n is not None and _matches(p["metadata"].get("labels") or {}, term["labelSelector"])]
        if peers:
            if not any((n["metadata"].get("labels") or {}).get(key) == labels.get(key) for _p, n in peers):
                return False
        elif not _matches(pod["metadata"].get("labels") or {}, term["labelSelector"]):
            return False  # no peer anywhere, and the pod is not one itself: it waits
    for term in (aff.get("podAntiAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or []:
        key = term["topologyKey"]
        for p, n in placed:
            if n is not None and (n["metadata"].get("labels") or {}).get(key) == labels.get(key) \
                    and _matches(p["metadata"].get("labels") or {}, term["labelSelector"]):
                return False
    return True


@dataclass
class _Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exit_code: int | None = None
    next_start: float = 0.0
    started_at: str = ""


@dataclass
class _Pod:
    key: str  # ns/name
    uid: str
    net: PodNet
    dir: Path
    node: str
    init: list[_Container]
    main: list[_Container]
    probe: dict | None
    restart_policy: str
    grace_s: float
    phase: str = "Pending"
    ready: bool = False
    stopping: bool = False
    shutdown: bool = False  # ended by a node shutdown
    lock: threading.Lock = field(default_factory=threading.Lock)


class Kubelet:
    """Every node's kubelet, and the scheduler, in one thread (a pass every 0.2 s)."""

    def __init__(self, store, server, network: Network, state_dir: Path, *, image_paths: list[str],  # noqa: ANN001
                 shared_dirs: list[str] = (), image_env: dict[str, dict[str, str]] | None = None,
                 max_grace_s: float = 10.0, shutdown_grace_s: float = 3.0) -> None:
        self.store, self.server, self.net = store, server, network
        self.dir = state_dir / "pods"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs = state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.image_paths = [p for p in dict.fromkeys(str(Path(x).resolve()) for x in [*image_paths, *shared_dirs])]
        self.image_env = image_env or {}
        self.max_grace_s, self.shutdown_grace_s = max_grace_s, shutdown_grace_s
        self.pods: dict[str, _Pod] = {}
        self.errors: list[str] = []
        self._sa_tokens: dict[str, str] = {}
        from .dns import Dns

        self.dns = Dns(network.gateway)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._hosts_text = ""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=20)
        threads = [threading.Thread(target=self._kill, args=(p, 2.0)) for p in list(self.pods.values())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.dns.stop()

    # -- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
            except Exception:  # noqa: BLE001 - the fake's own bug: keep it, show it in the test
                import traceback

                self.errors.append(traceback.format_exc())
                if len(self.errors) > 50:
                    del self.errors[:25]
            self._stop.wait(0.2)

    def _pass(self) -> None:
        pods = self.store.list("pods", None)[0]
        nodes = {n["metadata"]["name"]: n for n in self.store.list("nodes", None)[0]}
        live = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in pods}
        for key, run in list(self.pods.items()):  # deleted (or made again under the same name)
            p = live.get(key)
            gone = p is None or p["metadata"]["uid"] != run.uid or bool(p["metadata"].get("deletionTimestamp"))
            if gone and not run.stopping:
                run.stopping = True
                threading.Thread(target=self._kill, args=(run, min(run.grace_s, self.max_grace_s)), daemon=True).start()
        for key, p in list(live.items()):  # deleted, stopped (or never run here): let the API remove it
            if p["metadata"].get("deletionTimestamp") and key not in self.pods:
                self._release(p)
                live.pop(key)
        pods_on: dict[str, list[dict]] = {}
        for p in pods:
            if p["spec"].get("nodeName") and not _terminal(p):
                pods_on.setdefault(p["spec"]["nodeName"], []).append(p)
        for p in pods:  # schedule
            if p["spec"].get("nodeName") or _terminal(p):
                continue
            for name in sorted(nodes):
                if fits(p, nodes[name], pods_on, pods, nodes):
                    p = self._bind(p, name)
                    if p is not None:
                        pods_on.setdefault(name, []).append(p)
                        live[f"{p['metadata']['namespace']}/{p['metadata']['name']}"] = p
                    break
        self._write_hosts(list(live.values()))
        for key, p in live.items():  # start what is bound here, follow what runs
            node = p["spec"].get("nodeName")
            if not node or _terminal(p) or p["metadata"].get("deletionTimestamp"):
                continue
            run = self.pods.get(key)
            if run is None or run.uid != p["metadata"]["uid"]:
                if run is not None:
                    continue  # the old one is still being stopped
                if node not in nodes:
                    continue
                self._start_pod(p, nodes[node])
                continue
            self._follow(run)

    def _release(self, pod: dict) -> None:
        fin = [f for f in pod["metadata"].get("finalizers") or [] if f != FINALIZER]
        if fin != (pod["metadata"].get("finalizers") or []):
            try:
                self.store.patch("pods", pod["metadata"]["namespace"], pod["metadata"]["name"],
                                 {"metadata": {"finalizers": fin or None}})
            except Exception:  # noqa: BLE001 - gone meanwhile, or changed: the next pass sees it
                pass

    def _bind(self, pod: dict, node: str) -> dict | None:
        pod["spec"]["nodeName"] = node
        pod["metadata"]["finalizers"] = [*(pod["metadata"].get("finalizers") or []), FINALIZER]
        st = pod.setdefault("status", {})
        st.setdefault("phase", "Pending")
        st["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]
        try:
            return self.store.replace("pods", pod)
        except Exception:  # noqa: BLE001 - changed meanwhile: the next pass tries again
            return None

    # -- pods -------------------------------------------------------------------------------------

    def _start_pod(self, pod: dict, node: dict) -> None:
        m = pod["metadata"]
        key = f"{m['namespace']}/{m['name']}"
        net = self.net.add_pod(key)
        d = self.dir / f"{m['namespace']}_{m['name']}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text(f"{net.ip} {pod['spec'].get('hostname') or m['name']}\n"
                                 + (self._hosts_text or "127.0.0.1 localhost\n"))
        (d / "resolv.conf").write_text(f"nameserver {self.net.gateway}\nsearch {m['namespace']}.svc.{DOMAIN} svc.{DOMAIN}"
                                       f" {DOMAIN}\noptions ndots:5\n")
        sa = pod["spec"].get("serviceAccountName") or "default"
        if pod["spec"].get("automountServiceAccountToken", True):
            token = self._sa_token(m["namespace"], sa)
            self.server.serviceaccount_dir(str(d / "sa"), token, m["namespace"])
        pod_ip, host_ip = net.ip, self.net.gateway
        status_env = {"status.podIP": pod_ip, "status.hostIP": host_ip}
        mk = lambda c: _Container(c["name"], self._argv(c), {})  # noqa: E731
        run = _Pod(key, m["uid"], net, d, node["metadata"]["name"],
                   [mk(c) for c in pod["spec"].get("initContainers") or []],
                   [mk(c) for c in pod["spec"]["containers"]],
                   (pod["spec"]["containers"][0].get("readinessProbe") or None),
                   pod["spec"].get("restartPolicy", "Always"),
                   float(pod["spec"].get("terminationGracePeriodSeconds", 30)))
        for spec_c, c in zip([*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]], [*run.init, *run.main]):
            c.env = self._env(pod, spec_c, node, status_env)
            c.argv = [_expand(a, c.env) for a in c.argv]
        self.pods[key] = run
        self._set_status(key, phase="Pending", pod_ip=pod_ip, host_ip=host_ip)
        threading.Thread(target=self._run_pod, args=(run,), daemon=True).start()

    def _sa_token(self, ns: str, sa: str) -> str:
        key = f"{ns}/{sa}"
        if key not in self._sa_tokens:
            import secrets

            tok = secrets.token_urlsafe(24)
            self._sa_tokens[key] = tok
            self.server.tokens[tok] = f"system:serviceaccount:{ns}:{sa}"
        return self._sa_tokens[key]

    @staticmethod
    def _argv(c: dict) -> list[str]:
        argv = list(c.get("command") or []) + list(c.get("args") or [])
        if not argv:
            raise ValueError(f"container {c['name']}: the fake's images have no entrypoint: give a command")
        return argv

    def _env(self, pod: dict, c: dict, node: dict, status_env: dict[str, str]) -> dict[str, str]:
        m = pod["metadata"]
        image = self.image_env.get(c.get("image", ""), {})
        env: dict[str, str] = {
            OWNER_ENV: f"{os.getpid()}/{m['namespace']}/{m['name']}",  # `sweep_stale_pods` finds them by it
            "PATH": os.pathsep.join([str(Path(os.sys.executable).parent), "/usr/local/sbin", "/usr/local/bin",
                                     "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
            "HOME": "/tmp/root",  # the fake image's home: in the pod's own /tmp
            "HOSTNAME": pod["spec"].get("hostname") or m["name"],
            "LANG": "C.UTF-8",
            "KUBERNETES_SERVICE_HOST": self.net.gateway, "KUBERNETES_SERVICE_PORT": str(self.server.port),
            "KUBERNETES_PORT": f"tcp://{self.net.gateway}:{self.server.port}",
            **image,
        }
        chips = tpu.container_chips(c)
        if chips:
            env.update(tpu.device_plugin_env(node["metadata"].get("labels") or {}, chips, self.net.gateway))
        fields = {"metadata.name": m["name"], "metadata.namespace": m["namespace"], "metadata.uid": m["uid"],
                  "spec.nodeName": node["metadata"]["name"], "spec.serviceAccountName":
                      pod["spec"].get("serviceAccountName") or "default", **status_env}
        for e in c.get("env") or []:
            name = e["name"]
            if "value" in e:
                env[name] = _expand(str(e.get("value") or ""), env)
                continue
            src = e.get("valueFrom") or {}
            if "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                mm = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
                env[name] = (m.get(mm.group(1)) or {}).get(mm.group(2), "") if mm else fields.get(path, "")
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                sec = self.store.get("secrets", m["namespace"], ref["name"]) or {}
                if "data" in sec and ref["key"] in sec["data"]:
                    env[name] = base64.b64decode(sec["data"][ref["key"]]).decode()
                elif ref["key"] in (sec.get("stringData") or {}):
                    env[name] = sec["stringData"][ref["key"]]
                elif not ref.get("optional"):
                    raise ValueError(f"pod {m['name']}: secret {ref['name']} has no key {ref['key']} (CreateContainerConfigError)")
        return env

    def _setup_script(self, run: _Pod, hostname: str) -> Path:
        """The pod's mount namespace (run inside `unshare`), then `exec` of the container's argv."""
        under_tmp = [p for p in self.image_paths if p == "/tmp" or p.startswith("/tmp/")]
        lines = ["set -e", f"hostname {hostname}",
                 "mount -t tmpfs -o mode=0755 tmpfs /run", "mkdir -p /run/host-tmp", "mount --rbind /tmp /run/host-tmp",
                 "mount -t tmpfs -o mode=1777 tmpfs /tmp", "mkdir -p /tmp/root"]
        for p in under_tmp:  # the image's (and the shared volumes') paths under /tmp, bound back
            rel = p[len("/tmp/"):]
            lines += [f"mkdir -p '/tmp/{rel}'", f"mount --rbind '/run/host-tmp/{rel}' '/tmp/{rel}'"]
        lines += ["umount -l /run/host-tmp", "rmdir /run/host-tmp",
                  "mount -t tmpfs -o mode=1777,size=512m tmpfs /dev/shm",
                  f"mount --bind '{run.dir}/hosts' /etc/hosts", f"mount --bind '{run.dir}/resolv.conf' /etc/resolv.conf"]
        if (run.dir / "sa").is_dir():
            lines += [f"mkdir -p {SA_MOUNT}", f"mount --bind '{run.dir}/sa' {SA_MOUNT}"]
        lines += ["cd /", 'exec "$@"']
        path = run.dir / "setup.sh"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _spawn(self, run: _Pod, c: _Container, log) -> subprocess.Popen:  # noqa: ANN001
        hostname = run.key.split("/", 1)[1]
        pod = self.store.get("pods", *run.key.split("/", 1))
        if pod is not None:
            hostname = pod["spec"].get("hostname") or hostname
        setup = self._setup_script(run, hostname[:63])
        argv = ["ip", "netns", "exec", run.net.netns, "unshare", "--pid", "--fork", "--mount-proc", "--uts",
                "--kill-child=SIGKILL", "--", "/bin/bash", str(setup), *c.argv]
        c.started_at = _now()
        return subprocess.Popen(argv, env=c.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd="/")

    def _run_pod(self, run: _Pod) -> None:
        log = open(self.logs / f"{run.key.replace('/', '_')}.log", "ab", buffering=0)
        try:
            for c in run.init:
                while not run.stopping:
                    log.write(f"--- init container {c.name} ---\n".encode())
                    c.proc = self._spawn(run, c, log)
                    c.exit_code = c.proc.wait()
                    if c.exit_code == 0 or run.stopping:
                        break
                    c.restarts += 1
                    time.sleep(min(2 ** c.restarts, 10))
                if run.stopping:
                    return
            with run.lock:
                if run.stopping:
                    return
                for c in run.main:
                    log.write(f"--- container {c.name} ---\n".encode())
                    c.proc = self._spawn(run, c, log)
                run.phase = "Running"
            self._set_status(run.key, phase="Running", started=True)
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{run.key}: {type(e).__name__}: {e}")
            self._set_status(run.key, phase="Failed", reason=type(e).__name__, message=str(e)[:200])
        finally:
            run.log = log  # type: ignore[attr-defined]

    def _follow(self, run: _Pod) -> None:
        """A container that ended (restart it, or end the pod); readiness."""
        if run.phase != "Running" or run.stopping:
            return
        ended = False
        for c in run.main:
            if c.proc is None:
                continue
            rc = c.proc.poll()
            if rc is None:
                continue
            c.exit_code = rc
            if run.shutdown:
                continue
            again = run.restart_policy == "Always" or (run.restart_policy == "OnFailure" and rc != 0)
            if again:
                if c.next_start == 0.0:
                    c.next_start = time.monotonic() + min(2 ** c.restarts, 10)
                elif time.monotonic() >= c.next_start:
                    c.restarts += 1
                    c.next_start = 0.0
                    with run.lock:
                        if not run.stopping:
                            c.proc = self._spawn(run, c, getattr(run, "log", subprocess.DEVNULL))
                ended = True
            else:
                ended = True
        if all(c.proc is not None and c.proc.poll() is not None for c in run.main) and run.restart_policy != "Always" \
                and not run.shutdown:
            codes = [c.exit_code for c in run.main]
            run.phase = "Succeeded" if all(x == 0 for x in codes) else "Failed"
            self._set_status(run.key, phase=run.phase, run=run)
            return
        ready = not ended and self._probe(run)
        if ready != run.ready or ended:
            run.ready = ready
            self._set_status(run.key, run=run)

    def _probe(self, run: _Pod) -> bool:
        probe = run.probe or {}
        get = probe.get("httpGet")
        if not get:
            return True  # exec probes, or none: running is ready
        url = f"http://{run.net.ip}:{get['port']}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=float(probe.get("timeoutSeconds", 2))) as r:  # noqa: S310
                return 200 <= r.status < 400
        except Exception:  # noqa: BLE001
            return False

    def _set_status(self, key: str, *, phase: str | None = None, pod_ip: str | None = None,
                    host_ip: str | None = None, started: bool = False, run: _Pod | None = None,
                    reason: str | None = None, message: str | None = None, disruption: bool = False) -> None:
        ns, name = key.split("/", 1)
        for _ in range(5):
            p = self.store.get("pods", ns, name)
            if p is None:
                return
            st = p.setdefault("status", {})
            if phase:
                st["phase"] = phase
            if pod_ip:
                st["podIP"], st["podIPs"], st["hostIP"] = pod_ip, [{"ip": pod_ip}], host_ip
            if started:
                st["startTime"] = _now()
            if reason:
                st["reason"] = reason
            if message:
                st["message"] = message
            run = run or self.pods.get(key)
            conds = {c["type"]: c for c in st.get("conditions") or []}
            if run is not None:
                ready = run.ready and run.phase == "Running" and not run.stopping
                for t in ("Initialized", "ContainersReady", "Ready"):
                    ok = "True" if (t == "Initialized" and run.phase in ("Running", "Succeeded", "Failed")) or ready else "False"
                    if conds.get(t, {}).get("status") != ok:
                        conds[t] = {"type": t, "status": ok, "lastTransitionTime": _now()}
                st["containerStatuses"] = [self._cstatus(c, ready) for c in run.main]
            if disruption:
                conds["DisruptionTarget"] = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                                             "message": SHUTDOWN_MESSAGE, "lastTransitionTime": _now()}
            st["conditions"] = list(conds.values())
            try:
                self.store.replace("pods", p)
                return
            except Exception:  # noqa: BLE001 - a concurrent write: read again
                continue

    @staticmethod
    def _cstatus(c: _Container, ready: bool) -> dict:
        alive = c.proc is not None and c.proc.poll() is None
        state = ({"running": {"startedAt": c.started_at}} if alive else
                 {"terminated": {"exitCode": c.exit_code if c.exit_code is not None else 0, "finishedAt": _now()}}
                 if c.proc is not None else {"waiting": {"reason": "PodInitializing"}})
        return {"name": c.name, "ready": ready and alive, "restartCount": c.restarts, "state": state,
                "image": "fake", "started": alive}

    # -- stopping ---------------------------------------------------------------------------------

    @staticmethod
    def _pid1(proc: subprocess.Popen) -> int | None:
        """The container's first process: unshare's child."""
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                kids = f.read().split()
            return int(kids[0]) if kids else None
        except (OSError, ValueError):
            return None

    def _terminate(self, run: _Pod, grace_s: float) -> None:
        procs = [c.proc for c in [*run.init, *run.main] if c.proc is not None and c.proc.poll() is None]
        for p in procs:
            pid = self._pid1(p)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # unshare: its child (the PID namespace's init) goes with it
                except ProcessLookupError:
                    pass
                p.wait()

    def _kill(self, run: _Pod, grace_s: float) -> None:
        run.stopping = True
        with run.lock:
            self._terminate(run, grace_s)
        self.net.remove_pod(run.key)
        shutil.rmtree(run.dir, ignore_errors=True)
        self.pods.pop(run.key, None)
        pod = self.store.get("pods", *run.key.split("/", 1))
        if pod is not None and pod["metadata"]["uid"] == run.uid and pod["metadata"].get("deletionTimestamp"):
            self._release(pod)

    def shutdown_node(self, node: str) -> list[str]:
        """The kubelet's graceful node shutdown: every pod on `node` gets SIGTERM and
        `shutdown_grace_s`, then ends Failed (Terminated, DisruptionTarget). Returns the pods."""
        ended = []
        runs = [r for r in self.pods.values() if r.node == node and not r.stopping]
        for r in runs:
            r.shutdown = True
        threads = [threading.Thread(target=self._terminate, args=(r, self.shutdown_grace_s)) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in runs:
            r.phase = "Failed"
            r.ready = False
            self._set_status(r.key, phase="Failed", reason="Terminated", message=SHUTDOWN_MESSAGE, run=r, disruption=True)
            ended.append(r.key)
            r.stopping = True
            self.net.remove_pod(r.key)
            self.pods.pop(r.key, None)
        return ended

    # -- DNS --------------------------------------------------------------------------------------

    def _write_hosts(self, pods: list[dict]) -> None:
        """Every pod's /etc/hosts: the cluster's service and pod names (the fake's DNS)."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 f"{self.net.gateway} kubernetes kubernetes.default kubernetes.default.svc"
                 f" kubernetes.default.svc.{DOMAIN}"]
        running = [p for p in pods if (p.get("status") or {}).get("podIP") and not _terminal(p)]
        for svc in self.store.list("services", None)[0]:
            sm = svc["metadata"]
            sel = (svc.get("spec") or {}).get("selector") or {}
            if not sel:
                continue
            base = f"{sm['name']}.{sm['namespace']}"
            for p in running:
                if p["metadata"]["namespace"] != sm["namespace"] or not all(
                        (p["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items()):
                    continue
                ip = p["status"]["podIP"]
                lines.append(f"{ip} {base}.svc.{DOMAIN} {base}.svc {base} {sm['name']}")
                if p["spec"].get("hostname") and p["spec"].get("subdomain") == sm["name"]:
                    h = p["spec"]["hostname"]
                    lines.append(f"{ip} {h}.{base}.svc.{DOMAIN} {h}.{base}.svc {h}.{base} {h}.{sm['name']}")
        for p in running:
            lines.append(f"{p['status']['podIP']} {p['metadata']['name']}")
        text = "\n".join(lines) + "\n"
        if text == self._hosts_text:
            return
        records: dict[str, list[str]] = {}
        for line in lines:
            ip, *names = line.split()
            if ":" in ip:
                continue
            for n in names:
                if "." in n or n in ("kubernetes",):
                    records.setdefault(n, [])
                    if ip not in records[n]:
                        records[n].append(ip)
        self.dns.set(records)
        self._hosts_text = text
        own = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in running}
        for run in list(self.pods.values()):
            self._write_pod_hosts(run, own.get(run.key))

    def _write_pod_hosts(self, run: _Pod, pod: dict | None) -> None:
        """A pod's /etc/hosts: its own name first (as the kubelet writes it: `<hostname>.<subdomain>...`
        and the bare hostname), then the cluster's names."""
        first = ""
        if pod is not None:
            h = pod["spec"].get("hostname") or pod["metadata"]["name"]
            sub = pod["spec"].get("subdomain")
            ns = pod["metadata"]["namespace"]
            fq = f"{h}.{sub}.{ns}.svc.{DOMAIN} " if sub else ""
            first = f"{run.net.ip} {fq}{h}\n"
        path = run.dir / "hosts"
        try:
            with open(path, "r+") as f:  # in place: the pod's /etc/hosts is a bind mount of this inode
                f.seek(0)
                f.write(first + self._hosts_text)
                f.truncate()
        except OSError:
            pass


def sweep_stale_pods() -> list[int]:
    """SIGKILL every process of a pod whose fake GKE's process is gone (a test process killed hard:
    its pods' process trees run in sessions of their own). Returns the pids."""
    killed = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        mark = next((e for e in env if e.startswith(OWNER_ENV.encode() + b"=")), None)
        if mark is None:
            continue
        owner = mark.split(b"=", 1)[1].split(b"/", 1)[0].decode()
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            try:
                os.kill(int(d), signal.SIGKILL)
                killed.append(int(d))
            except OSError:
                pass
    return killed


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (`$$` escapes; an unknown name stays as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)
