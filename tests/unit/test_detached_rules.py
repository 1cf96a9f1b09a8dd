"""Detached runs' pure rules: a run's state from the job API and its status file, the request across
the job boundary, the supervisor's command line."""

from __future__ import annotations

import json
import shlex

import pytest

from tpulaunch.cluster.jobs import JobInfo
from tpulaunch.discover import SliceRequest
from tpulaunch.errors import TpulaunchError
from tpulaunch.run.detached import (read_request_document, request_document, request_uri, run_exit_code, run_state,
                                    supervisor_entrypoint)
from tpulaunch.run.prepare import LaunchRequest
from tpulaunch.run.status import RunState, RunView


def job(status: str, exit_code=None, error_type=None) -> JobInfo:
    return JobInfo("r1", status, "x", "", 1.0, None, {"tpulaunch": "run"}, exit_code, "node", error_type)


def view(state: RunState, exit_code=None) -> RunView:
    return RunView("r1", state, 0, exit_code=exit_code)


@pytest.mark.parametrize("j, v, state", [
    (None, None, RunState.UNKNOWN),  # the cluster does not know it (a restarted head): never invented
    (job("PENDING"), None, RunState.PENDING),
    (job("RUNNING"), None, RunState.PENDING),  # the supervisor has not written its first status
    (job("RUNNING"), view(RunState.RUNNING), RunState.RUNNING),
    (job("RUNNING"), view(RunState.RESTARTING), RunState.RESTARTING),
    (job("RUNNING"), view(RunState.SUCCEEDED), RunState.RUNNING),  # its last words: the job is not over yet
    (job("SUCCEEDED", 0), view(RunState.SUCCEEDED, 0), RunState.SUCCEEDED),
    (job("FAILED", 3), view(RunState.FAILED, 3), RunState.FAILED),
    (job("FAILED", 3), None, RunState.FAILED),
    (job("STOPPED"), view(RunState.RUNNING), RunState.STOPPED),
    (job("FAILED", None, "JOB_SUPERVISOR_ACTOR_DIED"), view(RunState.RUNNING), RunState.LOST),
    (job("FAILED", 143), view(RunState.STOPPED, 143), RunState.STOPPED),
])
def test_run_state(j, v, state):
    assert run_state(j, v) is state


def test_run_exit_code_prefers_the_runs_own():
    assert run_exit_code(job("RUNNING"), view(RunState.RUNNING)) is None
    assert run_exit_code(job("STOPPED"), view(RunState.STOPPED, 143)) == 143  # Ray gives a stopped job no code
    assert run_exit_code(job("FAILED", 75), None) == 75
    assert run_exit_code(None, None) is None


def test_a_request_crosses_the_job_boundary_whole():
    req = LaunchRequest(script="train.py", args=("--lr", "0.1", "a b; rm -rf /"), env=("X=1",),
                        slices=SliceRequest(topology="2x8", num_slices=2, dcn="data=2"), max_restarts=2,
                        keep_children=True, timeout=3600.0, placement="ici")
    doc = request_document(req)
    assert json.loads(doc)["schema"] == "tpulaunch.request/v1"
    assert read_request_document(doc) == req


@pytest.mark.parametrize("data, words", [
    (b'{"schema": "tpulaunch.request/v2", "request": {}}', "'tpulaunch.request/v2', this tpulaunch reads"),
    (b'{"request": {}}', "is None, this tpulaunch reads"),
    (b"\xff\xfe", "not a JSON document"),
    (b"[1, 2]", "is None, this tpulaunch reads"),
    (b'{"schema": "tpulaunch.request/v1", "request": {"script": "a", "bogus": 1, "slices": {}}}', "does not fit"),
    (b"x" * (2 << 20), "more than"),
])
def test_a_request_from_another_version_is_one_line(data, words):
    with pytest.raises(TpulaunchError) as e:
        read_request_document(data)
    assert words in e.value.line() and "\n" not in e.value.line()


def test_the_supervisors_command_line_names_only_where_the_request_is():
    line = supervisor_entrypoint("20261125-x", "/opt/my py/bin/python3", "/work/dir with space")
    words = shlex.split(line)
    assert words[:3] == ["cd", "/work/dir with space", "&&"]
    assert words[3:7] == ["exec", "/opt/my py/bin/python3", "-m", "tpulaunch"]
    assert words[7:] == ["supervise", "--request", request_uri("20261125-x")]
