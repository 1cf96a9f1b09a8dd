"""The decisions of one attempt (`run.watch.AttemptWatch`) and who is blamed (`run.summary`)."""

from __future__ import annotations

import signal

import pytest

from tpulaunch.host.protocol import PollReply
from tpulaunch.procfs import exit_reason
from tpulaunch.run.summary import Cause, HostResult, Outcome, exit_code_for, first_failure
from tpulaunch.run.watch import (AttemptWatch, StopAll, StopOthers, StopRules, innermost_frame,
                                 where_hosts_are)


def watch(n: int = 4, **rules) -> AttemptWatch:
    w = AttemptWatch(0, [HostResult(i, 0, i) for i in range(n)], StopRules(**rules), now=0.0)
    w.started(1000.0)
    return w


def reply(code=None, lines=(), activity=0.0, ended=None, preempted=None) -> PollReply:
    return PollReply(lines=tuple(("stdout", t) for t in lines), code=code, wall_s=1.0, ended=ended,
                     activity=activity, preempted=preempted)


def test_a_host_that_exits_nonzero_stops_the_others_once():
    w = watch()
    assert w.on_reply(0, reply(lines=["hi"]), 1, 1001) is None
    act = w.on_reply(2, reply(code=3, ended=1002.0), 2, 1002)
    assert act == StopOthers("host 2 exit 3: stopping the other hosts", (0, 1, 3))
    assert w.on_reply(1, reply(code=143, ended=1003.0), 3, 1003) is None  # stopped: no second fail fast
    for i in (0, 3):
        w.on_reply(i, reply(code=143, ended=1003.0), 3, 1003)
    a = w.result("/l", 3.0, {})
    assert (a.outcome, a.exit_code, a.first_failure.process_index) == (Outcome.FAILED, 3, 2)
    assert a.first_failure.cause is Cause.EXITED and a.hosts[1].cause is Cause.STOPPED


def test_all_exit_zero_is_ok():
    w = watch(2)
    for i in range(2):
        w.on_reply(i, reply(code=0, ended=1001.0), 1, 1001)
    a = w.result("/l", 1.0, {})
    assert (a.outcome, a.exit_code, a.first_failure) == (Outcome.OK, 0, None)


def test_a_lost_host_is_blamed_before_peers_that_ended_after_it_went_quiet():
    """Host 1's node dies at t=1005 (last heard); hosts 0 and 2 fail in the next collective at 1006."""
    w = watch(3)
    for i in range(3):
        w.on_reply(i, reply(lines=["step"]), 5, 1005)
    w.on_reply(0, reply(code=1, ended=1006.0), 6, 1006)
    w.on_reply(2, reply(code=1, ended=1006.0), 6, 1006)
    w.on_gone(1, Cause.NODE_LOST, "node lost")
    a = w.result("/l", 6.0, {})
    assert (a.outcome, a.exit_code) == (Outcome.LOST, 75)
    assert (a.first_failure.process_index, a.first_failure.reason) == (1, "node lost")


def test_preemption_notice_stops_the_others_with_the_preemption_grace():
    w = watch(2, preemption_grace_s=45.0)
    act = w.on_reply(1, reply(lines=["tpulaunch: preemption notice"], preempted="preemption notice"), 1, 1001)
    assert act == StopOthers("host 1 is preempted (preemption notice): stopping the other hosts", (0,), 45.0)
    w.on_reply(1, reply(code=0, ended=1010.0), 2, 1010)  # saved its checkpoint and left in its grace
    w.on_reply(0, reply(code=143, ended=1010.0), 2, 1010)
    a = w.result("/l", 10.0, {})
    assert a.outcome is Outcome.PREEMPTED and a.exit_code == 75
    assert a.first_failure.reason == "preempted: preemption notice, then exit 0"


def test_timeout_and_stall_and_signal():
    w = watch(2, deadline=100.0, stall_timeout_s=20.0)
    assert w.check(10.0, None) is None
    w.on_reply(0, reply(lines=["x"]), 15.0, 1015)  # host 0 printed at t=15; host 1 quiet since 0
    assert w.check(25.0, None) is None  # host 0 printed 10 s ago: not every host is stalled
    assert w.check(35.0, None) == StopAll(Outcome.STALLED, "no output or heartbeat from any host for 20 s",
                                          (0, 1), dump_stacks=True)
    w2 = watch(2, deadline=100.0)
    assert w2.check(100.0, None).outcome is Outcome.TIMEOUT
    w3 = watch(2)
    act = w3.check(1.0, signal.SIGTERM)
    assert act.outcome is Outcome.INTERRUPTED and "SIGTERM" in act.why
    a = w3.result("/l", 1.0, {})
    assert (a.exit_code, a.signal) == (143, "SIGTERM")


def test_a_heartbeat_counts_as_activity():
    w = watch(1, stall_timeout_s=20.0)
    w.on_reply(0, reply(activity=5.0), 19.0, 1019)  # no line, but the heartbeat file moved
    assert w.check(30.0, None) is None
    w.on_reply(0, reply(activity=5.0), 30.0, 1030)  # the same stamp again: no new sign of life
    assert w.check(39.5, None) is not None


def test_the_head_is_lost_after_three_refused_probes_in_a_row():
    w = watch(3)
    assert w.on_head_probe(False, 0) is None
    assert w.on_head_probe(True, 0) is None  # an answer resets the count
    assert w.on_head_probe(False, 0) is None and w.on_head_probe(False, 0) is None
    act = w.on_head_probe(False, 0)
    assert act.head_lost and act.outcome is Outcome.LOST and not w.pending
    a = w.result("/l", 1.0, {})
    assert a.first_failure.process_index == 0 and a.first_failure.cause is Cause.HEAD_LOST
    assert a.hosts[2].reason == "stopped by tpulaunch (the Ray head was lost)"


@pytest.mark.parametrize("code, text", [(3, "exit 3"), (137, "killed by signal 9 (SIGKILL)"),
                                        (143, "killed by signal 15 (SIGTERM)"), (0, "exit 0"), (255, "exit 255")])
def test_exit_reason(code, text):
    assert exit_reason(code) == text


def test_exit_codes_follow_the_readme_table():
    h = HostResult(0, 0, 0, exit_code=7)
    assert exit_code_for(Outcome.FAILED, h) == 7
    assert exit_code_for(Outcome.FAILED, None) == 1
    assert exit_code_for(Outcome.OK, None) == 0
    assert exit_code_for(Outcome.LOST, h) == exit_code_for(Outcome.PREEMPTED, h) == 75
    assert exit_code_for(Outcome.TIMEOUT, h) == exit_code_for(Outcome.STALLED, h) == 124
    assert exit_code_for(Outcome.INTERRUPTED, None, signal.SIGINT) == 130
    assert exit_code_for(Outcome.INTERRUPTED, None, signal.SIGTERM) == 143


def test_first_failure_ignores_hosts_tpulaunch_stopped_and_breaks_ties_by_index():
    hosts = [HostResult(0, 0, 0, exit_code=143, ended_at=5.0, stopped_by_tpulaunch=True),
             HostResult(1, 0, 1, exit_code=2, ended_at=6.0), HostResult(2, 0, 2, exit_code=9, ended_at=6.0)]
    assert first_failure(hosts).process_index == 1


DUMP = """Process 1234: python -m tpulaunch.host.bootstrap /tmp/x.pkl
Python v3.11.7 (/usr/bin/python3.11)

Thread 1234 (idle): "MainThread"
    wait_forever (/home/u/hang.py:5)
    <module> (/home/u/hang.py:7)
    run_path (<frozen runpy>:291)
Thread 1240 (idle): "Thread-1"
    wait (threading.py:320)
"""


def test_stack_dumps_are_summed_up_by_where_each_host_is():
    assert innermost_frame(DUMP) == "wait_forever (hang.py:5)"
    assert innermost_frame("(the host process had already ended)") == "an unknown place (no Python stack)"
    line = where_hosts_are({0: DUMP, 1: DUMP.replace("wait_forever", "barrier"), 3: DUMP})
    assert line == "hosts 0,3: in wait_forever (hang.py:5); host 1: in barrier (hang.py:5)"


def test_an_agent_lost_with_its_node_is_blamed_on_the_node_with_the_reason_ray_recorded():
    """`fleet.why_agent_died` / `node_death` on Ray 2.60's own words for an actor whose node died."""
    from tpulaunch.run.fleet import node_death, why_agent_died

    said = ("The actor died unexpectedly before finishing this task.\n\tclass_name: HostAgent\n"
            "The actor died because its node has died. Node Id: e5794f2b\n"
            "\tthe actor's node was terminated unexpectedly: Raylet could not connect to Runtime Env Agent\n"
            "The actor never ran - it was cancelled before it started running.")
    err = RuntimeError(said)
    assert why_agent_died(err) == (Cause.NODE_LOST, "node lost")
    assert node_death(err) == "Raylet could not connect to Runtime Env Agent"
    assert why_agent_died(RuntimeError("The actor died unexpectedly")) == (Cause.AGENT_DIED, "agent died")
    assert node_death(RuntimeError("The actor died unexpectedly")) is None


@pytest.mark.parametrize("since,probed,now,want", [
    ({0: 10.0, 1: 10.0}, {}, 11.4, []),                   # within the renewal (1 s) and OVERDUE_S (0.5 s)
    ({0: 10.0, 1: 11.0}, {}, 11.6, [0]),                  # host 0 is 1.6 s silent, host 1 0.6 s
    ({0: 10.0, 1: 9.0}, {}, 12.5, [1, 0]),                # the longest silent first
    ({0: 10.0, 1: 9.0}, {1: 12.0}, 12.5, [0]),            # host 1 was probed half a second ago
    ({0: 10.0, 1: 9.0}, {1: 11.4}, 12.5, [1, 0]),         # ... and again once a second has passed
    ({0: 10.0, 2: 5.0}, {}, 12.5, [0]),                   # host 2 has no poll in flight (it ended)
])
def test_a_poll_overdue_past_its_renewal_gets_its_node_probed(since, probed, now, want):
    from tpulaunch.run.fleet import overdue

    assert overdue(since, {0, 1}, now, 1.0, probed) == want
    assert overdue(since, {0, 1}, now, 1.0, probed, limit=1) == want[:1]


def test_a_node_that_refuses_connections_is_lost_at_once_and_only_that_one(monkeypatch):
    """A silent host whose raylet's port refuses connections is gone (`node lost`) without waiting
    for Ray's health checks; one whose raylet listens (a slow reply) is not, nor is anything Ray says
    of the gone host afterwards (its late poll)."""
    import concurrent.futures
    import socket
    import time

    import ray

    from fakes import closed_port
    from tpulaunch.host.protocol import PollReply
    from tpulaunch.run.fleet import Gone, RayFleet, Reply, probe, refused

    listening = socket.create_server(("127.0.0.1", 0))
    alive, dead = f"127.0.0.1:{listening.getsockname()[1]}", f"127.0.0.1:{closed_port()}"
    waited = []
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: waited.append(refs) or (refs, []))

    class Handle:  # an agent's handle as the fleet uses it: `release.remote(...)` gives a reference
        def __init__(self, name):
            self.name, self.release = name, self

        def remote(self, prewarm):
            return f"release of {self.name}"

    def fleet_of(raylets, head=""):
        fleet = RayFleet([Handle(0), Handle(1)], raylets, head=head)
        fleet._in_flight, fleet._listening = {0, 1}, {0, 1}  # what `start` leaves: both raylets accepted then
        fleet._unanswered_since = {0: time.monotonic() - 1.2, 1: time.monotonic() - 1.2}  # within 1 s + 0.5 s
        return fleet

    def late(fleet, host, code=None):  # a poll of `host` completes: its reply (or Ray's error) is queued
        fut = concurrent.futures.Future()
        fut.set_result(PollReply(lines=(), code=code, wall_s=1.0, ended=None, activity=0.0))
        fleet._queue.put((host, fut, time.time(), time.monotonic()))

    try:
        assert not refused(alive) and refused(dead)
        assert probe([alive, dead, "localhost:1", ""]) == [True, False, None, None]  # no name is looked up
        fleet = fleet_of([alive, dead])
        assert fleet.events(0.01) == []  # neither poll is overdue yet
        time.sleep(0.4)
        assert fleet.events(0.01) == [Gone(1, Cause.NODE_LOST, "node lost")]
        assert fleet._probed.keys() == {0, 1} and 1 in fleet._done and 0 not in fleet._done
        late(fleet, 1)  # Ray's word on host 1, late: dropped
        assert fleet.events(0.01) == []
        fleet.release(None)  # the gone host's agent is not asked: Ray would answer only once its node is declared dead
        assert waited == [["release of 0"]]
        # a reply that came while the probe ran says how the host ended: it wins over the probe
        fleet = fleet_of([alive, dead])
        fleet._unanswered_since[1] -= 1.0
        monkeypatch.setattr(fleet, "_probe_overdue", lambda now, answered=(): late(fleet, 1, code=0) or {1})
        got = fleet.events(0.01)
        assert [(type(e), e.host) for e in got] == [(Reply, 1)] and got[0].reply.code == 0 and not fleet._gone
        # a raylet that refused from the start (a firewall that rejects, another machine) is never probed
        fleet = fleet_of([alive, dead])
        fleet._listening = {0}
        fleet._unanswered_since[1] -= 1.0
        assert fleet.events(0.01) == [] and 1 not in fleet._probed
        # with the head gone as well, the head's probe names the loss (`head node lost`), not this one
        fleet = fleet_of([alive, dead], head=dead)
        fleet._unanswered_since[1] -= 1.0
        assert fleet.events(0.01) == [] and not fleet._done
        fleet.head = alive
        fleet._probed.clear()
        assert fleet.events(0.01) == [Gone(1, Cause.NODE_LOST, "node lost")]
    finally:
        listening.close()


def test_spare_agents_are_not_warmed_from_a_process_without_ray():
    """`warm_agents` from a thread that outlived the run's Ray connection: nothing asked, and no Ray
    started to answer (Ray's calls start a cluster of their own when none is connected)."""
    import ray

    from tpulaunch.host.agent import warm_agents

    assert warm_agents([("tpu-1", 0), ("tpu-1", 1)]) == 0
    assert not ray.is_initialized()
