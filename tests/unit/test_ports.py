"""Ports chosen for processes started later: one launcher never hands out the same port twice.

A cold run picks its MASTER_PORT, then starts its cluster's nodes with 9 ports each; none of
those is bound when the next is chosen, so "free now" alone cannot keep them apart.
"""

from __future__ import annotations

import socket

from tpulaunch.cluster import ports


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(monkeypatch):
    # a range of 31 ports: 20 picks at random from it would repeat one almost surely
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOWEST + 31)
    monkeypatch.setattr(ports, "_handed_out", set())
    got = [ports.free_port() for _ in range(20)]
    assert len(set(got)) == 20, got
    assert all(ports.LOWEST <= p < ports.LOWEST + 31 for p in got)
    # the range used up: the kernel's bind(0) gives the rest, still none handed out before
    more = ports.free_ports(15)
    assert len(set(more)) == 15 and not set(more) & set(got)


def test_a_port_someone_holds_is_not_handed_out(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOWEST + 31)
    monkeypatch.setattr(ports, "_handed_out", set())
    held = []
    try:
        for port in range(ports.LOWEST, ports.LOWEST + 31, 2):  # every other port of the range is taken
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()  # someone else holds it already: just as good
                continue
            held.append(s)
        got = ports.free_ports(3)
        assert not {s.getsockname()[1] for s in held} & set(got)
    finally:
        for s in held:
            s.close()
