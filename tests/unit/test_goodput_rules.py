"""Goodput from a run's timeline (`run/goodput.py`), the timeline's sampling (`run/timeline.py`) and
the Chrome trace (`run/trace.py`): pure, on synthetic timelines whose right answer is known."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tpulaunch.run.record import goodput, timeline
from tpulaunch.run.record.trace import chrome_trace

STEP_S, SAVE_S = 0.1, 0.2


def scenario(hosts: int = 2, with_steps: bool = True, ckpt: bool = True) -> list[dict]:
    """The issue's run: saves every 20 steps, fails at step 50, resumes from 40, ends at 70."""
    ev = [{"t": 0.0, "kind": "run_start", "run_id": "r"}, {"t": 0.0, "kind": "cluster_start", "how": "start"},
          {"t": 5.0, "kind": "cluster_ready", "how": "start"}]
    t = 5.0
    for attempt, (first, last) in enumerate(((1, 50), (41, 70))):
        ev.append({"t": t, "kind": "attempt_start", "attempt": attempt})
        ev += [{"t": t + 0.1, "kind": "preflight_start", "attempt": attempt},
               {"t": t + 0.4, "kind": "preflight_end", "attempt": attempt, "ok": True}]
        t += 0.5
        ev += [{"t": t, "kind": "host_start", "attempt": attempt, "host": h, "prewarmed": False} for h in range(hosts)]
        t += 2.0  # imports and the first compile
        for step in range(first, last + 1):
            t += STEP_S  # heartbeat(step=N) once step N is done
            if with_steps:
                ev += [{"t": t, "kind": "step", "attempt": attempt, "host": h, "step": step,
                        **({"first": True} if step == first else {})} for h in range(hosts)]
            if step % 20 == 0:
                t += SAVE_S
                if with_steps and ckpt:
                    ev += [{"t": t, "kind": "checkpoint", "attempt": attempt, "host": h, "step": step, "save_s": SAVE_S}
                           for h in range(hosts)]
        failed = attempt == 0
        ev += [{"t": t, "kind": "host_end", "attempt": attempt, "host": h, "step": last if with_steps else None,
                "exit_code": 3 if failed else 0, "failed": failed} for h in range(hosts)]
        t += 0.7  # stopping the others, or the exit
        ev.append({"t": t, "kind": "attempt_end", "attempt": attempt, "outcome": "failed" if failed else "ok",
                   "exit_code": 3 if failed else 0, "host": 0 if failed else None})
        t += 0.3
    ev.append({"t": t + 1.0, "kind": "run_end", "outcome": "ok", "exit_code": 0})
    return ev


def test_the_buckets_add_up_and_name_the_redone_steps():
    g = goodput.analyze(scenario())
    b = g.buckets
    assert sum(b.values()) == pytest.approx(g.wall_s, abs=1e-6)
    assert b["cluster_start"] == pytest.approx(5.0) and b["preflight"] == pytest.approx(0.3)
    assert b["startup_to_first_step"] == pytest.approx(2.0)  # a step's time before the first report is the step's
    # steps 41..50 of attempt 0 were redone: 10 steps' time (no save among them)
    assert b["wasted_progress"] == pytest.approx(10 * STEP_S, rel=0.02)
    # the 70 unique steps, saves apart; the saves that counted: 20 and 40 (attempt 0), 60 (attempt 1)
    assert b["productive"] == pytest.approx(70 * STEP_S, rel=0.02)
    assert b["checkpoint"] == pytest.approx(3 * SAVE_S, rel=0.02)
    # from the failure at step 50 to attempt 1's first step: the stop, the relaunch, its start-up
    assert b["recovery"] == pytest.approx(0.7 + 0.3 + 0.5 + 2.0, rel=0.02)
    assert [a["resume_step"] for a in g.attempts] == [40, None]
    assert g.goodput == pytest.approx(b["productive"] / g.wall_s)
    doc = g.to_dict()
    assert doc["schema"] == "tpulaunch.goodput/v1" and set(doc["buckets"]) == set(goodput.BUCKETS)
    assert g.line().startswith("goodput 32%: productive 7.0 s of 21.6 s") and not g.ongoing


def test_without_checkpoint_marks_the_next_attempts_first_step_is_the_resume_point():
    g = goodput.analyze(scenario(ckpt=False))
    assert [a["resume_step"] for a in g.attempts] == [40, None]
    assert g.buckets["checkpoint"] == 0.0 and g.buckets["wasted_progress"] == pytest.approx(10 * STEP_S + SAVE_S, rel=0.05)


def test_a_script_without_heartbeats_gets_the_coarse_buckets_and_says_what_it_could_not_see():
    g = goodput.analyze(scenario(with_steps=False))
    b = g.buckets
    assert sum(b.values()) == pytest.approx(g.wall_s, abs=1e-6)
    assert b["productive"] == 0.0 and b["script"] > 0 and b["recovery"] > 0
    assert "heartbeat(step=N)" in g.unseen["productive"] and "wasted_progress" in g.unseen
    # not "goodput 0%": the steps' time is in `script`, unsplit
    assert g.goodput is None and g.to_dict()["goodput"] is None
    assert g.line().startswith("goodput unknown: the script reported no step (`tpulaunch.heartbeat(step=N)`"
                               " counts them); 21.6 s in all (script ")
    going = goodput.analyze([e for e in scenario(with_steps=False) if e["t"] < 9.0], now=9.0)
    assert going.line().startswith("goodput so far unknown: no step reported yet (")


def test_a_run_going_on_counts_up_to_now():
    ev = [e for e in scenario() if e["kind"] != "run_end" and e["t"] < 12.0]
    g = goodput.analyze(ev, now=12.0)
    assert g.ongoing and g.wall_s == pytest.approx(12.0) and "so far" in g.line()
    assert sum(g.buckets.values()) == pytest.approx(12.0, abs=1e-6)


def test_a_million_steps_cost_kilobytes(tmp_path):
    path = tmp_path / "events.jsonl"
    tl = timeline.Timeline(path)
    steps = 1_000_000
    for step in range(0, steps, 100):  # a poll every 100 steps (1 s) of a 0.01 s step
        tl.on_step(0, 0, SimpleNamespace(step=step, step_age=0.0, first_step=(0, 0.0), checkpoint=None),
                   t=1000.0 + step * 0.01)
    tl.attempt_over(0)
    assert path.stat().st_size < 64 * 1024, path.stat().st_size
    ev = timeline.read(path)
    assert ev[0]["step"] == 0 and ev[0].get("first") and ev[-1]["step"] == steps - 100  # first and last kept


def test_the_trace_is_chrome_json_with_a_track_per_host():
    doc = json.loads(json.dumps(chrome_trace(scenario(hosts=3))))
    tracks = {e["tid"] for e in doc["traceEvents"]}
    assert tracks == {0, 1, 2, 3}  # the launcher and three hosts
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"attempt 0", "attempt 1", "start-up", "steps", "preflight"} <= names
    assert any(e["ph"] == "C" for e in doc["traceEvents"]) and any(e["name"] == "checkpoint 40" for e in doc["traceEvents"])
    assert all(e["dur"] >= 0 for e in doc["traceEvents"] if e["ph"] == "X")


def test_a_saves_time_counts_back_from_when_its_reply_came_not_when_the_loop_read_it(tmp_path):
    """The watch hands the timeline the reply's arrival (`fleet.Reply.at`): a supervise loop busy with
    other hosts' lines for a while must not move a save later, which shrank the steps redone after
    a failure below the time they slept (0.417 s for 10 steps of 0.05 s, seen under load)."""
    from tpulaunch.host.protocol import PollReply
    from tpulaunch.run.summary import HostResult
    from tpulaunch.run.watch import AttemptWatch, StopRules

    tl = timeline.Timeline(tmp_path / "events.jsonl")
    w = AttemptWatch(0, [HostResult(0, 0, 0)], StopRules(), now=0.0)
    w.on_step = lambda host, reply, at: tl.on_step(0, host, reply, at)
    saved = PollReply(lines=(), code=None, wall_s=1.0, ended=None, activity=0.0, step=45, step_age=0.1,
                      first_step=(1, 2.0), checkpoint=(40, 0.1, 0.35))
    w.on_reply(0, saved, 5.0, 1000.0)  # it came at 1000.0; the loop reads it later, whenever that is
    ckpt = [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines()) if e["kind"] == "checkpoint"]
    assert [(e["step"], e["t"]) for e in ckpt] == [(40, 999.65)]
