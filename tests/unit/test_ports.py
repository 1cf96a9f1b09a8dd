"""Ports chosen for processes started later: one launcher never hands out the same port twice,
nor one another launcher of this user claimed lately.

A cold run picks its MASTER_PORT, then starts its cluster's nodes with 9 ports each; none of
those is bound when the next is chosen, so "free now" alone cannot keep them apart.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest

from tpulaunch.cluster import ports


@pytest.fixture(autouse=True)
def own_claims(tmp_path, monkeypatch):
    """Claims in a directory of this test's: other launchers on this machine claim ports too."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"tpulaunch-{os.getuid()}-ports"


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


def test_a_port_another_launcher_claimed_lately_is_not_handed_out_but_a_stale_claim_is_taken_over(monkeypatch, own_claims):
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports.random, "sample", lambda population, k: list(population)[:k])  # in order
    first = ports.LOWEST
    while not all(ports._is_free(p) for p in (first, first + 1)):
        first += 2
    monkeypatch.setattr(ports, "LOWEST", first)
    own_claims.mkdir(mode=0o700)
    (own_claims / str(first)).write_text("")  # another launcher's, just now
    assert ports.free_port() == first + 1
    assert (own_claims / str(first + 1)).exists()  # this launcher's claim, for the next one to see
    monkeypatch.setattr(ports, "_handed_out", set())
    os.utime(own_claims / str(first + 1), (time.time() - ports.CLAIM_TTL_S - 1,) * 2)  # long since bound, or never
    assert ports.free_port() == first + 1
    assert time.time() - (own_claims / str(first + 1)).stat().st_mtime < 60  # claimed anew


@pytest.mark.parametrize("kind", ["symlink", "writable by others", "a file"])
def test_a_claims_directory_that_is_not_the_users_own_is_not_used(tmp_path, own_claims, kind):
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        own_claims.symlink_to(tmp_path / "elsewhere")
    elif kind == "writable by others":
        own_claims.mkdir()
        own_claims.chmod(0o777)
    else:
        own_claims.write_text("")
    assert ports._claims_dir() is None
    assert len(set(ports.free_ports(3))) == 3  # ports are still chosen, by this process alone


def test_the_agent_port_ray_start_would_leave_to_the_agent_is_chosen_ahead(monkeypatch):
    """`worker_start`: for each agent port `ray start` leaves at 0 a port is chosen before the raylet
    starts (so it need not wait for the agent to say it): free, and below the ephemeral range."""
    from tpulaunch.cluster import worker_start
    from tpulaunch.cluster.worker_start import free_low_port

    port = free_low_port()
    assert ports.LOWEST <= port < ports._ephemeral_low() and ports._is_free(port)
    # the agents' ports of one node, chosen one after the other, are never the same port
    monkeypatch.setattr(worker_start, "ephemeral_low", lambda: worker_start.LOWEST_PORT + 3)
    monkeypatch.setattr(worker_start, "port_is_free", lambda _port: True)
    taken: set[int] = set()
    for _ in range(3):
        taken.add(free_low_port(taken))
    assert taken == {worker_start.LOWEST_PORT, worker_start.LOWEST_PORT + 1, worker_start.LOWEST_PORT + 2}
    assert free_low_port(taken) == 0  # none left: the agent chooses (the raylet waits)


def test_a_raylet_waits_100_s_for_its_runtime_env_agent_unless_the_environment_says(monkeypatch):
    """`worker_start.patient_agents`: Ray's `agent_register_timeout_ms` (30 s) raised to 100 s for
    the raylets a node start makes; a value the deployment set is kept."""
    from tpulaunch.cluster import worker_start

    monkeypatch.delenv("RAY_agent_register_timeout_ms", raising=False)
    worker_start.patient_agents()
    assert os.environ["RAY_agent_register_timeout_ms"] == "100000"
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "600000")
    worker_start.patient_agents()
    assert os.environ["RAY_agent_register_timeout_ms"] == "600000"
