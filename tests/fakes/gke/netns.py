"""Pod networks for the fake GKE: every pod its own network namespace and IP, on one bridge.

As on a GKE node, each pod has an address of its own: Ray's fixed ports (the head's 6379 and 8265,
every node's 8080 metrics and 52365 dashboard agent, which KubeRay puts on every pod) never meet
another pod's, nor another test's cluster. The bridge (`tk<pid>`, with the cluster's gateway
address) joins the pods' veths; the host side of it is where the fake API server is reached from a
pod (its `KUBERNETES_SERVICE_HOST`). Names carry the owning process's pid, so a sweep
(`sweep_stale`) removes what a killed test process left behind. Needs root (CAP_NET_ADMIN), as the
fake gcloud's PID namespaces do.
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import threading
from dataclasses import dataclass

PREFIX = "tk"  # bridges `tk<pid>x<n>`, namespaces `tk<pid>x<n>-<i>`, host veths `tk<pid>x<n>v<i>`


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"fake GKE: `ip {' '.join(args)}` failed: {proc.stderr.strip()}"
                           " (the fake needs root and iproute2 for its pod networks)")
    return proc


def _used_subnets() -> set[ipaddress.IPv4Network]:
    out = _ip("-o", "-4", "addr", "show").stdout
    nets = set()
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", out):
        nets.add(ipaddress.ip_network(m.group(1), strict=False))
    return nets


_COUNT = [0]
_LOCK = threading.Lock()


@dataclass
class PodNet:
    """One pod's network: its namespace name and address."""

    netns: str
    ip: str
    veth: str


class Network:
    """A bridge and a /24 of 10.x.y.0 for one fake cluster's pods."""

    def __init__(self) -> None:
        with _LOCK:
            _COUNT[0] += 1
            n = _COUNT[0]
        self.tag = f"{PREFIX}{os.getpid()}x{n}"
        if len(self.tag) > 11:  # interface names are at most 15 bytes (veth `<tag>v<i>`)
            self.tag = f"{PREFIX}{os.getpid() % 100000}x{n % 100}"
        used = _used_subnets()
        for third in range(200, 255):
            for fourth in range(0, 256):
                net = ipaddress.ip_network(f"10.{third}.{fourth}.0/24")
                if not any(net.overlaps(u) for u in used):
                    break
            else:
                continue
            break
        else:
            raise RuntimeError("fake GKE: no free 10.x.y.0/24 for the pods")
        self.subnet = net
        hosts = list(net.hosts())
        self.gateway = str(hosts[0])
        self._free = [str(h) for h in hosts[1:]]
        self._next = 0
        self.pods: dict[str, PodNet] = {}
        _ip("link", "add", self.tag, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.tag)
        _ip("link", "set", self.tag, "up")

    def add_pod(self, key: str) -> PodNet:
        """A namespace with `eth0` on the bridge, `lo` up, a default route through the gateway."""
        with _LOCK:
            i = self._next
            self._next += 1
            ip = self._free.pop(0)
        ns, veth = f"{self.tag}-{i}", f"{self.tag}v{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.tag, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        pod = PodNet(ns, ip, veth)
        self.pods[key] = pod
        return pod

    def remove_pod(self, key: str) -> None:
        pod = self.pods.pop(key, None)
        if pod is None:
            return
        _ip("netns", "del", pod.netns, check=False)  # its eth0 goes with it, and the veth pair with that
        _ip("link", "del", pod.veth, check=False)
        with _LOCK:
            self._free.append(pod.ip)

    def close(self) -> None:
        for key in list(self.pods):
            self.remove_pod(key)
        _ip("link", "del", self.tag, check=False)


def sweep_stale() -> list[str]:
    """Remove the bridges and namespaces of fake clusters whose process is gone; what was removed."""
    removed = []
    pat = re.compile(rf"^{PREFIX}(\d+)x\d+")
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = pat.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = pat.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed
