"""Step rates and stragglers (`run.steps`, `AttemptWatch.stragglers`), the host's step report
(`tpulaunch.heartbeat(step=N)`), and which agents `tpulaunch stacks` picks (`run.stacks.pick`)."""

from __future__ import annotations

import time

import pytest

from tpulaunch.errors import LaunchError
from tpulaunch.host import context
from tpulaunch.host.agent import HostAgent
from tpulaunch.host.protocol import AgentInfo, HostRun, PollReply
from tpulaunch.run import watch as W
from tpulaunch.run.stacks import pick
from tpulaunch.run.steps import StepRates
from tpulaunch.run.summary import HostResult


def feed(rates: StepRates, per_s: list[float], seconds: int, t0: float = 0.0) -> float:
    """Each host steps at its rate for `seconds`, sampled once a second."""
    steps = [0.0] * len(per_s)
    for t in range(seconds + 1):
        for i, r in enumerate(per_s):
            steps[i] = r * t
            rates.record(i, int(steps[i]), t0 + t)
    return t0 + seconds


def test_hosts_at_the_same_pace_have_no_straggler():
    r = StepRates(4)
    now = feed(r, [2.0, 2.0, 2.0, 2.0], 30)
    assert r.stragglers(0.7, now, {0, 1, 2, 3}) == ([], [])
    assert r.rate(0, now) == pytest.approx(2.0, rel=0.05)


def test_a_slow_host_is_named_once_then_back_to_pace():
    r = StepRates(4)
    now = feed(r, [2.0, 2.0, 0.5, 2.0], 30)
    new, back = r.stragglers(0.7, now, {0, 1, 2, 3})
    assert [s.process for s in new] == [2] and back == []
    assert new[0].rate == pytest.approx(0.5, rel=0.1) and new[0].median == pytest.approx(2.0, rel=0.05)
    assert r.stragglers(0.7, now + 1, {0, 1, 2, 3}) == ([], [])  # said once, not every check
    # it catches up: a window later it runs at the others' pace
    base = {i: r.last(i) for i in range(4)}
    for t in range(1, 130):
        for i in range(4):
            r.record(i, base[i] + 2 * t, now + t)
    assert r.stragglers(0.7, now + 129, {0, 1, 2, 3}) == ([], [2])


def test_a_host_that_stops_reporting_decays_to_a_straggler():
    r = StepRates(3)
    now = feed(r, [1.0, 1.0, 1.0], 20)
    assert r.stragglers(0.7, now, {0, 1, 2}) == ([], [])
    for t in range(1, 31):  # host 1 is stopped (SIGSTOP): no new step for 30 s
        r.record(0, 20 + t, now + t)
        r.record(2, 20 + t, now + t)
    new, _ = r.stragglers(0.7, now + 30, {0, 1, 2})
    assert [s.process for s in new] == [1]


def test_no_verdict_on_too_few_steps_or_one_host_or_ratio_zero():
    r = StepRates(2)
    now = feed(r, [0.1, 0.02], 30)  # the median host made 1-3 steps: too little to judge
    assert r.stragglers(0.7, now, {0, 1}) == ([], [])
    r = StepRates(2)
    now = feed(r, [2.0, 0.5], 30)
    assert r.stragglers(0.0, now, {0, 1}) == ([], [])
    assert r.stragglers(0.7, now, {0}) == ([], [])  # a lone host has nobody to fall behind
    assert [s.process for s in r.stragglers(0.7, now, {0, 1})[0]] == [1]


def test_hosts_that_never_report_steps_are_not_judged():
    r = StepRates(3)
    now = feed(r, [2.0, 2.0], 30)  # host 2 never calls heartbeat(step=...)
    assert r.rate(2, now) is None and r.stragglers(0.7, now, {0, 1, 2}) == ([], [])


def test_the_attempt_rate_is_first_step_to_last():
    r = StepRates(1)
    r.record(0, 10, 100.0)
    r.record(0, 10, 101.0)  # a repeat is no news
    r.record(0, 40, 110.0)
    assert r.overall(0) == pytest.approx(3.0) and r.last(0) == 40


def _reply(step: int | None, line: str = "") -> PollReply:
    return PollReply(lines=(("stdout", line),) if line else (), code=None, wall_s=1.0, ended=None, activity=0.0,
                     step=step)


def test_the_watch_names_the_straggler_with_its_last_line_and_keeps_rates_per_host():
    hosts = [HostResult(i, 0, i) for i in range(3)]
    w = W.AttemptWatch(0, hosts, W.StopRules(straggler_ratio=0.7), 0.0)
    w.on_reply(2, _reply(None, "loading shard 17"), 0.0, 0.0)
    for t in range(31):
        for i, pace in enumerate((2, 2, 1)):
            w.on_reply(i, _reply(pace * t), float(t), float(t))
    (line,) = w.stragglers(30.0)
    assert line.startswith("host 2 is a straggler: ") and "0.50x the median" in line and "at step 30" in line
    assert line.endswith("its last line: loading shard 17")
    assert [h.step for h in hosts] == [60, 60, 30]
    assert [round(h.step_rate, 2) for h in hosts] == [2.0, 2.0, 1.0]
    view = w.view(30.0)
    assert [v.step for v in view] == [60, 60, 30] and view[2].step_rate == pytest.approx(1.0, rel=0.05)
    off = W.AttemptWatch(0, [HostResult(i, 0, i) for i in range(3)], W.StopRules(straggler_ratio=0.0), 0.0)
    for t in range(31):
        for i, pace in enumerate((2, 2, 1)):
            off.on_reply(i, _reply(pace * t), float(t), float(t))
    assert off.stragglers(30.0) == []


def test_heartbeat_step_is_what_the_agent_reads(tmp_path, monkeypatch):
    beat = tmp_path / "beat"
    beat.write_text("")
    monkeypatch.setenv(context.HEARTBEAT_ENV, str(beat))
    for name, value in (("_beat_fd", None), ("_beat_t", 0.0), ("_saved", None), ("_first", None)):
        monkeypatch.setattr(context, name, value)
    agent = HostAgent.__new__(HostAgent)  # only its file reading, no actor
    agent._heartbeat = str(beat)
    assert agent._step() == {}  # the script reported no step
    context.heartbeat(step=7)
    got = agent._step()
    assert got["step"] == 7 and got["first_step"][0] == 7 and "checkpoint" not in got
    context.heartbeat(step=123456)
    context.heartbeat()  # a plain beat keeps the step
    assert agent._step()["step"] == 123456
    context.heartbeat(step=8)  # shorter number: the old digits do not survive
    assert agent._step()["step"] == 8
    time.sleep(0.05)
    context.heartbeat(step=8, checkpoint=True)  # the save of step 8 took the time since the last beat
    context.heartbeat(step=9)
    got = agent._step()
    assert got["step"] == 9 and got["first_step"][0] == 7
    step, save_s, age = got["checkpoint"]
    assert step == 8 and 0.04 <= save_s < 1.0 and 0 <= age < 1.0
    assert 0 <= got["step_age"] < 1.0 and got["first_step"][1] >= age  # ages: seconds ago, as the agent reads them


def _info(run: str | None, attempt: int = 0, index: int = 0, hosts: int = 2) -> AgentInfo:
    r = HostRun(run, attempt, index, hosts, "/runs/" + run) if run else None
    return AgentInfo(node_id="n", node_ip="127.0.0.1", hostname="h", labels={}, pid=1, run=r)


def test_stacks_picks_the_run_going_on_and_its_latest_attempt():
    agents = [("a0", _info("r1", 0, 0)), ("a1", _info("r1", 1, 1)), ("a2", _info("r1", 1, 0)), ("x", _info(None))]
    run, attempt, mine = pick(agents, "last")
    assert (run, attempt, [h for h, _ in mine]) == ("r1", 1, ["a2", "a1"])
    assert pick(agents, "r1")[0] == "r1"
    with pytest.raises(LaunchError, match="run r2 has no host running on this cluster .runs going on: r1"):
        pick(agents, "r2")
    with pytest.raises(LaunchError, match="2 runs are going on: r1, r3"):
        pick(agents + [("b", _info("r3"))], "last")
    with pytest.raises(LaunchError, match="no run is going on"):
        pick([("x", _info(None))], "last")
