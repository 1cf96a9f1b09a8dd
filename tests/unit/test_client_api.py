"""The Python API's typed records: a summary read back is the summary written, a status's attempts
are the supervisor's, a RunSpec is the keywords. Pure (no cluster)."""

from __future__ import annotations

import json

import pytest

import tpulaunch
from tpulaunch.client import AttemptStatus, RunSpec, _request, _spec
from tpulaunch.providers.base import Recreation
from tpulaunch.run.hang import Hang, Place
from tpulaunch.run.summary import Attempt, Cause, HostResult, Outcome, RunSummary, attempts_brief


def _summary() -> RunSummary:
    hosts = [HostResult(0, 0, 0, exit_code=0, reason="exit 0", cause=Cause.EXITED, step=9, phases={"boot_s": 0.1}),
             HostResult(1, 1, 0, exit_code=None, lost=True, preempted="slice b: PREEMPTED", cause=Cause.PREEMPTED,
                        went_with=None)]
    first = Attempt(0, Outcome.PREEMPTED, 75, hosts, "/r/attempt-0", first_failure=hosts[1], note="slice b preempted",
                    recreated=[Recreation("b", "b", "node PREEMPTED", {"create_s": 1.5}, ["join refused"])],
                    hang=Hang({0: Place("python", "f (a.py:1)")}, (0,), "f (a.py:1)", "all_reduce", "hang: ...", (0,)),
                    replaced=[{"slice": "b", "how": "spare s", "seconds": 0.01}], slices=["a", "b"])
    last = Attempt(1, Outcome.OK, 0, [HostResult(0, 0, 0, exit_code=0)], "/r/attempt-1", reason="preemption",
                   slices=["a", "s"])
    return RunSummary("r1", 0, True, [{"name": "a"}], {"shape": [2]}, last.hosts, None, "/r", 12.5,
                      attempts=[first, last], preemptions=1, note="done")


def test_a_summary_read_back_is_the_summary_written():
    s = _summary()
    doc = json.loads(json.dumps(s.to_dict()))
    back = RunSummary.from_dict(doc)
    assert back.to_dict() == s.to_dict()
    assert back.attempts[0].hang.culprits == (0,) and back.attempts[0].recreated[0].join_failures == ["join refused"]
    assert back.attempts[0].first_failure.cause is Cause.PREEMPTED and back.outcome is Outcome.OK


def test_a_summary_of_another_schema_is_refused():
    with pytest.raises(ValueError, match="not a tpulaunch.summary/v2 document"):
        RunSummary.from_dict({**_summary().to_dict(), "schema": "tpulaunch.summary/v1"})


def test_a_statuss_attempts_are_the_supervisors():
    brief = attempts_brief(_summary().attempts)
    typed = [AttemptStatus.of(a) for a in brief]
    assert [t.to_dict() for t in typed] == [dict(a) for a in brief]
    assert typed[0].hang["culprits"] == [0] and typed[1].reason == "preemption"


def test_a_runspec_is_the_keywords():
    by_keywords = _request(_spec("t.py", ["--x", "1"], {"A": "b"}, "2x8", "v5e", 2, None, "data=2",
                                 {"max_restarts": 1}), None)
    by_spec = _request(_spec(RunSpec("t.py", ("--x", "1"), {"A": "b"}, "2x8", "v5e", 2, None, "data=2",
                                     {"max_restarts": 1}), (), None, None, None, None, None, None, {}), None)
    assert by_keywords == by_spec and by_spec.max_restarts == 1 and by_spec.env == ("A=b",)


@pytest.mark.parametrize("call, says", [
    (lambda: _spec(RunSpec("t.py"), ["--x"], None, None, None, None, None, None, {}), "a RunSpec was given with keywords"),
    (lambda: _spec("t.py", "--x 1", None, None, None, None, None, None, {}), "args is one string"),
    (lambda: _request(RunSpec("t.py", options={"max_restart": 1}), None), "unknown option(s) max_restart"),
])
def test_a_spec_that_cannot_be_run_is_one_line(call, says):
    with pytest.raises(tpulaunch.TpulaunchError) as e:
        call()
    assert says in e.value.line() and e.value.exit_code == tpulaunch.ExitCode.USAGE


def test_the_public_names_load():
    assert tpulaunch.RunState.RUNNING.terminal is False and tpulaunch.WaitTimeout.exit_code == 124
    assert {tpulaunch.Client, tpulaunch.RunSummary, tpulaunch.launch}
    with pytest.raises(AttributeError):
        tpulaunch.NoSuchName  # noqa: B018 - the module's lazy names are exactly its list
