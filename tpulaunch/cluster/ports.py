"""Ports for processes this machine starts later (Ray nodes, coordinators), chosen so none is taken
before its owner binds it.

A port found free by `bind(0)` comes from the kernel's ephemeral range, the range every outgoing
TCP connection also takes its source port from. Between choosing such a port and binding it, any
connection on the machine (Ray's many gRPC clients, a test suite) can take it: "address already
in use" (seen: a gloo coordinator port, and raylets started in parallel). Ports below the
ephemeral range are never handed out that way, so a port free there now stays free until bound,
unless someone else asks for that very number, or this process itself does: a cold run chooses
its MASTER_PORT before it starts its cluster's nodes, 9 ports each (seen: a 16-host cluster took
the run's port, and the preflight refused the run). So a port handed out here is not handed out
again by this process.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000  # below it: well-known and registered services
# Ports a host process binds at fixed numbers, never to hand out: torch_tpu's MASTER_PORT and its
# compiled-collective handshake (plan/torch_tpu.py; its 8070+ and 8080+ are below LOWEST)
_handed_out: set[int] = {29500, 36423}  # ports this process promised already (their owners may not have bound them yet)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now and not handed out before, outside the ephemeral range (falling
    back to bind(0))."""
    top = _ephemeral_low()
    out: list[int] = []
    if top - LOWEST > 10 * n:
        for port in random.sample(range(LOWEST, top), min(top - LOWEST, 50 * n)):
            if port not in _handed_out and _is_free(port):
                out.append(port)
                if len(out) == n:
                    break
    socks = []
    try:
        while len(out) < n:
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
            if s.getsockname()[1] not in out and s.getsockname()[1] not in _handed_out:
                out.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    _handed_out.update(out)
    return out


def free_port() -> int:
    return free_ports(1)[0]
